"""Group-quantized weights x int8-quantized activations on CPUs: packed layouts, the native op, references.

Runs in worker processes (and the preload daemon) on CPU engines. A weight is integers q [N, K] with
parameters per row and group of G k (32; 16 for i8 and u6): `QFormat` names how they are stored (i8: signed
bytes; u4 / u5 / u6: unsigned 4 / 5 / 6 bits) and what turns them into weights (w = (q - zero) * scale, or
q * scale + offset). `pack_qweight` lays them out for `torch.ops.ember.qgemm` (csrc/cpu_qgemm.cpp):
blocks of 16 rows, each a sequence of groups (the group's parameters, then its steps of 4 k), K
padded to a multiple of 32. The K-quants keep their own compact parameters (`superblock`): per 256 k a
float32 d (and -dmin) per row, then each group's signed-byte sub-scales (and sub-mins) before its
steps, so a Q4_K weight streams 4.75 bits per weight instead of 6. The op quantizes each activation row
to int8 first (`quantize_activations`): per 32 k as GGUF's Q8_0 does, and per 256 k for the u4 / u5 / u6
superblocks (as GGUF's Q8_K), whose integer sums then run over a whole superblock; `qgemm_torch` is its
reference (the same quantization, then a float32 matmul with the dequantized weight).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.native import use_native

BLOCK = 16
XGROUP = 32  # k per activation scale
SUPER = 256  # k per superblock
KINDS = ("i8", "u4", "u5", "u6")
STEP_BYTES = {"i8": 64, "u4": 32, "u5": 40, "u6": 48}


@dataclass(frozen=True)
class QFormat:
    """How a packed weight's integers become weights (part of the layer's cached attributes)."""

    kind: str  # i8 | u4 | u5 | u6
    group: int = 32
    zero: int = 0  # w = (q - zero) * scale
    offsets: bool = False  # w = q * scale + offset instead
    half: bool = False  # parameters stored as float16 (where they are float16 values: GGUF's)
    superblock: bool = False  # int8 sub-parameters times a float32 per row and 256 k (the K-quants')

    def __post_init__(self) -> None:
        assert self.kind in KINDS, f"unknown packed kind {self.kind!r}"
        sixteen = (self.kind == "i8" and not self.mins) or self.kind == "u6"
        assert (self.group == 32 and self.kind != "u6") or (self.group == 16 and sixteen), "bad group"
        assert not (self.superblock and self.half), "superblocks: float32 d"

    @property
    def params(self) -> int:
        """The op's parameter mode: 0 float32, 1 float16, 2 superblocks."""
        return 2 if self.superblock else int(self.half)

    @property
    def xgroup(self) -> int:
        """k per activation scale: 256 for the u-kinds' superblocks (integer sums over a superblock,
        as GGUF's Q8_K activations), else 32 (Q8_0's)."""
        return SUPER if self.superblock and self.kind != "i8" else XGROUP

    @property
    def subs(self) -> int:
        """Groups per packed unit along k (a superblock's, or 1)."""
        return SUPER // self.group if self.superblock else 1

    def flat(self) -> QFormat:
        """The same weights with float32 parameters per group."""
        return QFormat(self.kind, self.group, self.zero, self.offsets)

    @property
    def mins(self) -> bool:
        return self.offsets or self.zero != 0

    def attrs(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "group": self.group,
            "zero": self.zero,
            "offsets": self.offsets,
            "half": self.half,
            "superblock": self.superblock,
        }


def padded_k(k: int) -> int:
    return -(-k // XGROUP) * XGROUP


def param_count(fmt: QFormat) -> int:
    return 2 if fmt.offsets else 1


def group_bytes(fmt: QFormat) -> int:
    """Bytes per block and packed unit: a group's parameters (16 scales, and 16 offsets; float32,
    float16 or int8 sub-parameters) and its steps; a superblock's 16 d (and 16 -dmin) first."""
    size = 1 if fmt.superblock else 2 if fmt.half else 4
    group = param_count(fmt) * BLOCK * size + fmt.group // 4 * STEP_BYTES[fmt.kind]
    return fmt.superblock * param_count(fmt) * BLOCK * 4 + fmt.subs * group


def pack_qweight(
    q: torch.Tensor,
    scales: torch.Tensor,
    fmt: QFormat,
    offsets: torch.Tensor | None = None,
    supers: torch.Tensor | None = None,
) -> torch.Tensor:
    """Integers q [N, K] (int8 for i8, uint8 in 0..15 / 0..31 / 0..63 for u4 / u5 / u6) with
    scales [N, ceil(K / G)] (and offsets, same shape, when fmt.offsets) -> uint8 [NB, units,
    group_bytes]: per block of 16 rows and group, the rows' scales (then offsets) as float32 (float16
    with fmt.half), then the group's steps of 4 k. With fmt.superblock (K a multiple of 256) the
    scales and offsets are int8 sub-parameters and supers float32 [N, K / 256, 1 or 2] (d, and -dmin
    with offsets): a unit is a superblock, 16 d (16 -dmin), then its groups with int8 parameters.
    Padding is 0. The native op where it runs (every packed layer at load), else
    `pack_qweight_torch`."""
    assert (offsets is not None) == fmt.offsets, "offsets exactly when the format has them"
    assert (supers is not None) == fmt.superblock, "supers exactly for superblock formats"
    if q.device.type == "cpu" and use_native(q.device):
        none = torch.empty(0, dtype=torch.float32)
        kind = KINDS.index(fmt.kind)
        return torch.ops.ember.qpack(
            q,
            scales,
            none if offsets is None else offsets,
            none if supers is None else supers,
            kind,
            fmt.group,
            fmt.params,
        )
    return pack_qweight_torch(q, scales, fmt, offsets, supers)


def pack_qweight_torch(
    q: torch.Tensor,
    scales: torch.Tensor,
    fmt: QFormat,
    offsets: torch.Tensor | None = None,
    supers: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of `pack_qweight`."""
    n, k = q.shape
    kp, nb = padded_k(k), -(-n // BLOCK)
    groups, steps = kp // fmt.group, kp // 4
    assert scales.shape == (n, -(-k // fmt.group)), "one scale per row and group"
    assert (offsets is not None) == fmt.offsets, "offsets exactly when the format has them"
    rows = torch.zeros(nb * BLOCK, kp, dtype=torch.uint8)
    rows[:n, :k] = q.view(torch.uint8) if q.dtype == torch.int8 else q.to(torch.uint8)
    # [NB, half, row, step, 4] -> [NB, step, half, row, 4]: byte 32 h + 4 i + j of a step = row 8 h + i, k j
    by_step = rows.view(nb, 2, 8, steps, 4).permute(0, 3, 1, 2, 4)
    if fmt.kind == "i8":
        data = by_step.reshape(nb, groups, -1)
    else:
        low = by_step & 0x0F
        data = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, groups, -1)
        if fmt.kind in ("u5", "u6"):
            # after each group's nibble bytes (u5: 8 x 32, u6: 4 x 32), 2 planes of 32 bytes: bit i = the
            # fifth bit at step i (u5), bits 2 i and 2 i + 1 the fifth and sixth (u6)
            width = 1 if fmt.kind == "u5" else 2
            bits = ((by_step >> 4) & (2**width - 1)).reshape(nb, groups, fmt.group // 4, 64)
            planes = bits[:, :, 0].clone()
            for i in range(1, fmt.group // 4):
                planes |= bits[:, :, i] << (width * i)
            data = torch.cat((data, planes), dim=2)
    per = [scales] + ([offsets] if offsets is not None else [])
    dtype = torch.int8 if fmt.superblock else torch.float16 if fmt.half else torch.float32
    params = torch.zeros(len(per), nb * BLOCK, groups, dtype=dtype)
    for i, p in enumerate(per):
        params[i, :n, : p.shape[1]] = p.to(params.dtype)
    # [P, NB, 16, G] -> [NB, G, P, 16] -> bytes
    params = params.view(len(per), nb, BLOCK, groups).permute(1, 3, 0, 2).contiguous()
    grouped = torch.cat((params.view(torch.uint8).reshape(nb, groups, -1), data), dim=2)
    if not fmt.superblock:
        return grouped.contiguous()
    assert supers is not None and k % SUPER == 0, "superblocks: K a multiple of 256, and their parameters"
    units = k // SUPER
    head = torch.zeros(nb * BLOCK, units, len(per), dtype=torch.float32)
    head[:n] = supers
    # [NB, 16, U, P] -> [NB, U, P, 16] -> bytes, then each unit's groups
    head = head.view(nb, BLOCK, units, len(per)).permute(0, 2, 3, 1).contiguous().view(torch.uint8)
    body = grouped.reshape(nb, units, -1)
    return torch.cat((head.reshape(nb, units, -1), body), dim=2).contiguous()


def unpack_qweight(packed: torch.Tensor, fmt: QFormat, n: int, k: int) -> torch.Tensor:
    """The float32 [n, k] weight of `pack_qweight`'s layout."""
    nb, units, _ = packed.shape
    count = param_count(fmt)
    if fmt.superblock:  # d (and -dmin) times each group's int8 sub-parameters, as float32 per group
        head = count * BLOCK * 4
        sup = packed[..., :head].contiguous().view(torch.float32).view(nb, units, count, BLOCK)
        body = packed[..., head:].reshape(nb, units * fmt.subs, -1)
        sub = body[..., : count * BLOCK].contiguous().view(torch.int8).float()
        sub = sub.view(nb, units, fmt.subs, count, BLOCK) * sup.unsqueeze(2)
        flat = fmt.flat()
        params = sub.reshape(nb, units * fmt.subs, count * BLOCK).contiguous().view(torch.uint8)
        return unpack_qweight(torch.cat((params, body[..., count * BLOCK :]), dim=2), flat, n, k)
    groups = units
    kp, steps = groups * fmt.group, groups * fmt.group // 4
    dtype = torch.float16 if fmt.half else torch.float32
    head = count * BLOCK * dtype.itemsize
    per = packed[..., :head].contiguous().view(dtype).float().view(nb, groups, count, BLOCK)
    data = packed[..., head:]
    if fmt.kind == "i8":
        q = data.contiguous().view(torch.int8).view(nb, steps, 2, 8, 4).float()
    else:
        nibbles = fmt.group // 4 * 32
        nib = data[..., :nibbles].reshape(nb, steps, 8, 4)
        q = torch.stack((nib & 0x0F, nib >> 4), dim=2).int()  # [NB, step, half, row, 4]
        if fmt.kind in ("u5", "u6"):
            width = 1 if fmt.kind == "u5" else 2
            planes = data[..., nibbles:].reshape(nb, groups, 1, 64).int()
            shifts = width * torch.arange(fmt.group // 4, dtype=torch.int32).view(1, 1, -1, 1)
            bits = (planes >> shifts) & (2**width - 1)  # [NB, g, step, 64]
            q = q | (bits.reshape(nb, steps, 2, 8, 4) << 4)
        q = q.float()
    q = q.permute(0, 2, 3, 1, 4).reshape(nb * BLOCK, kp)  # rows, k
    per = per.permute(2, 0, 3, 1).reshape(count, nb * BLOCK, groups)
    scale = per[0].repeat_interleave(fmt.group, dim=1)
    w = q * scale + per[1].repeat_interleave(fmt.group, dim=1) if fmt.offsets else (q - fmt.zero) * scale
    return w[:n, :k]


def quantize_activations(x: torch.Tensor, group: int = XGROUP) -> torch.Tensor:
    """x [M, K] as the op sees it: per row and `group` k (a format's `xgroup`), round(x / d) * d with
    d = max |x| / 127 (float32)."""
    m, k = x.shape
    kp = -(-k // group) * group
    xp = torch.zeros(m, kp, dtype=torch.float32)
    xp[:, :k] = x.float()
    g = xp.view(m, kp // group, group)
    d = g.abs().amax(dim=2, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(g * inv) * d).view(m, kp)[:, :k]


def qgemm_torch(x: torch.Tensor, packed: torch.Tensor, fmt: QFormat, n: int) -> torch.Tensor:
    """Reference: quantized activations @ dequantized weight.T in float32, in x's dtype."""
    k = x.shape[-1]
    x2 = quantize_activations(x.reshape(-1, k), fmt.xgroup)
    out = x2 @ unpack_qweight(packed, fmt, n, k).t()
    return out.to(x.dtype).view(*x.shape[:-1], n)


def qgemm(x: torch.Tensor, packed: torch.Tensor, fmt: QFormat, n: int) -> torch.Tensor:
    """x [..., K] @ W.T with the native op, in x's dtype."""
    lead = x.shape[:-1]
    kind = KINDS.index(fmt.kind)
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.ops.ember.qgemm(x2, packed, kind, fmt.group, fmt.zero, fmt.offsets, fmt.params, n)
    return y.view(*lead, n)
