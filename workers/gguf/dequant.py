"""Dequantizes GGUF tensor data to float tensors with whole-tensor torch ops.

Runs in worker processes, while weights are loaded from a GGUF file. Receives a tensor's bytes exactly
as stored (a uint8 tensor, often a read-only view of the file's memory map), its GGUF type id and its
logical shape in PyTorch order; returns a new tensor of that shape. Every quantized type is computed in
float32 with the same operations in the same order as the `gguf` package's numpy reference, so the
values are bit-for-bit equal to `gguf.quants.dequantize`, and only then cast to the requested dtype.
Blocks are processed in chunks so that peak memory stays near the size of the output.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

_T = GGMLQuantizationType

# Output elements dequantized per chunk. Intermediates are a few times this size; at 4 MiB of float32
# each they stay in cache and the allocator reuses them (measured about twice as fast as 16 Mi).
_CHUNK_ELEMENTS = 1024 * 1024

# Length in bytes of the packed 6-bit scales and mins of Q4_K and Q5_K.
_K_SCALE_SIZE = 12


def _view(field: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret (n, k) uint8 bytes as `dtype`, copying first when their layout forbids a view."""
    if not field.is_contiguous() or field.storage_offset() % dtype.itemsize:
        field = field.clone(memory_format=torch.contiguous_format)
    return field.view(dtype)


def _f16(field: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 bytes of little-endian float16 values -> (n, 1) float32."""
    return _view(field, torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """(n, groups * width) uint8 -> (n, groups, 2, width): the low then the high nibble of each byte."""
    qs = qs.reshape(qs.shape[0], groups, 1, width)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2)


def _bits(qh: torch.Tensor, groups: int, width: int, bits: int) -> torch.Tensor:
    """(n, groups * width) uint8 -> (n, groups, 8 // bits, width): fields of `bits` bits, lowest first."""
    qh = qh.reshape(qh.shape[0], groups, 1, width)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8).reshape(1, 1, -1, 1)
    return (qh >> shifts) & ((1 << bits) - 1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    x = blocks[:, 2:].view(torch.int8).to(torch.float32)
    return x * d


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks[:, :2])
    qs = _nibbles(blocks[:, 2:], 1, 16).reshape(n, -1).view(torch.int8) - 8
    return d * qs.to(torch.float32)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks[:, :2])
    m = _f16(blocks[:, 2:4])
    qs = _nibbles(blocks[:, 4:], 1, 16).reshape(n, -1).to(torch.float32)
    return (d * qs) + m


