"""Group-wise int4 weight-only matmul (w4a16): y = x @ dequant(W).T, with W packed two per byte.

Called by the int4 quantization method inside worker processes: the torch reference on CPU, the
Triton kernel on CUDA (tested on CPU under TRITON_INTERPRET=1). Layout: `packed` is uint8 [N, K/2]
(low nibble = even k, high nibble = odd k), `scales` and `zeros` are [N, K/group]; the weight is
w[n, k] = (q[n, k] - zeros[n, k // group]) * scales[n, k // group] with q in [0, 15].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] with values 0..15 -> uint8 [N, K/2]."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K] with values 0..15."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)


def dequantize_int4(
    packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """The dense [N, K] weight in the scales' dtype."""
    q = unpack_int4(packed).to(scales.dtype)
    n, k = q.shape
    q = q.reshape(n, k // group, group)
    return ((q - zeros[:, :, None]) * scales[:, :, None]).reshape(n, k)


def int4_matmul_torch(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """Reference: dequantize, then a dense matmul in x's dtype."""
    return x @ dequantize_int4(packed, scales, zeros, group).to(x.dtype).t()


@triton.jit
def _int4_matmul_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    M,
    N,
    K,
    group,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & k_ok[None, :], other=0.0
        )
        # each byte holds two k positions: pick the nibble of this k
        wmask = (rn[:, None] < N) & k_ok[None, :]
        byte = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :] // 2, mask=wmask, other=0)
        q = ((byte >> ((rk[None, :] % 2) * 4)) & 0xF).to(tl.float32)
        g = rk[None, :] // group
        s = tl.load(s_ptr + rn[:, None] * stride_sn + g, mask=wmask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rn[:, None] * stride_sn + g, mask=wmask, other=0.0).to(tl.float32)
        w = (q - z) * s  # [BLOCK_N, BLOCK_K]
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def int4_matmul_triton(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """Fused dequant-matmul; same contract as `int4_matmul_torch` (x is [M, K], contiguous rows)."""
    m, k = x.shape
    n = packed.shape[0]
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n, block_k = 64, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_matmul_kernel[grid](
        x,
        packed,
        scales,
        zeros,
        out,
        m,
        n,
        k,
        group,
        x.stride(0),
        packed.stride(0),
        scales.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        # the CPU interpreter (Triton 3.9) mishandles half-precision tl.dot; compute in float32 there
        DOT_FP32=x.device.type == "cpu" or x.dtype == torch.float32,
    )
    return out
