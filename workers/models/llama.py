"""LlamaForCausalLM: the decoder-only transformer every supported architecture is built as.

Runs in worker processes. Weight names mirror Hugging Face's (`model.layers.N.self_attn.q_proj`, ...);
q/k/v and gate/up are stacked into one projection each, mapped by `stacked_params`. A model is
assembled from the parts its config chooses (parts.py: `decoder_parts` gives Llama's; an architecture
overrides it, or flips the class attributes below for the Llama-shaped ones). Which kernels run (the
ops strategy, the one-call decode layers) is chosen by the worker after building.
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
from workers.models.layers import LMHead, RMSNorm, RotaryEmbedding, VocabEmbedding
from workers.models.moe import split_experts
from workers.models.parts import DecoderAttention, DecoderLayer, DecoderParts, LayerKind, activation, norm
from workers.parallel import PPGroup, TPGroup
from workers.quant.base import QuantMethod


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
        self,
        cfg: Any,
        tp: TPGroup,
        layers: Sequence[nn.Module],
        parts: DecoderParts,
        embed: bool = True,
        final_norm: bool = True,
    ) -> None:
        super().__init__()
        embedding = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp) if embed else StageMissing()
        self.embed_tokens = cast(VocabEmbedding, embedding)
        self.layers = cast(DecoderLayers, nn.ModuleList(layers))
        last = norm(cfg.hidden_size, cfg.rms_norm_eps, parts) if final_norm else StageMissing()
        self.norm = cast(RMSNorm, last)


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
        self.parts = parts = self.decoder_parts(cfg)
        held = self.pp.layers(cfg.num_hidden_layers)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # one rotary table per kind of layer that rotates (Gemma 3: local and global bases)
        tables = {kind.rope for kind in parts.layers if kind.rope is not None}
        kinds = {name: None if name == "default" else name for name in sorted(tables)}
        rotary = {
            name: RotaryEmbedding(cfg, head_dim, max_positions, layer_type=k) for name, k in kinds.items()
        }
        layers = [
            DecoderLayer(cfg, tp, self._attention(cfg, tp, backend, rotary, kind, quant), parts, quant, i)
            if i in held
            else StageMissing()
            for i, kind in enumerate(parts.layers)
        ]
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        first, last = self.pp.is_first, self.pp.is_last
        embed = first or (last and self.tie_word_embeddings)
        self.model = DecoderModel(cfg, tp, layers, parts, embed, last)
        self.held = held  # the decoder layers this stage computes
        head_quant = None if quant is None else quant.head_method()
        head = LMHead(cfg.vocab_size, cfg.hidden_size, tp, head_quant) if last else StageMissing()
        self.lm_head = cast(LMHead, head)
        missing = [f"model.layers.{i}." for i in range(cfg.num_hidden_layers) if i not in held]
        missing += [] if embed else ["model.embed_tokens."]
        missing += [] if last else ["model.norm.", "lm_head."]
        self.missing_prefixes = tuple(missing)  # checkpoint tensors another pipeline stage loads
        if self.tie_word_embeddings and last:
            # loaded once, with the embedding; a head method (the CPU fast path's packing) then makes
            # the head its own processed copy, since the embedding lookup needs the plain rows
            self.lm_head.weight = self.model.embed_tokens.weight

    def _attention(
        self,
        cfg: Any,
        tp: TPGroup,
        backend: AttentionBackend,
        rotary: dict[str, RotaryEmbedding],
        kind: LayerKind,
        quant: QuantMethod | None,
    ) -> DecoderAttention:
        table = None if kind.rope is None else rotary[kind.rope]
        return DecoderAttention(cfg, tp, backend, table, self.parts, kind.window, quant)

    @classmethod
    def decoder_parts(cls, cfg: Any) -> DecoderParts:
        """Llama's parts: pre-norms, SwiGLU, one rotary table, biases as `attention_bias` says unless
        the class fixes them, q/k norms per head when the class says, sliding windows per
        `layer_types` (every layer's with `sliding_window_all_layers`)."""
        bias = bool(getattr(cfg, "attention_bias", False))
        layers = tuple(LayerKind(cls.layer_sliding_window(cfg, i)) for i in range(cfg.num_hidden_layers))
        return DecoderParts(
            layers=layers,
            qkv_bias=bias if cls.qkv_bias is None else cls.qkv_bias,
            o_bias=bias if cls.o_bias is None else cls.o_bias,
            qk_norm="head" if cls.qk_norm else None,
            act=activation(cfg),
        )

    @classmethod
    def layer_sliding_window(cls, cfg: Any, index: int) -> int | None:
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if window is None:
            return None
        if layer_types is not None:
            return window if layer_types[index] == "sliding_attention" else None
        return window if cls.sliding_window_all_layers else None

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
            x = layers[i](positions, x, kv_cache, meta.for_layer(i))
        return self.model.norm(x) if self.pp.is_last else x

    def expand_tensor(self, name: str, tensor: Any) -> Iterator[tuple[str, Any]]:
        """The parameters a checkpoint tensor holds (the loader's hook): a mixture of experts' stacked
        experts (a GGUF file's `ffn_*_exps`) cut into each expert's; any other tensor as it is."""
        if self.parts.moe is None:
            yield name, tensor
        else:
            yield from split_experts(name, tensor, self.parts.moe.num_experts)

    def held_layers(self) -> list[DecoderLayer]:
        """The decoder layers this pipeline stage holds (every layer of a single stage), in order."""
        return [self.model.layers[i] for i in self.held]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings [T, hidden] of `input_ids` [T] (times the parts' embedding scale,
        rounded to the activation dtype as Gemma's scaled embedding does)."""
        x = self.model.embed_tokens(input_ids)
        scale = self.parts.embed_scale
        return x if scale == 1.0 else x * torch.tensor(scale, dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        if self.parts.logit_divisor != 1.0:
            logits = logits / self.parts.logit_divisor
        cap = self.parts.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap
