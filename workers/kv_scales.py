"""Per-kv-head scales of an fp8 KV cache, calibrated once at start-up.

An e4m3 cache holds k / k_scale and v / v_scale (kernels/torch_ops.py). The scales come from one
prefill of `CALIBRATION_TOKENS` pseudo-random token ids drawn with a fixed seed, so every start and
every rank of a model gets the same scales, and no output depends on which requests came first. Each
kv head's largest |k| and |v| over that prefill, times `HEADROOM`, maps to e4m3's 448. The headroom
costs no precision (e4m3 is floating point: 3 mantissa bits over its whole normal range); on the real
models real text reached at most 1.33x the random prompt's largest value, and anything beyond the
scale's range saturates at 448 instead of overflowing.
"""

from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata
from kernels.torch_ops import FP8_MAX
from workers.models.llama import LlamaForCausalLM

CALIBRATION_TOKENS = 256
HEADROOM = 4.0
SEED = 0

KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for `--kv-cache-dtype` ("auto" = the model's dtype)."""
    return model_dtype if name == "auto" else KV_DTYPES[name]


@torch.inference_mode()
def calibrate_kv_scales(
    model: LlamaForCausalLM, kv_caches: list[torch.Tensor], vocab_size: int, max_tokens: int
) -> None:
    """Set every attention layer's `kv_scales` from one calibration prefill written into the start of
    `kv_caches` (free blocks at start-up; what it leaves there is never read). At most `max_tokens`."""
    attns = [layer.self_attn.attn for layer in model.model.layers]
    device, block_size = kv_caches[0].device, kv_caches[0].shape[2]
    n = min(CALIBRATION_TOKENS, max_tokens, kv_caches[0].shape[1] * block_size)
    for a in attns:
        a.kv_amax = torch.zeros(2, a.num_kv_heads, device=device)
        a.kv_scales = torch.ones(2, a.num_kv_heads, device=device)
    ids = torch.randint(vocab_size, (n,), generator=torch.Generator().manual_seed(SEED)).to(device)
    blocks = list(range(-(-n // block_size)))
    meta = AttentionMetadata.build([n], [n], [blocks], block_size, device)
    try:
        model(ids, torch.arange(n, device=device), kv_caches, meta)
        for a in attns:
            assert a.kv_amax is not None
            a.kv_scales = (a.kv_amax.clamp_min(1e-6) * (HEADROOM / FP8_MAX)).contiguous()
    finally:
        for a in attns:
            a.kv_amax = None
