"""GGUF quantized tensors in their own bits: integers and group parameters for the CPU integer-dot matmul.

Runs in worker processes while a GGUF checkpoint loads on the CPU fast path. `repack` turns a tensor's
stored blocks into a `Repacked` weight: integers q [N, K], scales (and offsets) per row and group of
32 inputs (16 for Q6_K), and the `kernels.qgemm.QFormat` that makes them weights, with no rounding:
Q8_0 becomes i8 (w = q * scale), Q4_0 / Q5_0 / Q6_K u4 / u5 / u6 with their zero point 8 / 16 / 32, Q4_1 /
Q5_1 / Q4_K / Q5_K u4 / u5 with offsets (w = q * scale + offset). The 32-wide types keep their float16
scales and mins as float16 (as many bytes as the file's blocks). The K-quants keep their own form
(superblock formats): int8 sub-scales (and 6-bit mins) per group and float32 d (and -dmin) per 256
inputs (`supers`); a scale is d times its sub-scale and an offset -dmin times its min, both exact in
float32 (`flat()` computes them, for a slice that cuts a superblock). The field
layouts are those `workers.gguf.dequant` reads, which match the `gguf` package's reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

from kernels.native import use_native
from kernels.qgemm import SUPER, QFormat, pack_qweight
from workers.gguf.dequant import (
    _CHUNK_ELEMENTS,
    _K_SCALE_SIZE,
    _bits,
    _f16,
    _k_scale_min,
    _nibbles,
    _q5_low_high,
)

_T = GGMLQuantizationType


@dataclass
class Repacked:
    """A [N, K] weight as integers and per-group parameters (see the module docstring)."""

    q: torch.Tensor  # int8 (i8) or uint8 (u4 / u5 / u6) [N, K]
    scales: torch.Tensor  # float32 [N, K / group] (int8 sub-scales with fmt.superblock)
    offsets: torch.Tensor | None  # the same when fmt.offsets (int8 mins with fmt.superblock)
    fmt: QFormat
    supers: torch.Tensor | None = None  # float32 [N, K / 256, 1 or 2] with fmt.superblock: d (, -dmin)

    @property
    def rows(self) -> int:
        return int(self.q.shape[0])

    def flat(self) -> Repacked:
        """The same weights with float32 scales and offsets per group."""
        if self.supers is None:
            return self
        n, groups = self.scales.shape
        sup = self.supers.repeat_interleave(self.fmt.subs, dim=1)  # [N, groups, P]
        scales = self.scales.float() * sup[..., 0]
        offsets = None if self.offsets is None else self.offsets.float() * sup[..., 1]
        return Repacked(self.q, scales.view(n, groups), offsets, self.fmt.flat())

    def narrow_rows(self, start: int, length: int) -> Repacked:
        off = None if self.offsets is None else self.offsets.narrow(0, start, length)
        sup = None if self.supers is None else self.supers.narrow(0, start, length)
        q, scales = self.q.narrow(0, start, length), self.scales.narrow(0, start, length)
        return Repacked(q, scales, off, self.fmt, sup)

    def narrow_cols(self, start: int, length: int) -> Repacked:
        group = self.fmt.group
        if start % group or length % group:
            raise ValueError(f"inputs {start}..{start + length} cut its groups of {group}")
        if self.supers is not None and (start % SUPER or length % SUPER):
            return self.flat().narrow_cols(start, length)
        g0, gn = start // group, length // group
        off = None if self.offsets is None else self.offsets[:, g0 : g0 + gn]
        sup = None if self.supers is None else self.supers[:, start // SUPER : (start + length) // SUPER]
        q = self.q[:, start : start + length]
        return Repacked(q, self.scales[:, g0 : g0 + gn], off, self.fmt, sup)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [N, K] values in `dtype`: the float32 operations of `workers.gguf.dequant` in its order
        ((q - zero) * scale, or q * scale + offset, where its offsets are minus the mins it subtracts),
        so bit for bit its result; in chunks of rows."""
        if self.supers is not None:
            return self.flat().dequantize(dtype)
        n, k = self.rows, int(self.q.shape[1])
        group, out = self.fmt.group, torch.empty(n, k, dtype=dtype)
        step = max(1, _CHUNK_ELEMENTS // max(1, k))
        for r in range(0, n, step):
            q = self.q[r : r + step].to(torch.float32)
            if self.fmt.zero:
                q -= self.fmt.zero
            w = q.view(q.shape[0], k // group, group) * self.scales[r : r + step].unsqueeze(-1)
            if self.offsets is not None:
                w = w + self.offsets[r : r + step].unsqueeze(-1)
            out[r : r + step] = w.view(q.shape[0], k)
        return out

    def pad_rows(self, rows: int) -> Repacked:
        """Zero rows appended up to `rows` (a vocabulary shard past the vocabulary's end)."""
        extra = rows - self.rows
        if extra <= 0:
            return self

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.cat((t, torch.zeros(extra, *t.shape[1:], dtype=t.dtype)))

        off = None if self.offsets is None else pad(self.offsets)
        sup = None if self.supers is None else pad(self.supers)
        return Repacked(pad(self.q), pad(self.scales), off, self.fmt, sup)

    def pack(self) -> torch.Tensor:
        """The `kernels.qgemm.pack_qweight` blocks of this weight."""
        return pack_qweight(self.q, self.scales, self.fmt, self.offsets, self.supers)


def concat(parts: list[Repacked]) -> Repacked:
    """Parts of one format stacked by rows (the shards of a fused projection)."""
    assert len({p.fmt for p in parts}) == 1, "one format"

    def cat(name: str) -> torch.Tensor | None:
        got = [getattr(p, name) for p in parts]
        return None if got[0] is None else torch.cat(got)

    scales = cat("scales")
    assert scales is not None
    return Repacked(torch.cat([p.q for p in parts]), scales, cat("offsets"), parts[0].fmt, cat("supers"))


def _q8_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    return b[:, 2:].contiguous().view(torch.int8), _f16(b[:, :2]), None


def _q4_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    return _nibbles(b[:, 2:], 1, 16).reshape(b.shape[0], 32), _f16(b[:, :2]), None


def _q4_1(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _nibbles(b[:, 4:], 1, 16).reshape(b.shape[0], 32), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    return _q5_low_high(b[:, 2:6], b[:, 6:]), _f16(b[:, :2]), None


def _q5_1(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _q5_low_high(b[:, 4:8], b[:, 8:]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _k_params(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: per sub-block of 32 the 6-bit scale and min (int8, (n, 8)), and (d, -dmin) (n, 2)."""
    sc, mn = _k_scale_min(b[:, 4 : 4 + _K_SCALE_SIZE])
    sup = torch.cat((_f16(b[:, :2]), -_f16(b[:, 2:4])), dim=1)
    return sc.to(torch.int8), mn.to(torch.int8), sup


def _q4_k(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    scale, offset, sup = _k_params(b)
    return _nibbles(b[:, 4 + _K_SCALE_SIZE :], 4, 32).reshape(b.shape[0], QK_K), scale, offset, sup


def _q5_k(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    n, start = b.shape[0], 4 + _K_SCALE_SIZE
    scale, offset, sup = _k_params(b)
    qh = _bits(b[:, start : start + QK_K // 8], 1, 32, 1).reshape(n, -1, 32)
    ql = _nibbles(b[:, start + QK_K // 8 :], 4, 32).reshape(n, -1, 32)
    return (ql | (qh << 4)).reshape(n, QK_K), scale, offset, sup


def _q6_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, torch.Tensor]:
    n = b.shape[0]
    ql_end, qh_end, sc_end = QK_K // 2, QK_K // 2 + QK_K // 4, QK_K // 2 + QK_K // 4 + QK_K // 16
    scales = b[:, qh_end:sc_end].contiguous().view(torch.int8)
    ql = _nibbles(b[:, :ql_end], 2, 64).reshape(n, -1, 32)
    qh = _bits(b[:, ql_end:qh_end], 2, 32, 2).reshape(n, -1, 32)
    q = (ql | (qh << 4)).reshape(n, QK_K)
    return q, scales, None, _f16(b[:, sc_end:])


# type -> (the fields of (n_blocks, type_size) bytes: q (n, block), scales and offsets (n, block / group),
# the format)
_REPACK: dict[int, tuple[Callable[[torch.Tensor], tuple], QFormat]] = {
    _T.Q8_0: (_q8_0, QFormat("i8", half=True)),
    _T.Q6_K: (_q6_k, QFormat("u6", group=16, zero=32, superblock=True)),
    _T.Q4_0: (_q4_0, QFormat("u4", zero=8, half=True)),
    _T.Q5_0: (_q5_0, QFormat("u5", zero=16, half=True)),
    _T.Q4_1: (_q4_1, QFormat("u4", offsets=True, half=True)),
    _T.Q5_1: (_q5_1, QFormat("u5", offsets=True, half=True)),
    _T.Q4_K: (_q4_k, QFormat("u4", offsets=True, superblock=True)),
    _T.Q5_K: (_q5_k, QFormat("u5", offsets=True, superblock=True)),
}
REPACKABLE: frozenset[int] = frozenset(int(t) for t in _REPACK)


def format_of(qtype: int) -> QFormat:
    """The packed format of a repackable GGUF type."""
    return _REPACK[qtype][1]


def repack(raw: torch.Tensor, qtype: int, shape: tuple[int, int]) -> Repacked:
    """A 2-D tensor's stored bytes (uint8, as in the file) -> its integers and group parameters (the
    native op where it runs, else `repack_torch`)."""
    fmt = _REPACK[qtype][1]
    if use_native("cpu"):
        n, k = shape
        q, scales, offsets, supers = torch.ops.ember.gguf_decode(raw.reshape(-1), int(qtype), n, k)
        return Repacked(q, scales, offsets if fmt.offsets else None, fmt, supers if fmt.superblock else None)
    return repack_torch(raw, qtype, shape)


def repack_torch(raw: torch.Tensor, qtype: int, shape: tuple[int, int]) -> Repacked:
    """Reference of `repack`."""
    fn, fmt = _REPACK[qtype]
    n, k = shape
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    assert k % block == 0 and raw.numel() == n * k // block * type_size, "whole blocks"
    q, scales, offsets, *sup = fn(raw.reshape(-1, type_size))
    groups = k // fmt.group
    return Repacked(
        q.reshape(n, k),
        scales.reshape(n, groups).contiguous(),
        None if offsets is None else offsets.reshape(n, groups).contiguous(),
        fmt,
        sup[0].reshape(n, k // QK_K, -1).contiguous() if sup else None,
    )
