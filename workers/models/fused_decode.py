"""One native call for all decoder layers of a CPU decode step (torch.ops.ember.decoder_layer each).

A decode step of a small model on a CPU spends milliseconds of Python around some 25 torch calls per
layer. Where every piece of a decoder layer already runs on the native CPU ops (packed bf16, fp8
or integer-dot linears, GGUF segments included, with or without bias, native norms, rotary and
activation, the CPU attention backend, one rank), kernels/csrc/cpu_decoder.cpp runs the same ops in
the same order in one call, whatever parts the layer is made of (norms before, around or after its
blocks, q/k norms, NoPE, SwiGLU or GeGLU, a residual multiplier: workers/models/parts.py), so a
decode batch gets bit-identical results to the module path (a pipeline stage runs its own layers so,
from the hidden states it was given). Short queries
(speculative verification, the draft's catch-up, short prompt chunks: at most `MAX_QUERY` tokens per
request) take it too, each token as a decode row of its own: its keys are written before attention
runs, and it attends to positions 0 .. its own (the same logits a plain decode step at that position
gives). Longer prefills keep the module path. The layers' constant arguments (weights, norms,
specs, rotary tables, the experts') are handed to a native `DecoderStack` once, so a step converts
only what changes from Python (caches, rows, fp8 scales, expert counters). The worker calls
`select_forward` once per model, after loading and installing its ops; the model runner (and the
draft) call what it returns for every step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels.backend import CpuBackend
from kernels.metadata import AttentionMetadata
from workers.models.layers import ColumnLinear, PagedAttention, RotaryEmbedding, RowLinear
from workers.models.llama import LlamaForCausalLM
from workers.models.moe import MoEMLP
from workers.models.native_linears import fp8_scale, segments
from workers.models.ops import NativeCpuOps
from workers.models.parts import DecoderLayer, DecoderMLP


@dataclass(frozen=True)
class FusedLayer:
    """The per-layer arguments of torch.ops.ember.decoder_layer, gathered once."""

    norms: list[torch.Tensor]  # the layer's norms in DecoderLayer's order, then the q and k norms
    weights: list[torch.Tensor]  # the segments of qkv, o, gate_up, down (qkv and o with experts)
    scales: list[torch.Tensor]  # fp8 linears' scales (an empty tensor elsewhere)
    biases: list[torch.Tensor]  # (an empty tensor where a linear has none)
    specs: list[int]  # per linear: its segment count, then kind, group, zero, offsets, params, rows each
    dims: list[int]
    scale: float
    eps: float
    attention: PagedAttention  # read at each call: its fp8 kv_scales are set after this is built
    rotary: RotaryEmbedding | None  # this layer's tables (None: no positional encoding)
    residual_scale: float
    softcap: float = 0.0  # the attention scores' soft cap (0: none)
    index: int = 0  # the layer's place in the model (its KV group's view of the metadata)
    experts: MoEMLP | None = None  # experts in place of the MLP (their native op's arguments)


PLACEMENTS = {"pre": 0, "sandwich": 1, "post": 2}  # cpu_decoder.cpp's kNorms*
QK_NORMS = {None: 0, "head": 1, "all": 2}  # kQk*
ACTS = {"silu": 0, "gelu_tanh": 1}  # kAct*


def layer_plan(layer: DecoderLayer, dtype: torch.dtype, index: int = 0) -> FusedLayer | None:
    """The fused op's arguments for one DecoderLayer, or None when part of it is not on the native path."""
    attn, mlp = layer.self_attn, layer.mlp
    experts = mlp if isinstance(mlp, MoEMLP) else None
    if experts is not None and (experts.native is None or experts.tp.size != 1):
        return None
    norms = layer.norm_modules()
    linears: list[ColumnLinear | RowLinear] = [attn.qkv_proj, attn.o_proj]
    if isinstance(mlp, DecoderMLP):
        linears += [mlp.gate_up_proj, mlp.down_proj]
    rotary = attn.rotary
    ops = (mlp, *norms) if rotary is None else (mlp, rotary, *norms)
    if not all(isinstance(m.ops, NativeCpuOps) for m in ops):
        return None
    segs = [segments(lin) for lin in linears]
    if any(s is None for s in segs) or any(lin.tp.size != 1 for lin in linears):
        return None
    if not isinstance(attn.attn.backend, CpuBackend) or attn.head_dim % 8:
        return None
    if any(n.weight.dtype != dtype for n in norms) or len({n.eps for n in norms}) != 1:
        return None
    weights, specs = [], []
    for lin_segments in segs:
        assert lin_segments is not None
        specs.append(len(lin_segments))
        for tensor, spec in lin_segments:
            weights.append(tensor)
            specs.extend(spec)
    outs = [lin.quant_attrs["out_features"] for lin in linears] + [0, 0] * (experts is not None)
    empty = [torch.empty(0)] * (4 - len(linears))
    scales = [fp8_scale(lin) for lin in linears] + empty
    biases = [torch.empty(0) if lin.bias is None else lin.bias for lin in linears] + empty
    window = attn.attn.sliding_window or 0
    rotary_dim = 0 if rotary is None else rotary.rotary_dim
    parts = [PLACEMENTS[layer.norms], QK_NORMS[attn.qk_norm], ACTS[mlp.act]]
    dims = [*outs, attn.num_heads, attn.num_kv_heads, attn.head_dim, rotary_dim, window, *parts]
    args = (attn.attn.scale, norms[0].eps, attn.attn, rotary, layer.residual_scale)
    softcap = attn.attn.softcap
    norm_weights: list[torch.Tensor] = [n.weight for n in norms]
    return FusedLayer(norm_weights, weights, scales, biases, specs, dims, *args, softcap, index, experts)


