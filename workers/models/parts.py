"""The parts a decoder is assembled from, chosen once from the checkpoint's config.

Runs in worker processes. `DecoderParts` names what varies between the decoder-only architectures:
per layer (`LayerKind`) a sliding window or full attention and which rotary table (or none: NoPE);
q/k norms per head or over all heads; the attention scale; where the norms sit (`pre` as Llama,
`sandwich` as Gemma: before and after both attention and MLP, `post` as OLMo 2: after them only);
norms scaling by `1 + weight` (Gemma; folded into the weight as it loads, so every norm kernel runs
it); SwiGLU or GeGLU with tanh-GELU; embedding, residual and logit multipliers; soft caps of the
attention scores and of the final logits (Gemma 2). An architecture's
file builds its `DecoderParts` from its config (`LlamaForCausalLM.decoder_parts`) and names its
weights; `DecoderLayer` and `DecoderAttention` here compose them. Every part computes through the
model's ops strategy (ops.py: torch references, native CPU ops) and its attention backend, so the
same parts run on CPU and CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kernels import AttentionBackend, AttentionMetadata
from workers.models.layers import (
    ColumnLinear,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    RowLinear,
    attach_weight_loader,
    default_weight_loader,
)
from workers.models.moe import MoEMLP, MoEParts
from workers.models.ops import OpModule
from workers.parallel import TPGroup
from workers.quant.base import QuantMethod

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # config's name -> the MLP's gate
# where each placement puts the layer's norms, in DecoderLayer's attribute names and in the order the
# one-call decode layer reads them (Llama's "post_attention_layernorm" is the MLP's pre-norm; Gemma's
# and OLMo 2's follow attention)
LAYER_NORMS = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
}
NORM_PLACEMENTS = tuple(LAYER_NORMS)


@dataclass(frozen=True)
class LayerKind:
    """One decoder layer's attention: its sliding window (None: full) and rotary table (None: NoPE)."""

    window: int | None = None
    rope: str | None = "default"


