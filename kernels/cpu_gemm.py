"""bf16 and fp8 weight x activation matmuls for CPUs: packed weight layouts, the native ops, torch references.

Runs in worker processes (and the preload daemon) on CPU engines. `pack_bf16` turns a [N, K] bf16
weight into blocks of 16 output rows, in a layout that the native build decides (`bf16_layout`):
"packed16", one 256-bit load per k for the AVX2 / AVX-512 FMA kernels (csrc/cpu_gemm.cpp); "amx32",
AMX weight tiles of 32 k (csrc/cpu_amx.cpp, where the build targets AMX-BF16 and the OS grants it);
"pairs32", the same bytes for the AVX512-BF16 `vdpbf16ps` kernels (csrc/cpu_dpbf16.cpp: Zen 4 / 5
and other CPUs with AVX512-BF16 but no AMX). `pack_fp8` lays a float8 e4m3 weight out in blocks of 16
rows with each k's 16 bytes together; `gemm_bf16` / `gemm_fp8` compute x @ W.T from those layouts with the
native ops (kernels/native.py builds them); the `*_torch` functions are the references (unpack, then
a float32 matmul).
`select_linear_kernel` picks "cpu_bf16" or "torch" once per process; `bf16_layout` names the layout.
"""

from __future__ import annotations

import torch

from kernels.native import use_native

BLOCK = 16
AMX_CHUNK = 32  # k per AMX weight tile
PAIRS = ("amx32", "pairs32")  # layouts with a pair of k per 32-bit lane, k rounded up to 32


def _native_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and use_native(weight.device)


def bf16_layout(device: torch.device | str = "cpu") -> str:
    """The layout `pack_bf16` gives on `device`: the native build's ("amx32" where it runs on AMX,
    "pairs32" on AVX512-BF16 without it),
    else "packed16" (the torch references' default)."""
    native = torch.device(device).type == "cpu" and use_native(device)
    return str(torch.ops.ember.bf16_layout()) if native else "packed16"


def claim_tiles(layout: str) -> None:
    """Re-ask the OS for the AMX tile state where `layout` runs on it: a process restored from a CRIU
    snapshot has lost the grant, and its first tile instruction would kill it (SIGILL)."""
    if layout == "amx32":
        torch.ops.ember.amx_claim()


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> bf16 [ceil(N/16), K', 16] in `bf16_layout`'s layout (see `pack_bf16_torch`). The native
    op where it runs (the load-time packing of every linear), else the reference."""
    weight = weight.to(torch.bfloat16)
    return torch.ops.ember.pack_weight(weight) if _native_pack(weight) else pack_bf16_torch(weight)


def pack_bf16_torch(weight: torch.Tensor, layout: str = "packed16") -> torch.Tensor:
    """Reference of `pack_bf16`. "packed16": [NB, K, 16], per k lane i of a block holds rows i and i + 8
    (low, high). "amx32" and "pairs32": [NB, K', 16] with K' = K rounded up to 32 (zeros past K), per
    pair of k the block's 16 rows side by side, each with its two k together (an AMX tile row)."""
    n, k = weight.shape
    nb = -(-n // BLOCK)
    kp = k if layout == "packed16" else -(-k // AMX_CHUNK) * AMX_CHUNK
    padded = torch.zeros(nb * BLOCK, kp, dtype=torch.bfloat16, device=weight.device)
    padded[:n, :k] = weight
    if layout in PAIRS:  # [NB, row, K'/2, 2] -> [NB, K'/2, row, 2]
        return padded.view(nb, BLOCK, kp // 2, 2).permute(0, 2, 1, 3).contiguous().view(nb, kp, BLOCK)
    # [NB, half, lane, K] -> [NB, K, lane, half]: row 16b + 8h + i lands at [b, k, 2i + h]
    return padded.view(nb, 2, 8, k).permute(0, 3, 2, 1).contiguous().view(nb, k, BLOCK)


def unpack_bf16(packed: torch.Tensor, n: int, k: int | None = None, layout: str = "packed16") -> torch.Tensor:
    """The [n, k] weight back from `pack_bf16`'s layout (k: the true input size, for the pair layouts'
    padding)."""
    nb, kp, _ = packed.shape
    if layout in PAIRS:
        rows = packed.view(nb, kp // 2, BLOCK, 2).permute(0, 2, 1, 3).reshape(nb * BLOCK, kp)
        return rows[:n, : kp if k is None else k]
    return packed.view(nb, kp, 8, 2).permute(0, 3, 2, 1).reshape(nb * BLOCK, kp)[:n]


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


def gemm_bf16_torch(x: torch.Tensor, packed: torch.Tensor, n: int, layout: str = "packed16") -> torch.Tensor:
    """Reference: x [M, K] @ W.T in float32, returned in x's dtype."""
    return (x.float() @ unpack_bf16(packed, n, x.shape[-1], layout).float().t()).to(x.dtype)


def gemm_bf16(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., K] @ W.T with the native op (float32 accumulation), in x's dtype."""
    lead = x.shape[:-1]
    out = torch.ops.ember.gemm_bf16(x.reshape(-1, x.shape[-1]), packed, n)
    return out.view(*lead, n)


def select_linear_kernel(device: torch.device | str, dtype: torch.dtype) -> str:
    """ "cpu_bf16" for bf16 weights where the native ops run (`kernels.native.use_native`), else "torch"."""
    return "cpu_bf16" if dtype == torch.bfloat16 and use_native(device) else "torch"
