"""bf16, fp8 and int8 weight x activation matmuls for CPUs: packed layouts, the native ops, torch references.

Runs in worker processes (and the preload daemon) on CPU engines. `pack_bf16` turns a [N, K] bf16
weight into blocks of 16 output rows laid out for one 256-bit load per k, `pack_fp8` a float8 e4m3
weight into blocks of 16 rows with each k's 16 bytes together (see csrc/cpu_gemm.cpp), `pack_q8` an
int8 weight the same way with one scale per row and 32 k (GGUF's Q8_0 groups); `gemm_bf16` / `gemm_fp8`
/ `gemm_q8` compute x @ W.T from those layouts with the native AVX2 + FMA ops (kernels/native.py builds
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


GROUP = 32  # k per scale of the int8 layout (GGUF's Q8_0 groups)


def pack_q8(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] with float32 scales [N, K / 32] -> (int8 [NB, K, 16] in `pack_fp8`'s layout, float32
    scales [NB, K / 32, 16]: per block and group, the 16 rows' scales side by side; padded rows 0)."""
    n, k = q.shape
    assert k % GROUP == 0 and scales.shape == (n, k // GROUP), "int8 groups are 32 wide"
    packed = torch.ops.ember.pack_weight(q) if _native_pack(q) else pack_fp8_torch(q)
    nb = -(-n // BLOCK)
    padded = torch.zeros(nb * BLOCK, k // GROUP, dtype=torch.float32, device=q.device)
    padded[:n] = scales
    return packed, padded.view(nb, BLOCK, k // GROUP).transpose(1, 2).contiguous()


def unpack_q8(packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """The float32 [n, K] weight of `pack_q8`'s layout."""
    nb, k, _ = packed.shape
    per_row = scales.transpose(1, 2).reshape(nb * BLOCK, k // GROUP)[:n]
    return unpack_fp8(packed, n).float() * per_row.repeat_interleave(GROUP, dim=1)


def gemm_q8_torch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """Reference: x [M, K] @ W.T in float32 (W = int8 x its group's scale), in x's dtype."""
    return (x.float() @ unpack_q8(packed, scales, n).t()).to(x.dtype)


def gemm_q8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., K] @ W.T with the native op (float32 accumulation), in x's dtype."""
    lead = x.shape[:-1]
    return torch.ops.ember.gemm_q8(x.reshape(-1, x.shape[-1]), packed, scales, n).view(*lead, n)


def pack_q4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit values (uint8 [N, K] in 0..15) with scales and float zero points [N, K / 32] (w = (q - zero)
    * scale) -> (uint8 [NB, K, 8]: byte j of a block's k holds rows j and j + 8 in its low and high
    nibble; float32 [NB, K / 32, 32]: per group the 16 rows' scales, then their offsets -zero * scale)."""
    n, k = q.shape
    assert k % GROUP == 0 and scales.shape == zeros.shape == (n, k // GROUP), "4-bit groups are 32 wide"
    nb = -(-n // BLOCK)
    rows = torch.zeros(nb * BLOCK, k, dtype=torch.uint8, device=q.device)
    rows[:n] = q
    by_k = rows.view(nb, BLOCK, k).transpose(1, 2)  # [NB, K, 16]
    packed = (by_k[..., :8] | (by_k[..., 8:] << 4)).contiguous()
    params = torch.zeros(nb * BLOCK, k // GROUP, 2, dtype=torch.float32, device=q.device)
    params[:n, :, 0] = scales.float()
    params[:n, :, 1] = -zeros.float() * scales.float()
    # [NB, 16, G, 2] -> [NB, G, 2, 16]
    return packed, params.view(nb, BLOCK, k // GROUP, 2).permute(0, 2, 3, 1).reshape(
        nb, k // GROUP, 2 * BLOCK
    )


def unpack_q4(packed: torch.Tensor, params: torch.Tensor, n: int) -> torch.Tensor:
    """The float32 [n, K] weight of `pack_q4`'s layout (q * scale + offset)."""
    nb, k, _ = packed.shape
    q = torch.cat((packed & 0xF, packed >> 4), dim=2).transpose(1, 2).reshape(nb * BLOCK, k)[:n].float()
    per = params.view(nb, k // GROUP, 2, BLOCK).permute(0, 3, 1, 2).reshape(nb * BLOCK, k // GROUP, 2)[:n]
    scale, offset = (per[..., i].repeat_interleave(GROUP, dim=1) for i in (0, 1))
    return q * scale + offset


def gemm_q4_torch(x: torch.Tensor, packed: torch.Tensor, params: torch.Tensor, n: int) -> torch.Tensor:
    """Reference: x [M, K] @ W.T in float32 (W = q * scale + offset per group), in x's dtype."""
    return (x.float() @ unpack_q4(packed, params, n).t()).to(x.dtype)


def gemm_q4(x: torch.Tensor, packed: torch.Tensor, params: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., K] @ W.T with the native op (float32 accumulation), in x's dtype."""
    lead = x.shape[:-1]
    return torch.ops.ember.gemm_q4(x.reshape(-1, x.shape[-1]), packed, params, n).view(*lead, n)


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
