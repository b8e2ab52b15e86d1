"""Scatter the new tokens' keys and values into the paged KV cache.

Runs inside every attention layer before the attention op, on the model's device. The cache of
one layer is k_cache / v_cache, each [num_blocks, block_size, num_kv_heads, head_dim] (usually
views of one [2, ...] tensor, so only per-tensor strides are assumed). Token t goes to slot
slot_mapping[t] = block_id * block_size + offset; negative slots are padding and are skipped.
This module is `write_kv_triton`, the Triton kernel; the reference `write_kv_torch` and the native
op `write_kv_cpu` are in kernels/torch_ops.py. An fp8 cache gets keys and values already quantized
(`quantize_kv`) and copied as bytes. `load_kv_tile` is how the Triton attention kernels read a tile
back (fp8 widened and scaled), `scores_exp2` how they scale (and soft-cap) a tile's scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_blk,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_blk,
    stride_vc_slot,
    stride_vc_head,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: copies its [Hkv, D] key and value tiles into one cache slot.
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    src_k = key_ptr + tok.to(tl.int64) * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_v = value_ptr + tok.to(tl.int64) * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    dst_k = k_cache_ptr + blk * stride_kc_blk + off * stride_kc_slot + heads[:, None] * stride_kc_head
    dst_v = v_cache_ptr + blk * stride_vc_blk + off * stride_vc_slot + heads[:, None] * stride_vc_head
    tl.store(dst_k + dims[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_v + dims[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_kv_tile(ptrs, mask, scale_ptr, kv_head, like, KV_FP8: tl.constexpr, DOT_FP32: tl.constexpr):
    # A [N, D] key or value tile ready for tl.dot against `like` (the queries). fp8 e4m3 arrives as
    # bytes: s.eeee.mmm moved to the half s.0eeee.mmm0000000 is the value times 2^-8 (subnormals too),
    # then one multiply by 2^8 * the kv head's scale gives value * scale, rounded once as in torch.
    x = tl.load(ptrs, mask=mask, other=0)
    if KV_FP8:
        b = x.to(tl.uint16)
        half = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        x = half.to(tl.float16, bitcast=True).to(tl.float32) * (256.0 * tl.load(scale_ptr + kv_head))
        if not DOT_FP32:
            x = x.to(like.dtype)
    elif DOT_FP32:
        x = x.to(tl.float32)
    return x


LOG2E = 1.4426950408889634


@triton.jit
def scores_exp2(dots, qk_scale, softcap, SOFTCAP: tl.constexpr):
    # A tile's scores in log2 units for exp2: dots * scale * log2(e), where qk_scale = scale * log2(e);
    # with SOFTCAP, softcap * tanh(dots * scale / softcap) * log2(e) first (tanh(x) = 2 sigmoid(2x) - 1,
    # the same on every device).
    if SOFTCAP:
        capped = 2.0 * tl.sigmoid(dots * (2.0 * qk_scale / (softcap * 1.4426950408889634))) - 1.0
        return capped * (softcap * 1.4426950408889634)
    return dots * qk_scale


def kv_operands(
    k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: torch.Tensor | None, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The caches and [2, Hkv] scales as the attention kernels take them: an fp8 cache as bytes (the
    interpreter has no fp8) with its scales; any other cache as it is, with a placeholder the kernels
    never read (uninitialised: no fill kernel per layer on CUDA)."""
    if k_cache.dtype != torch.float8_e4m3fn:
        return k_cache, v_cache, q.new_empty((2, 1), dtype=torch.float32)
    if kv_scales is None:
        raise ValueError("an fp8 cache needs kv_scales")
    return k_cache.view(torch.uint8), v_cache.view(torch.uint8), kv_scales.float().contiguous()


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of `write_kv_torch` (same contract). The last dim of every tensor must be dense."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if k_cache.dtype == torch.float8_e4m3fn:  # the interpreter has no fp8: copy the bytes
        key, value, k_cache, v_cache = (t.view(torch.uint8) for t in (key, value, k_cache, v_cache))
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in head_dim")
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
