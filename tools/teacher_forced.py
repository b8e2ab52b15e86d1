"""Ember's model classes driven in one process: load a checkpoint, teacher-forced logits.

Used by the tests (quantization agreement, the real models' tables) and tools/kv_accuracy.py. `load`
builds the model on the CPU as a worker would; `all_logits` runs one prefill through the
paged-attention path and returns the next-token logits at every position (`batch_logits`: of several
sequences at once, optionally over an fp8 KV cache with its calibrated scales).
"""

from __future__ import annotations

import torch

from coreproc.base.config import ModelConfig
from kernels import AttentionMetadata, select_backend
from workers.kv_scales import calibrate_kv_scales
from workers.loader import ModelSpec, build_model


def load(
    path: str,
    quantization: str | None,
    dtype: torch.dtype = torch.float32,
    max_positions: int = 256,
    kernel: str = "torch",
) -> torch.nn.Module:
    """The model as a worker builds it; kernel "cpu_bf16" is the native CPU fast path (bf16 only)."""
    cfg = ModelConfig.from_dir(path, dtype="float32")
    cpu = torch.device("cpu")
    backend = select_backend(cpu)
    spec = ModelSpec(
        path, cfg.architecture, dtype, cpu, backend, max_positions, quantization=quantization, kernel=kernel
    )
    model, _, _ = build_model(spec, show_progress=False)
    return model


def all_logits(model: torch.nn.Module, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Next-token logits at every position of one sequence (one prefill through the paged path)."""
    n = len(ids)
    blocks = -(-n // block_size)
    attn = model.model.layers[0].self_attn
    dtype = model.model.embed_tokens.weight.dtype  # the compute dtype (quantized weights are not)
    kv = [
        torch.zeros(2, blocks, block_size, attn.num_kv_heads, attn.head_dim, dtype=dtype)
        for _ in model.model.layers
    ]
    meta = AttentionMetadata.build([n], [n], [list(range(blocks))], block_size, "cpu")
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), kv, meta))


def batch_logits(
    model: torch.nn.Module, seqs: list[list[int]], block_size: int = 16, kv_dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """`all_logits` of several sequences in one prefill (each weight read, or dequantized, once); the
    cache in kv_dtype (default: the compute dtype), an fp8 one calibrated as a worker does."""
    with torch.inference_mode():
        logits = model.compute_logits(prefill_hidden(model, seqs, block_size, kv_dtype))
    return list(logits.split([len(ids) for ids in seqs]))


@torch.inference_mode()
def prefill_hidden(
    model: torch.nn.Module, seqs: list[list[int]], block_size: int = 16, kv_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The final hidden states [sum of lengths, hidden] of one prefill of `seqs` (see `batch_logits`)."""
    blocks = [-(-len(ids) // block_size) for ids in seqs]
    starts = [sum(blocks[:i]) for i in range(len(seqs))]
    attn = model.model.layers[0].self_attn
    dtype = kv_dtype or model.model.embed_tokens.weight.dtype
    kv = [
        torch.zeros(2, sum(blocks), block_size, attn.num_kv_heads, attn.head_dim, dtype=dtype)
        for _ in model.model.layers
    ]
    if dtype.itemsize == 1:
        calibrate_kv_scales(model, kv, model.config.vocab_size, max(len(s) for s in seqs))
    lens = [len(ids) for ids in seqs]
    tables = [list(range(start, start + b)) for start, b in zip(starts, blocks)]
    meta = AttentionMetadata.build(lens, lens, tables, block_size, "cpu")
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(n) for n in lens])
    return model(ids, positions, kv, meta)
