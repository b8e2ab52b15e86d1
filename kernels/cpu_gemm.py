"""bf16 weight x activation matmul for CPUs: a packed weight layout, the native op and its torch reference.

Runs in worker processes (and the preload daemon) on CPU engines with bf16 weights. `pack_bf16` turns
a [N, K] weight into blocks of 16 output rows laid out for one 256-bit load per k (see
csrc/cpu_gemm.cpp); `gemm_bf16` computes x @ W.T from that layout with the native AVX2 + FMA op
(kernels/native.py builds it); `gemm_bf16_torch` is the reference (unpack, then a float32 matmul).
`select_linear_kernel` picks "cpu_bf16" or "torch" once per process.
"""

from __future__ import annotations

import torch

from kernels.native import use_native

BLOCK = 16


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> bf16 [ceil(N/16), K, 16]: per k, lane i of a block holds rows i and i + 8 (low, high)."""
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
