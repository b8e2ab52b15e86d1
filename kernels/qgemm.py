"""Group-quantized weights x int8-quantized activations on CPUs: packed layouts, the native op, references.

Runs in worker processes (and the preload daemon) on CPU engines. A weight is integers q [N, K] with
parameters per row and group of G k (32; 16 for i8): `QFormat` names how they are stored (i8: signed
bytes; u4 / u5: unsigned 4 / 5 bits) and what turns them into weights (w = (q - zero) * scale, or
q * scale + offset). `pack_qweight` lays them out for `torch.ops.ember.qgemm` (csrc/cpu_qgemm.cpp):
blocks of 16 rows, each a sequence of groups (the group's parameters, then its steps of 4 k), K
padded to a multiple of 32. The op quantizes each activation row
per 32 k to int8 first (`quantize_activations`, as GGUF's Q8_0 does); `qgemm_torch` is its reference
(the same quantization, then a float32 matmul with the dequantized weight).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.native import use_native

BLOCK = 16
XGROUP = 32  # k per activation scale
KINDS = ("i8", "u4", "u5")
STEP_BYTES = {"i8": 64, "u4": 32, "u5": 40}


@dataclass(frozen=True)
class QFormat:
    """How a packed weight's integers become weights (part of the layer's cached attributes)."""

    kind: str  # i8 | u4 | u5
    group: int = 32
    zero: int = 0  # w = (q - zero) * scale
    offsets: bool = False  # w = q * scale + offset instead
    half: bool = False  # parameters stored as float16 (where they are float16 values: GGUF's)

    def __post_init__(self) -> None:
        assert self.kind in KINDS, f"unknown packed kind {self.kind!r}"
        assert self.group == 32 or (self.group == 16 and self.kind == "i8" and not self.mins), "bad group"

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
        }


def padded_k(k: int) -> int:
    return -(-k // XGROUP) * XGROUP


def group_bytes(fmt: QFormat) -> int:
    """Bytes per block and group: the parameters (16 scales, and 16 offsets), then the steps."""
    return (2 if fmt.offsets else 1) * BLOCK * (2 if fmt.half else 4) + fmt.group // 4 * STEP_BYTES[fmt.kind]


def pack_qweight(
    q: torch.Tensor, scales: torch.Tensor, fmt: QFormat, offsets: torch.Tensor | None = None
) -> torch.Tensor:
    """Integers q [N, K] (int8 for i8, uint8 in 0..15 / 0..31 for u4 / u5) with scales [N, ceil(K / G)]
    (and offsets, same shape, when fmt.offsets) -> uint8 [NB, Kp / G, group_bytes]: per block of 16 rows and
    group, the rows' scales (then offsets) as float32 (float16 with fmt.half), then the group's steps of
    4 k. Padding is 0. The native op where it runs (every packed layer at load), else `pack_qweight_torch`."""
    assert (offsets is not None) == fmt.offsets, "offsets exactly when the format has them"
    if q.device.type == "cpu" and use_native(q.device):
        none = torch.empty(0, dtype=torch.float32)
        kind = KINDS.index(fmt.kind)
        return torch.ops.ember.qpack(
            q, scales, none if offsets is None else offsets, kind, fmt.group, fmt.half
        )
    return pack_qweight_torch(q, scales, fmt, offsets)


def pack_qweight_torch(
    q: torch.Tensor, scales: torch.Tensor, fmt: QFormat, offsets: torch.Tensor | None = None
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
        if fmt.kind == "u5":
            # after each group's 8 x 32 nibble bytes, 2 planes of 32 bytes: bit i = the fifth bit at step i
            bits = ((by_step >> 4) & 1).reshape(nb, groups, 8, 64)
            planes = bits[:, :, 0].clone()
            for i in range(1, 8):
                planes |= bits[:, :, i] << i
            data = torch.cat((data, planes), dim=2)
    per = [scales] + ([offsets] if offsets is not None else [])
    params = torch.zeros(len(per), nb * BLOCK, groups, dtype=torch.float16 if fmt.half else torch.float32)
    for i, p in enumerate(per):
        params[i, :n, : p.shape[1]] = p.to(params.dtype)
    # [P, NB, 16, G] -> [NB, G, P, 16] -> bytes
    params = params.view(len(per), nb, BLOCK, groups).permute(1, 3, 0, 2).contiguous()
    return torch.cat((params.view(torch.uint8).reshape(nb, groups, -1), data), dim=2).contiguous()


def unpack_qweight(packed: torch.Tensor, fmt: QFormat, n: int, k: int) -> torch.Tensor:
    """The float32 [n, k] weight of `pack_qweight`'s layout."""
    nb, groups, _ = packed.shape
    kp, steps, count = groups * fmt.group, groups * fmt.group // 4, 2 if fmt.offsets else 1
    dtype = torch.float16 if fmt.half else torch.float32
    head = count * BLOCK * dtype.itemsize
    per = packed[..., :head].contiguous().view(dtype).float().view(nb, groups, count, BLOCK)
    data = packed[..., head:]
    if fmt.kind == "i8":
        q = data.contiguous().view(torch.int8).view(nb, steps, 2, 8, 4).float()
    else:
        nib = data[..., : 256 if fmt.kind == "u5" else None].reshape(nb, steps, 8, 4)
        q = torch.stack((nib & 0x0F, nib >> 4), dim=2).int()  # [NB, step, half, row, 4]
        if fmt.kind == "u5":
            planes = data[..., 256:].reshape(nb, groups, 1, 64).int()
            bits = (planes >> torch.arange(8, dtype=torch.int32).view(1, 1, 8, 1)) & 1  # [NB, g, step, 64]
            q = q | (bits.reshape(nb, steps, 2, 8, 4) << 4)
        q = q.float()
    q = q.permute(0, 2, 3, 1, 4).reshape(nb * BLOCK, kp)  # rows, k
    per = per.permute(2, 0, 3, 1).reshape(count, nb * BLOCK, groups)
    scale = per[0].repeat_interleave(fmt.group, dim=1)
    w = q * scale + per[1].repeat_interleave(fmt.group, dim=1) if fmt.offsets else (q - fmt.zero) * scale
    return w[:n, :k]


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the op sees it: per row and 32 k, round(x / d) * d with d = max |x| / 127 (float32)."""
    m, k = x.shape
    kp = padded_k(k)
    xp = torch.zeros(m, kp, dtype=torch.float32)
    xp[:, :k] = x.float()
    g = xp.view(m, kp // XGROUP, XGROUP)
    d = g.abs().amax(dim=2, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(g * inv) * d).view(m, kp)[:, :k]


def qgemm_torch(x: torch.Tensor, packed: torch.Tensor, fmt: QFormat, n: int) -> torch.Tensor:
    """Reference: quantized activations @ dequantized weight.T in float32, in x's dtype."""
    k = x.shape[-1]
    x2 = quantize_activations(x.reshape(-1, k))
    out = x2 @ unpack_qweight(packed, fmt, n, k).t()
    return out.to(x.dtype).view(*x.shape[:-1], n)


def qgemm(x: torch.Tensor, packed: torch.Tensor, fmt: QFormat, n: int) -> torch.Tensor:
    """x [..., K] @ W.T with the native op, in x's dtype."""
    lead = x.shape[:-1]
    kind = KINDS.index(fmt.kind)
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.ops.ember.qgemm(x2, packed, kind, fmt.group, fmt.zero, fmt.offsets, fmt.half, n)
    return y.view(*lead, n)
