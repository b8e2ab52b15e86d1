"""Prefill attention: variable-length query chunks against their paged KV cache.

The Triton kernel, called by the Triton backend for the prefill part of the batch on CUDA; it also
runs on CPU under TRITON_INTERPRET=1 for tests. Its torch reference (`prefill_attention_torch`) is in
kernels/torch_ops.py. Request b owns query rows
query_start_loc[b] : query_start_loc[b + 1] of q [T, H, D]; a chunk may follow cached context, so
row i sits at position seq_lens[b] - q_len + i and sees keys 0 .. that position (causal, bottom-right
aligned), limited to the last `sliding_window` positions when a window is set. An fp8 cache
(`kv_scales` given) is read as bytes and widened in the kernel (kv_write.load_kv_tile). Math is
float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_write import LOG2E, kv_operands, load_kv_tile, scores_exp2


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    query_start_ptr,
    seq_lens_ptr,
    out_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    softcap,
    window,
    block_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_table,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # One program per (request, query tile, query head); tiles past the request's chunk exit at once.
    req = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - q_len
    kv_head = head // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    q_pos = context + rows
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    tok = (q_start + rows).to(tl.int64)
    q_ptrs = q_ptr + tok[:, None] * stride_qt + head * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    hi = context + tl.minimum(q_len, (tile + 1) * BLOCK_M)  # one past the tile's last position
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(context + tile * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        key_ok = pos < hi
        blk = tl.load(table_ptr + req * stride_table + pos // block_size, mask=key_ok, other=0).to(tl.int64)
        slot = pos % block_size
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k_ptrs = k_cache_ptr + blk[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
        k = load_kv_tile(k_ptrs + dims[None, :], kv_mask, k_scale_ptr, kv_head, q, KV_FP8, DOT_FP32)
        s = scores_exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), qk_scale, softcap, SOFTCAP)
        visible = (pos[None, :] <= q_pos[:, None]) & key_ok[None, :]
        if USE_WINDOW:
            visible &= (q_pos[:, None] - pos[None, :]) < window
        s = tl.where(visible, s, float("-inf"))
        # m_i starts finite, so rows with nothing visible yet get p == 0 instead of NaN.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ptrs = v_cache_ptr + blk[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
        v = load_kv_tile(v_ptrs + dims[None, :], kv_mask, v_scale_ptr, kv_head, q, KV_FP8, DOT_FP32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + tok[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    query_start_loc_cpu: list[int],
    seq_lens_cpu: list[int],
    *,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Triton version of `prefill_attention_torch` (same contract; the host lists size the grid)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    result = torch.empty_like(q) if out is None else out
    num_reqs = len(seq_lens_cpu)
    if num_reqs == 0 or num_tokens == 0:
        return result
    for name, t in (("q", q), ("out", result), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in head_dim")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    k_cache, v_cache, scales = kv_operands(k_cache, v_cache, kv_scales, q)
    max_query_len = max(query_start_loc_cpu[b + 1] - query_start_loc_cpu[b] for b in range(num_reqs))
    block_m = min(64, max(16, triton.next_power_of_2(max_query_len)))
    grid = (num_reqs, triton.cdiv(max_query_len, block_m), num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        result,
        scales[0],
        scales[1],
        scale * LOG2E,
        softcap,
        sliding_window or 0,
        block_size,
        q.stride(0),
        q.stride(1),
        result.stride(0),
        result.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=64,
        USE_WINDOW=sliding_window is not None,
        SOFTCAP=softcap > 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # The CPU interpreter (Triton 3.9) multiplies bf16 bit patterns as integers in tl.dot.
        DOT_FP32=q.device.type == "cpu",
        KV_FP8=fp8,
    )
    return result
