"""One native call per decoder layer for CPU decode steps (torch.ops.ember.decoder_layer).

A decode step of a small model on a CPU spends milliseconds of Python around some 25 torch calls per
layer. Where every piece of a Llama-style layer already runs on the native CPU ops (packed bf16 or
fp8 linears without bias, native norms, rotary and activation, the CPU attention backend, one rank, no
q/k norm), kernels/csrc/cpu_decoder.cpp runs the same ops in the same order in one call, so a decode
batch gets bit-identical results to the module path. Short queries (speculative verification, the
draft's catch-up, short prompt chunks: at most `MAX_QUERY` tokens per request) take it too, each
token as a decode row of its own: its keys are written before attention runs, and it attends to
positions 0 .. its own (the same logits a plain decode step at that position gives). Longer
prefills keep the module path. The worker calls `select_forward` once per model, after loading and
installing its ops; the model runner (and the draft) call what it returns for every step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.backend import CpuBackend
from kernels.metadata import AttentionMetadata
from workers.models.layers import ColumnLinear, RotaryEmbedding, RowLinear
from workers.models.llama import DecoderLayer, LlamaForCausalLM
from workers.models.ops import NativeCpuOps
from workers.quant.fp8 import Fp8PerTensor
from workers.quant.packed import PackedBf16


@dataclass(frozen=True)
class FusedLayer:
    """The per-layer arguments of torch.ops.ember.decoder_layer, gathered once."""

    weights: list[torch.Tensor]
    scales: list[torch.Tensor]  # fp8 linears' scales (an empty tensor for a bf16 one)
    dims: list[int]
    scale: float
    eps: float


def native_linear(lin: ColumnLinear | RowLinear) -> bool:
    """A linear whose method runs a native packed matmul: packed bf16, or fp8 in the native layout."""
    if type(lin.quant) is PackedBf16:
        return True
    return isinstance(lin.quant, Fp8PerTensor) and "out_features" in getattr(lin, "quant_attrs", {})


def layer_plan(layer: DecoderLayer, dtype: torch.dtype) -> FusedLayer | None:
    """The fused op's arguments for one DecoderLayer, or None when part of it is not on the native path."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(isinstance(m.ops, NativeCpuOps) for m in (mlp, attn.rotary, *norms)):
        return None
    if any(not native_linear(lin) or lin.bias is not None or lin.tp.size != 1 for lin in linears):
        return None
    if attn.q_norm is not None or not isinstance(attn.attn.backend, CpuBackend) or attn.head_dim % 8:
        return None
    if any(n.weight.dtype != dtype for n in norms) or norms[0].eps != norms[1].eps:
        return None
    weights = [
        norms[0].weight,
        attn.qkv_proj.weight,
        attn.o_proj.weight,
        norms[1].weight,
        mlp.gate_up_proj.weight,
        mlp.down_proj.weight,
    ]
    outs = [lin.quant_attrs["out_features"] for lin in linears]
    found = [getattr(lin, "weight_scale", None) for lin in linears]
    scales = [torch.empty(0) if s is None else s for s in found]
    window = attn.attn.sliding_window or 0
    dims = [*outs, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.rotary.rotary_dim, window]
    return FusedLayer(weights, scales, dims, attn.attn.scale, norms[0].eps)


MAX_QUERY = 16  # new tokens per request up to which a batch runs as per-token decode rows


def qualifies(meta: AttentionMetadata, tokens: int) -> bool:
    """No padding rows, and no request with more than MAX_QUERY new tokens."""
    return meta.num_actual_tokens == tokens and meta.max_query_len <= MAX_QUERY


def run(
    plans: list[FusedLayer],
    rotary: RotaryEmbedding,
    positions: torch.Tensor,
    x: torch.Tensor,
    kv_caches: list[torch.Tensor],
    meta: AttentionMetadata,
) -> torch.Tensor:
    """The decoder layers over a qualifying batch x [T, hidden]; returns the last layer's output."""
    n = meta.num_actual_tokens
    if meta.num_decode_tokens == n:
        table, lens = meta.block_tables[:n], meta.seq_lens[:n]
    else:  # a decode row per token: its request's block table, the keys up to its own position
        query_lens = meta.query_start_loc.diff()
        table = meta.block_tables[: len(query_lens)].repeat_interleave(query_lens, dim=0)
        lens = positions[:n] + 1
    slots = meta.slot_mapping[:n]
    layer_op = torch.ops.ember.decoder_layer
    cos, sin = rotary.cos, rotary.sin
    x = x.contiguous()
    for p, kv in zip(plans, kv_caches, strict=True):
        args = (kv[0], kv[1], table, lens, slots, cos, sin, p.scale, p.eps)
        x = layer_op(x, positions, p.weights, p.scales, p.dims, *args)
    return x


Forward = Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata], torch.Tensor]
"""forward(input_ids[T], positions[T], kv_caches, meta) -> hidden[T, hidden], as a model's."""


class FusedDecode:
    """A model's forward that runs qualifying batches through the one-call layers, others through
    the model's modules; both end in the model's final norm."""

    def __init__(self, model: LlamaForCausalLM, layers: list[FusedLayer]) -> None:
        self.model = model
        self.layers = layers

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if not qualifies(meta, input_ids.shape[0]):
            return self.model(input_ids, positions, kv_caches, meta)
        body = self.model.model
        rotary = body.layers[0].self_attn.rotary
        x = run(self.layers, rotary, positions, body.embed_tokens(input_ids), kv_caches, meta)
        return body.norm(x)


def plan(model: LlamaForCausalLM) -> FusedDecode | None:
    """The one-call layers of a bf16 model when every layer qualifies, else None."""
    body = model.model
    dtype = body.embed_tokens.weight.dtype
    if dtype != torch.bfloat16:
        return None
    plans = [layer_plan(layer, dtype) for layer in body.layers]
    qualified = [p for p in plans if p is not None]
    return FusedDecode(model, qualified) if len(qualified) == len(plans) else None


def select_forward(model: LlamaForCausalLM) -> Forward:
    """What runs a step of `model`: its one-call decode layers where they qualify, else the model."""
    fused = plan(model)
    return model if fused is None else fused