@dataclass(frozen=True)
class DecoderParts:
    """What a decoder is made of; `LlamaForCausalLM.decoder_parts` gives Llama's."""

    layers: tuple[LayerKind, ...]
    rope: dict[str, dict[str, Any]] = field(default_factory=dict)  # rotary table -> its rope parameters
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # "head": RMSNorm over each head (Qwen3, Gemma 3); "all": over all heads
    attn_scale: float | None = None  # None: head_dim ** -0.5
    norms: str = "pre"  # one of NORM_PLACEMENTS
    norm_offset: bool = False  # RMSNorm scales by 1 + weight
    act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # the token embeddings times this (in the activation dtype)
    residual_scale: float = 1.0  # each block's output times this before the residual add
    logit_divisor: float = 1.0  # the logits divided by this
    attn_softcap: float = 0.0  # attention scores capped to c * tanh(score / c) (Gemma 2); 0: none
    final_softcap: float = 0.0  # the logits capped likewise, after the divisor; 0: none
    moe: MoEParts | None = None  # experts in place of the dense MLP (moe.py)
    dense_layers: frozenset[int] = frozenset()  # with `moe`: the layers that keep a dense MLP

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` runs experts."""
        return self.moe is not None and layer not in self.dense_layers

    def __post_init__(self) -> None:
        if self.norms not in NORM_PLACEMENTS:
            raise ValueError(f"norm placement {self.norms!r} is not one of {NORM_PLACEMENTS}")
        if self.qk_norm not in (None, "head", "all"):
            raise ValueError(f"q/k norm {self.qk_norm!r} is not 'head' or 'all'")


def activation(cfg: Any) -> str:
    """The MLP's gate from the config's `hidden_activation` (Gemma) or `hidden_act`."""
    name = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def norm(size: int, eps: float, parts: DecoderParts) -> RMSNorm:
    """An RMSNorm; with `norm_offset` its checkpoint weight w loads as 1 + w (HF Gemma's scale)."""
    layer = RMSNorm(size, eps)
    if parts.norm_offset:

        def offset_loader(param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
            default_weight_loader(param, loaded.float() + 1.0)

        attach_weight_loader(layer.weight, offset_loader)
    return layer


class DecoderAttention(nn.Module):
    """Grouped-query attention over the paged cache, with the q/k norms, scale, rotary table (or none)
    and sliding window its parts give it."""

    def __init__(
        self,
        cfg: Any,
        tp: TPGroup,
        backend: AttentionBackend,
        rotary: RotaryEmbedding | None,
        parts: DecoderParts,
        window: int | None,
        quant: QuantMethod | None = None,
    ) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self.head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        self.num_heads = tp.shard(heads, "num_attention_heads")
        self.num_kv_heads = tp.shard(kv_heads, "num_key_value_heads")
        d = self.head_dim
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        sizes = [heads * d, kv_heads * d, kv_heads * d]
        self.qkv_proj = ColumnLinear(hidden, sizes, parts.qkv_bias, tp, quant)
        self.o_proj = RowLinear(heads * d, hidden, parts.o_bias, tp, quant)
        self.qk_norm = parts.qk_norm
        if parts.qk_norm == "all" and tp.size > 1:
            raise ValueError("a q/k norm over all heads needs tensor_parallel_size=1 in this version")
        q_dim, k_dim = (d, d) if parts.qk_norm == "head" else (self.q_size, self.kv_size)
        self.q_norm = norm(q_dim, cfg.rms_norm_eps, parts) if parts.qk_norm else None
        self.k_norm = norm(k_dim, cfg.rms_norm_eps, parts) if parts.qk_norm else None
        self.rotary = rotary  # one table per kind, shared by the layers of that kind; None: NoPE
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, window, backend, parts.attn_softcap)
        if parts.attn_scale is not None:
            self.attn.scale = parts.attn_scale

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None and self.qk_norm == "all":
            q, k = self.q_norm(q), self.k_norm(k)
        # [T, heads * D] -> [T, heads, D]
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class DecoderMLP(OpModule):
    """down(act(gate) * up), gate and up in one stacked projection."""

    def __init__(self, cfg: Any, tp: TPGroup, act: str, quant: QuantMethod | None = None) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        bias = getattr(cfg, "mlp_bias", False)
        self.act = act
        self.gate_up_proj = ColumnLinear(cfg.hidden_size, [inter, inter], bias, tp, quant)
        self.down_proj = RowLinear(inter, cfg.hidden_size, bias, tp, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act == "gelu_tanh":
            return self.down_proj(self.ops.gelu_tanh_and_mul(gate_up))
        return self.down_proj(self.ops.silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    """Attention then MLP, each in a residual block with its norms where the parts place them:
    `pre` norm(x) -> block; `sandwich` norm(x) -> block -> norm; `post` block -> norm."""

    # those of LAYER_NORMS[placement] exist
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    pre_feedforward_layernorm: RMSNorm
    post_feedforward_layernorm: RMSNorm

    def __init__(
        self,
        cfg: Any,
        tp: TPGroup,
        attn: DecoderAttention,
        parts: DecoderParts,
        quant: QuantMethod | None = None,
        index: int = 0,
    ) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp: DecoderMLP | MoEMLP
        if parts.moe is not None and parts.sparse(index):
            self.mlp = MoEMLP(cfg, tp, parts.moe, parts.act, quant)
        else:
            self.mlp = DecoderMLP(cfg, tp, parts.act, quant)
        self.norms = parts.norms
        self.residual_scale = parts.residual_scale
        for name in LAYER_NORMS[parts.norms]:
            setattr(self, name, norm(cfg.hidden_size, cfg.rms_norm_eps, parts))

    def norm_modules(self) -> list[RMSNorm]:
        """The layer's norms in LAYER_NORMS order, then its attention's q and k norms when it has them."""
        attn = self.self_attn
        qk = [attn.q_norm, attn.k_norm] if attn.q_norm is not None and attn.k_norm is not None else []
        return [getattr(self, name) for name in LAYER_NORMS[self.norms]] + qk

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.norms == "pre":
            attn = self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
            x = self._add(x, attn)
            return self._add(x, self.mlp(self.post_attention_layernorm(x)))
        h = x if self.norms == "post" else self.input_layernorm(x)
        x = self._add(x, self.post_attention_layernorm(self.self_attn(positions, h, kv_cache, meta)))
        h = x if self.norms == "post" else self.pre_feedforward_layernorm(x)
        return self._add(x, self.post_feedforward_layernorm(self.mlp(h)))

    def _add(self, residual: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return residual + (out if self.residual_scale == 1.0 else out * self.residual_scale)
