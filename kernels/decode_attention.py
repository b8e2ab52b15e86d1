"""Decode attention: one query token per request against its paged KV cache.

The Triton kernel, called by the Triton backend for the decode part of the batch (the first
num_decodes rows) on CUDA; it also runs on CPU under TRITON_INTERPRET=1 for tests. Its torch
reference and the native CPU op are in kernels/torch_ops.py (importing Triton costs ~0.4 s of every
CPU engine's start, so only this backend does).
q is [B, H, D]; the query of request b sits at position seq_lens[b] - 1 and sees keys
0 .. seq_lens[b] - 1 (only the last `sliding_window` of them when a window is set). GQA maps
query head h to kv head h // (H // Hkv). An fp8 cache (`kv_scales` given) is read as bytes and
widened in the kernel (kv_write.load_kv_tile). Math is float32; the output has the query dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_write import LOG2E, kv_operands, load_kv_tile, scores_exp2


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    seq_lens_ptr,
    out_ptr,
    k_scale_ptr,
    v_scale_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    softcap,
    window,
    block_size,
    stride_qb,
    stride_qh,
    stride_ob,
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
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # One program per (request, kv head, split): all GROUP query heads sharing the kv head at once.
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    dim_ok = dims < HEAD_DIM
    q_ptrs = q_ptr + req * stride_qb + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    first_tile = lo // BLOCK_N * BLOCK_N
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - first_tile, BLOCK_N), NUM_SPLITS)
    start = first_tile + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        key_ok = (pos < seq_len) & (pos >= lo)
        blk = tl.load(table_ptr + req * stride_table + pos // block_size, mask=key_ok, other=0).to(tl.int64)
        slot = pos % block_size
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k_ptrs = k_cache_ptr + blk[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
        k = load_kv_tile(k_ptrs + dims[None, :], kv_mask, k_scale_ptr, kv_head, q, KV_FP8, DOT_FP32)
        s = scores_exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), qk_scale, softcap, SOFTCAP)
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ptrs = v_cache_ptr + blk[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
        v = load_kv_tile(v_ptrs + dims[None, :], kv_mask, v_scale_ptr, kv_head, q, KV_FP8, DOT_FP32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    nonempty = l_i > 0.0
    acc = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + req * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])
    else:
        # Partial results in float32: out [B, H, S, BLOCK_D] and log2-sum-exp [B, H, S].
        row = (req * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=head_ok)
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + dims[None, :], acc, mask=head_ok[:, None])


@triton.jit
def _combine_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # One program per (request, query head): merge the splits' partial softmax results.
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = (req * tl.num_programs(1) + head) * NUM_SPLITS
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + row + splits, mask=splits < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # all-empty (seq_len 0) -> zeros
    parts = tl.load(
        part_out_ptr + (row + splits[:, None]) * BLOCK_D + dims[None, :],
        mask=splits[:, None] < NUM_SPLITS,
        other=0.0,
    )
    total = tl.sum(weight, axis=0)
    merged = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    o_ptrs = out_ptr + req * stride_ob + head * stride_oh + dims
    tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Split-K factor for the Triton decode kernel: enough programs to fill the GPU on long contexts."""
    if device.type != "cuda" or max_seq_len <= 256:
        return 1
    programs = num_reqs * num_kv_heads
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    by_length = max_seq_len // 256  # keep at least ~256 keys per split
    return int(max(1, min(16, by_length, -(-target // max(programs, 1)))))


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    *,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
    softcap: float = 0.0,
    num_splits: int = 1,
) -> torch.Tensor:
    """Triton version of `decode_attention_torch`; `num_splits` > 1 enables split-K over the context."""
    num_reqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    result = torch.empty_like(q) if out is None else out
    if num_reqs == 0:
        return result
    for name, t in (("q", q), ("out", result), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in head_dim")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    k_cache, v_cache, scales = kv_operands(k_cache, v_cache, kv_scales, q)
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    part_out = part_lse = result  # placeholders, never touched when num_splits == 1
    if num_splits > 1:
        part_out = torch.empty(num_reqs, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(num_reqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        result,
        scales[0],
        scales[1],
        part_out,
        part_lse,
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
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=64,
        NUM_SPLITS=num_splits,
        USE_WINDOW=sliding_window is not None,
        SOFTCAP=softcap > 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # The CPU interpreter (Triton 3.9) multiplies bf16 bit patterns as integers in tl.dot.
        DOT_FP32=q.device.type == "cpu",
        KV_FP8=fp8,
    )
    if num_splits > 1:
        _combine_kernel[(num_reqs, num_heads)](
            part_out,
            part_lse,
            result,
            result.stride(0),
            result.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
        )
    return result