MAX_QUERY = 16  # new tokens per request up to which a batch runs as per-token decode rows


def qualifies(meta: AttentionMetadata, tokens: int) -> bool:
    """No padding rows, and no request with more than MAX_QUERY new tokens."""
    return meta.num_actual_tokens == tokens and meta.max_query_len <= MAX_QUERY


def _rows(meta: AttentionMetadata, positions: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """Per token row: its block table, the keys it sees and its cache slot, in `meta`'s KV group."""
    if meta.num_decode_tokens == n:
        return meta.block_tables[:n], meta.seq_lens[:n], meta.slot_mapping[:n]
    # a decode row per token: its request's block table, the keys up to its own position
    query_lens = meta.query_start_loc.diff()
    table = meta.block_tables[: len(query_lens)].repeat_interleave(query_lens, dim=0)
    return table, positions[:n] + 1, meta.slot_mapping[:n]


EMPTY = torch.empty(0)


def build_stack(plans: list[FusedLayer]) -> Any:
    """The layers' constant arguments held natively (cpu_decoder.cpp's DecoderStack), in order."""
    stack = torch.classes.ember.DecoderStack()
    for p in plans:
        cos, sin = (EMPTY, EMPTY) if p.rotary is None else (p.rotary.cos, p.rotary.sin)
        moe: tuple = ([], [], [], [], [], 1.0)
        if p.experts is not None:
            e = p.experts.native
            assert e is not None, "layer_plan takes experts only on their native op"
            moe = (e.params, e.weights, e.scales, e.specs, e.dims, p.experts.moe.routed_scale)
        layer = (p.norms, p.weights, p.scales, p.biases, p.specs, p.dims, cos, sin)
        stack.add(*layer, p.scale, p.eps, p.residual_scale, p.softcap, *moe)
    return stack


def run(
    stack: Any,  # a torch.ScriptObject of the DecoderStack class (its methods are not typed)
    plans: list[FusedLayer],
    positions: torch.Tensor,
    x: torch.Tensor,
    kv_caches: list[torch.Tensor],
    meta: AttentionMetadata,
) -> torch.Tensor:
    """The decoder layers over a qualifying batch x [T, hidden] in one native call; returns the last
    layer's output. What may change between steps goes with the call: the caches, the fp8 caches'
    scales (set once calibrated), the experts' load counters (views of the runner's), and per KV
    group its rows (block tables, keys seen, slots)."""
    n = meta.num_actual_tokens
    groups: dict[int, int] = {}  # KV group view -> its index in tables / lens / slots
    tables: list[torch.Tensor] = []
    lens: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    rows, kv_scales, loads = [], [], []
    for p in plans:
        view = meta.for_layer(p.index)
        g = groups.get(id(view))
        if g is None:
            g = groups[id(view)] = len(tables)
            table, seen, slot = _rows(view, positions, n)
            tables.append(table)
            lens.append(seen)
            slots.append(slot)
        rows.append(g)
        kv_scales.append(EMPTY if p.attention.kv_scales is None else p.attention.kv_scales)
        loads.append(EMPTY if p.experts is None else p.experts.expert_load)
    keys, values = [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches]
    return stack.forward(x.contiguous(), positions, keys, values, kv_scales, loads, tables, lens, slots, rows)


Forward = Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata], torch.Tensor]
"""forward(input_ids[T], positions[T], kv_caches, meta) -> hidden[T, hidden], as a model's."""


class FusedDecode:
    """A model's forward that runs qualifying batches through the one-call layers, others through
    the model's modules; both end in the model's final norm."""

    def __init__(self, model: LlamaForCausalLM, layers: list[FusedLayer]) -> None:
        self.model = model
        self.layers = layers
        self.stack = build_stack(layers)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As the model's forward (`inputs_embeds`: a later pipeline stage's input)."""
        if not qualifies(meta, input_ids.shape[0]):
            return self.model(input_ids, positions, kv_caches, meta, inputs_embeds)
        body = self.model.model
        x = self.model.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        x = run(self.stack, self.layers, positions, x, kv_caches, meta)
        return body.norm(x) if self.model.pp.is_last else x


def plan(model: LlamaForCausalLM) -> FusedDecode | None:
    """The one-call layers of a bf16 model (or pipeline stage) when every layer it holds qualifies, else
    None."""
    held = model.held_layers()
    dtype = (
        model.model.embed_tokens.out_dtype
        if model.pp.is_first
        else held[0].post_attention_layernorm.weight.dtype
    )
    if dtype != torch.bfloat16:
        return None
    plans = [layer_plan(layer, dtype, i) for i, layer in zip(model.held, held, strict=True)]
    qualified = [p for p in plans if p is not None]
    return FusedDecode(model, qualified) if len(qualified) == len(plans) else None


def select_forward(model: LlamaForCausalLM) -> Forward:
    """What runs a step of `model`: its one-call decode layers where they qualify, else the model."""
    fused = plan(model)
    return model if fused is None else fused
