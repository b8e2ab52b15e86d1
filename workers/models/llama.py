"""LlamaForCausalLM: the decoder-only transformer that the other supported architectures specialise.

Runs in worker processes. Weight names mirror Hugging Face's (`model.layers.N.self_attn.q_proj`, ...);
q/k/v and gate/up are stacked into one projection each, mapped by `stacked_params`. Subclasses flip
class attributes (qkv bias, q/k norm, sliding window) instead of re-implementing layers. Which kernels
run (the ops strategy, the one-call decode layers) is chosen by the worker after building.
forward(input_ids[T], positions[T], kv_caches, meta) -> hidden[T, hidden]; compute_logits -> float32.
A pipeline stage builds only its layers (the others are `StageMissing`, so names keep their indices),
the embedding on the first stage and the final norm and LM head on the last (the embedding too when
the head is tied to it); `missing_prefixes` tells the loader which checkpoint tensors another stage loads.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, cast

import torch
from torch import nn

from kernels import AttentionBackend, AttentionMetadata
from workers.models.layers import (
    ColumnLinear,
    LMHead,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    RowLinear,
    VocabEmbedding,
)
from workers.models.ops import OpModule
from workers.parallel import PPGroup, TPGroup
from workers.quant.base import QuantMethod


class DecoderAttention(nn.Module):
    def __init__(
        self,
        cfg: Any,
        tp: TPGroup,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        sliding_window: int | None,
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
        self.qkv_proj = ColumnLinear(hidden, [heads * d, kv_heads * d, kv_heads * d], qkv_bias, tp, quant)
        self.o_proj = RowLinear(heads * d, hidden, o_bias, tp, quant)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = rotary  # one table shared by every layer
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, sliding_window, backend)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # [T, heads * D] -> [T, heads, D]
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (`qk_norm`)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class DecoderMLP(OpModule):
    def __init__(self, cfg: Any, tp: TPGroup, quant: QuantMethod | None = None) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"activation {act!r} is not supported (only silu)")
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = ColumnLinear(cfg.hidden_size, [inter, inter], bias, tp, quant)
        self.down_proj = RowLinear(inter, cfg.hidden_size, bias, tp, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: Any, tp: TPGroup, attn: DecoderAttention, quant: QuantMethod | None = None
    ) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = DecoderMLP(cfg, tp, quant)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class StageMissing(nn.Module):
    """Stands in for a module another pipeline stage holds: no parameters, and never called."""

    def forward(self, *args: Any) -> torch.Tensor:
        raise AssertionError("a module held by another pipeline stage was called")


class DecoderLayers(Protocol):
    """How the model's nn.ModuleList of DecoderLayers reads (torch types its items as plain Modules)."""

    def __getitem__(self, index: int) -> DecoderLayer: ...

    def __iter__(self) -> Iterator[DecoderLayer]: ...

    def __len__(self) -> int: ...


class DecoderModel(nn.Module):
    layers: DecoderLayers

    def __init__(
        self, cfg: Any, tp: TPGroup, layers: Sequence[nn.Module], embed: bool = True, norm: bool = True
    ) -> None:
        super().__init__()
        embedding = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp) if embed else StageMissing()
        self.embed_tokens = cast(VocabEmbedding, embedding)
        self.layers = cast(DecoderLayers, nn.ModuleList(layers))
        self.norm = cast(RMSNorm, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if norm else StageMissing())


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM; the class attributes below are what subclasses change."""

    qkv_bias: bool | None = None  # None: follow config.attention_bias
    o_bias: bool | None = None  # None: follow config.attention_bias
    qk_norm = False
    sliding_window_all_layers = False  # Mistral applies config.sliding_window everywhere
    stacked_params: tuple[tuple[str, str, Any], ...] = (
        ("qkv_proj", "q_proj", 0),
        ("qkv_proj", "k_proj", 1),
        ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )
    # checkpoint entries that carry no weights we need (precomputed rotary tables)
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def __init__(
        self,
        cfg: Any,
        tp: TPGroup,
        backend: AttentionBackend,
        max_positions: int,
        quant: QuantMethod | None = None,
        pp: PPGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.pp = pp or PPGroup()
        held = self.pp.layers(cfg.num_hidden_layers)
        cfg_bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias = cfg_bias if self.qkv_bias is None else self.qkv_bias
        o_bias = cfg_bias if self.o_bias is None else self.o_bias
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = RotaryEmbedding(cfg, head_dim, max_positions)
        layers = [
            DecoderLayer(
                cfg,
                tp,
                DecoderAttention(
                    cfg,
                    tp,
                    backend,
                    rotary,
                    qkv_bias,
                    o_bias,
                    self.qk_norm,
                    self.layer_sliding_window(cfg, i),
                    quant,
                ),
                quant,
            )
            if i in held
            else StageMissing()
            for i in range(cfg.num_hidden_layers)
        ]
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        first, last = self.pp.is_first, self.pp.is_last
        self.model = DecoderModel(cfg, tp, layers, first or (last and self.tie_word_embeddings), last)
        self.held = held  # the decoder layers this stage computes
        head_quant = None if quant is None else quant.head_method()
        head = LMHead(cfg.vocab_size, cfg.hidden_size, tp, head_quant) if last else StageMissing()
        self.lm_head = cast(LMHead, head)
        missing = [f"model.layers.{i}." for i in range(cfg.num_hidden_layers) if i not in held]
        missing += [] if first or (last and self.tie_word_embeddings) else ["model.embed_tokens."]
        missing += [] if last else ["model.norm.", "lm_head."]
        self.missing_prefixes = tuple(missing)  # checkpoint tensors another pipeline stage loads
        if self.tie_word_embeddings and last:
            # loaded once, with the embedding; a head method (the CPU fast path's packing) then makes
            # the head its own processed copy, since the embedding lookup needs the plain rows
            self.lm_head.weight = self.model.embed_tokens.weight

    def layer_sliding_window(self, cfg: Any, index: int) -> int | None:
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if window is None:
            return None
        if layer_types is not None:
            return window if layer_types[index] == "sliding_attention" else None
        return window if self.sliding_window_all_layers else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; `inputs_embeds` [T, hidden], when given,
        replaces the token embeddings (a multimodal model's, with image features at its placeholders; a
        later pipeline stage's, the previous stage's output). A stage before the last returns its
        last layer's output, without the norm. `kv_caches`: one per layer held."""
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        layers = self.model.layers
        for i, kv_cache in zip(self.held, kv_caches, strict=True):
            x = layers[i](positions, x, kv_cache, meta)
        return self.model.norm(x) if self.pp.is_last else x

    def held_layers(self) -> list[DecoderLayer]:
        """The decoder layers this pipeline stage holds (every layer of a single stage), in order."""
        return [self.model.layers[i] for i in self.held]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings [T, hidden] of `input_ids` [T]."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)