def _q5_low_high(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: (n, 4) high bits (a little-endian uint32) and (n, 16) low nibbles -> (n, 32) uint8."""
    n = qs.shape[0]
    shifts = torch.arange(8, dtype=torch.uint8)
    high = ((qh.unsqueeze(-1) >> shifts) & 1).reshape(n, 32)  # bit i of the uint32 is weight i
    low = _nibbles(qs, 1, 16).reshape(n, 32)
    return low | (high << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    qs = _q5_low_high(blocks[:, 2:6], blocks[:, 6:]).view(torch.int8) - 16
    return d * qs.to(torch.float32)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    m = _f16(blocks[:, 2:4])
    qs = _q5_low_high(blocks[:, 4:8], blocks[:, 8:]).to(torch.float32)
    return (d * qs) + m


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: (n, 12) packed 6-bit scales and mins -> two (n, 8) uint8."""
    n = scales.shape[0]
    scales = scales.reshape(n, 3, 4)
    d, m, m_d = scales[:, 0], scales[:, 1], scales[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: the (n, 8, 1) float32 scale and min of each sub-block of 32 weights."""
    n = blocks.shape[0]
    d = _f16(blocks[:, :2])
    dmin = _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4 : 4 + _K_SCALE_SIZE])
    scale = (d * sc.to(torch.float32)).reshape(n, -1, 1)
    offset = (dmin * mn.to(torch.float32)).reshape(n, -1, 1)
    return scale, offset


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dm = _k_scales(blocks)
    qs = _nibbles(blocks[:, 4 + _K_SCALE_SIZE :], 4, 32).reshape(n, -1, 32).to(torch.float32)
    return (d * qs - dm).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dm = _k_scales(blocks)
    start = 4 + _K_SCALE_SIZE
    qh = _bits(blocks[:, start : start + QK_K // 8], 1, 32, 1).reshape(n, -1, 32)
    ql = _nibbles(blocks[:, start + QK_K // 8 :], 4, 32).reshape(n, -1, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return (d * q - dm).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql_end, qh_end, sc_end = QK_K // 2, QK_K // 2 + QK_K // 4, QK_K // 2 + QK_K // 4 + QK_K // 16
    scales = blocks[:, qh_end:sc_end].view(torch.int8).to(torch.float32)
    d = _f16(blocks[:, sc_end:])
    d = (d * scales).reshape(n, QK_K // 16, 1)
    ql = _nibbles(blocks[:, :ql_end], 2, 64).reshape(n, -1, 32)
    qh = _bits(blocks[:, ql_end:qh_end], 2, 32, 2).reshape(n, -1, 32)
    q = (ql | (qh << 4)).view(torch.int8) - 32
    q = q.reshape(n, QK_K // 16, -1).to(torch.float32)
    return (d * q).reshape(n, QK_K)


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    # The reference widens the raw bits (int16 -> int32 << 16), which also keeps NaN payloads.
    return (_view(blocks, torch.int16).to(torch.int32) << 16).view(torch.float32)


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return _view(blocks, torch.float32)


# Each function maps (n_blocks, type_size) uint8 to (n_blocks, block_size) float32.
_BLOCK_DEQUANT: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    _T.F32: _f32,
    _T.F16: _f16,
    _T.BF16: _bf16,
    _T.Q8_0: _q8_0,
    _T.Q4_0: _q4_0,
    _T.Q4_1: _q4_1,
    _T.Q5_0: _q5_0,
    _T.Q5_1: _q5_1,
    _T.Q4_K: _q4_k,
    _T.Q5_K: _q5_k,
    _T.Q6_K: _q6_k,
}

# The float types whose bytes are already the values: stored dtype per type.
_STORED_FLOAT: dict[int, torch.dtype] = {
    _T.F32: torch.float32,
    _T.F16: torch.float16,
    _T.BF16: torch.bfloat16,
}

SUPPORTED: frozenset[int] = frozenset(int(t) for t in _BLOCK_DEQUANT)


def type_name(qtype: int) -> str:
    """The GGUF name of a tensor type id (`Q4_K`), or `type <id>` for an id GGUF does not define."""
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def nbytes(qtype: int, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of `shape` (PyTorch order, last dim quantized) takes when stored as `qtype`."""
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    cols = shape[-1] if shape else 1
    if cols % block_size:
        raise ValueError(
            f"GGUF {type_name(qtype)} tensor of shape {tuple(shape)}: last dim {cols} is not a multiple "
            f"of the block size {block_size}"
        )
    return math.prod(shape) // block_size * type_size


def dequantize(
    raw: torch.Tensor, qtype: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantize a GGUF tensor's stored bytes to a new tensor of `shape` and `dtype`.

    `raw` holds the bytes as stored in the file (uint8, any shape, contiguous or not; it is only
    read). `shape` is in PyTorch order, the reverse of GGUF's `ne`, with the quantized dim last.
    Values are those of `gguf.quants.dequantize` bit for bit, cast to `dtype` at the end.
    """
    if qtype not in SUPPORTED:
        supported = ", ".join(sorted(type_name(t) for t in SUPPORTED))
        raise ValueError(f"GGUF tensor type {type_name(qtype)} is not supported; supported: {supported}")
    if raw.dtype != torch.uint8:
        raise TypeError(f"GGUF tensor bytes must be a uint8 tensor, got {raw.dtype}")
    shape = tuple(int(s) for s in shape)
    need = nbytes(qtype, shape)
    if raw.numel() != need:
        raise ValueError(
            f"GGUF {type_name(qtype)} tensor of shape {shape} needs {need} bytes, got {raw.numel()}"
        )
    stored = _STORED_FLOAT.get(qtype)
    if stored is not None and stored == dtype:
        # The bytes are the values: one copy, so the result never aliases the (read-only) file.
        return raw.clone(memory_format=torch.contiguous_format).reshape(-1).view(dtype).reshape(shape)

    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    n_blocks = need // type_size
    blocks = raw.reshape(n_blocks, type_size)  # a view when raw is contiguous
    out = torch.empty(n_blocks, block_size, dtype=dtype)
    fn = _BLOCK_DEQUANT[qtype]
    step = max(1, _CHUNK_ELEMENTS // block_size)
    for start in range(0, n_blocks, step):
        out[start : start + step].copy_(fn(blocks[start : start + step]))
    return out.reshape(shape)
