"""bf16 and fp8 weight x activation matmuls for CPUs: packed weight layouts, the native ops, torch references.

Runs in worker processes (and the preload daemon) on CPU engines. `pack_bf16` turns a [N, K] bf16
weight into blocks of 16 output rows laid out for one 256-bit load per k, `pack_fp8` a float8 e4m3
weight into blocks of 16 rows with each k's 16 bytes together (see csrc/cpu_gemm.cpp); `gemm_bf16` /
`gemm_fp8` compute x @ W.T from those layouts with the native AVX2 + FMA ops (kernels/native.py builds
them); the `*_torch` functions are the references (unpack, then a float32 matmul).
`select_linear_kernel` picks "cpu_bf16" or "torch" once per process.
"""

from __future__ import annotations

import torch

from kernels.native import use_native

BLOCK = 16


def _native_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and use_native(weight.device)


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> bf16 [ceil(N/16), K, 16]: per k, lane i of a block holds rows i and i + 8 (low, high).
    The native op where it runs (the load-time packing of every linear), else `pack_bf16_torch`."""
    weight = weight.to(torch.bfloat16)
    return torch.ops.ember.pack_weight(weight) if _native_pack(weight) else pack_bf16_torch(weight)


def pack_bf16_torch(weight: torch.Tensor) -> torch.Tensor:
    """Reference of `pack_bf16`."""
    n, k = weight.shape
    nb = -(-n // BLOCK)
    padded = torch.zeros(nb * BLOCK, k, dtype=torch.bfloat16, device=weight.device)
    padded[:n] = weight
    # [NB, half, lane, K] -> [NB, K, lane, half]: row 16b + 8h + i lands at [b, k, 2i + h]
    return padded.view(nb, 2, 8, k).permute(0, 3, 2, 1).contiguous().view(nb, k, BLOCK)


def unpack_bf16(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The [n, K] weight back from `pack_bf16`'s layout."""
    nb, k, _ = packed.shape
    return packed.view(nb, k, 8, 2).permute(0, 3, 2, 1).reshape(nb * BLOCK, k)[:n]


def pack_fp8(weight: torch.Tensor) -> torch.Tensor:
    """float8 [N, K] -> float8 [ceil(N/16), K, 16]: block b holds rows 16b..16b+15 side by side per k
    (the native op where it runs, else `pack_fp8_torch`)."""
    return torch.ops.ember.pack_weight(weight) if _native_pack(weight) else pack_fp8_torch(weight)


def pack_fp8_torch(weight: torch.Tensor) -> torch.Tensor:
    """Reference of `pack_fp8`."""
    n, k = weight.shape
    nb = -(-n // BLOCK)
    padded = torch.zeros(nb * BLOCK, k, dtype=torch.uint8, device=weight.device)
    padded[:n] = weight.view(torch.uint8)
    return padded.view(nb, BLOCK, k).transpose(1, 2).contiguous().view(weight.dtype)


def unpack_fp8(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The [n, K] weight back from `pack_fp8`'s layout."""
    nb, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(nb * BLOCK, k)[:n]


def gemm_fp8_torch(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """Reference: x [M, K] @ (W * scale).T in float32, returned in x's dtype."""
    return ((x.float() @ unpack_fp8(packed, n).float().t()) * scale).to(x.dtype)


def gemm_fp8(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., K] @ (W * scale).T with the native op (float32 accumulation), in x's dtype."""
    lead = x.shape[:-1]
    return torch.ops.ember.gemm_fp8(x.reshape(-1, x.shape[-1]), packed, scale, n).view(*lead, n)


def gemm_bf16_torch(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """Reference: x [M, K] @ W.T in float32, returned in x's dtype."""
    return (x.float() @ unpack_bf16(packed, n).float().t()).to(x.dtype)


def gemm_bf16(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., K] @ W.T with the native op (float32 accumulation), in x's dtype."""
    lead = x.shape[:-1]
    out = torch.ops.ember.gemm_bf16(x.reshape(-1, x.shape[-1]), packed, n)
    return out.view(*lead, n)


def select_linear_kernel(device: torch.device | str, dtype: torch.dtype) -> str:
    """ "cpu_bf16" for bf16 weights where the native ops run (`kernels.native.use_native`), else "torch"."""
    return "cpu_bf16" if dtype == torch.bfloat16 and use_native(device) else "torch"
