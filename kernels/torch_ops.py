"""The attention ops' torch references and the native CPU wrappers, without Triton.

Used by the `torch` and `cpu` attention backends (kernels/backend.py) on the model's device, and by
the tests as the references of the Triton kernels (decode_attention.py, prefill_attention.py,
kv_write.py, whose docstrings give each op's contract). Kept apart from them because importing
Triton costs ~0.4 s of every CPU engine's start.

An fp8 (e4m3) cache holds keys / k_scale and values / v_scale per kv head (`quantize_kv`, saturated
at +-448); every attention op then takes `kv_scales` [2, Hkv] (float32) and reads value * scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # e4m3's largest finite value


def quantize_kv(
    x: torch.Tensor, cache_dtype: torch.dtype, kv_scales: torch.Tensor | None, which: int
) -> torch.Tensor:
    """Keys (which = 0) or values (1) [T, Hkv, D] in the cache's dtype: x / scale of its kv head,
    saturated, for an fp8 cache (kv_scales given); else a plain cast."""
    if kv_scales is None:
        return x.to(cache_dtype)
    scaled = x.to(torch.float32) / kv_scales[which].view(1, -1, 1)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def _widen(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cached rows [..., Hkv, D] as float32, times their kv head's scale when given."""
    return x.float() if scale is None else x.float() * scale[:, None]


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of q [..., H, L, D] over keys / values [..., Hkv, S, D] (float32), `mask` [..., L, S]
    (True: visible; None: causal, L == S). With `softcap` > 0 each score is first capped to
    softcap * tanh(score / softcap) (Gemma 2's logit soft-capping), which SDPA cannot do."""
    gqa = q.shape[-3] != keys.shape[-3]
    if not softcap:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )
    if gqa:
        keys = keys.repeat_interleave(q.shape[-3] // keys.shape[-3], dim=-3)
        values = values.repeat_interleave(q.shape[-3] // values.shape[-3], dim=-3)
    scores = torch.tanh(q @ keys.transpose(-1, -2) * (scale / softcap)) * softcap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ values


def _split(kv_scales: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (None, None) if kv_scales is None else (kv_scales[0], kv_scales[1])


def write_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Reference: write key/value [T, Hkv, D] into the caches at slot_mapping [T] (in place)."""
    num_tokens = key.shape[0]
    slots = slot_mapping[:num_tokens].long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


def write_kv_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The native CPU op (kernels/csrc/cpu_layer_ops.cpp): one copy per row, no index tensors."""
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    torch.ops.ember.write_kv(key, value, k_cache, v_cache, slot_mapping)


def decode_attention_torch(
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
) -> torch.Tensor:
    """Reference: gather each request's blocks (padded to the longest), mask, and attend (`softcap`:
    the scores' soft cap, 0 for none)."""
    num_reqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    result = torch.empty_like(q) if out is None else out
    if num_reqs == 0:
        return result
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // block_size)
    table = block_tables[:num_reqs, :num_blocks].long()
    # [B, nb, bs, Hkv, D] -> [B, Hkv, L, D]
    k_scale, v_scale = _split(kv_scales)
    keys = _widen(k_cache[table], k_scale).reshape(num_reqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = _widen(v_cache[table], v_scale).reshape(num_reqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    pos = torch.arange(keys.shape[2], device=q.device)
    lens = seq_lens[:num_reqs].long()[:, None]
    visible = pos[None, :] < lens
    if sliding_window is not None:
        visible &= pos[None, :] >= lens - sliding_window
    # Stale slots may hold anything (even NaN): zero them, since a masked score times NaN is NaN.
    keys = keys.masked_fill(~visible[:, None, :, None], 0.0)
    values = values.masked_fill(~visible[:, None, :, None], 0.0)
    attn = attend(q.float()[:, :, None, :], keys, values, visible[:, None, None, :], scale, softcap)
    result.copy_(attn[:, :, 0, :])
    return result


def decode_attention_cpu(
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
) -> torch.Tensor:
    """The native CPU op (kernels/csrc/cpu_attention.cpp): reads each block in place, no gather.
    Head sizes that are not a multiple of 8 take the torch reference."""
    if q.shape[-1] % 8:
        args = (q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window)
        return decode_attention_torch(*args, out=out, kv_scales=kv_scales, softcap=softcap)
    result = torch.empty_like(q) if out is None else out
    window = 0 if sliding_window is None else int(sliding_window)
    scales = torch.empty(0) if kv_scales is None else kv_scales.float()
    torch.ops.ember.decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, scales, result
    )
    return result


def prefill_attention_torch(
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
    """Reference: per-request loop, gather the request's keys/values, attend under a causal mask."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    result = torch.empty_like(q) if out is None else out
    k_scale, v_scale = _split(kv_scales)
    for b, seq_len in enumerate(seq_lens_cpu):
        start, end = query_start_loc_cpu[b], query_start_loc_cpu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        context = seq_len - q_len
        table = block_tables[b, : -(-seq_len // block_size)].long()
        keys = _widen(k_cache[table], k_scale).reshape(-1, num_kv_heads, head_dim)[:seq_len]
        values = _widen(v_cache[table], v_scale).reshape(-1, num_kv_heads, head_dim)[:seq_len]
        mask = None
        if context > 0 or sliding_window is not None:
            q_pos = torch.arange(context, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= q_pos - k_pos < sliding_window
        attn = attend(
            q[start:end].transpose(0, 1).float(),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            mask,
            scale,
            softcap,
        )
        result[start:end] = attn.transpose(0, 1)
    return result
