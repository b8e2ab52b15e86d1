"""Gemma3ForCausalLM (text): five sliding-window layers to one global, each kind with its own rope base.

Runs in worker processes. Gemma's parts: a norm before and after both attention and MLP, every
RMSNorm scaling by 1 + weight, q/k norms per head, the attention scale from `query_pre_attn_scalar`,
GeGLU with tanh-GELU, token embeddings times sqrt(hidden), and the head tied to the embedding.
`layer_types` says which layers slide; `rope_parameters` holds one entry per layer type (local and
global bases, the global one possibly scaled).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from workers.models.llama import LlamaForCausalLM
from workers.models.parts import DecoderParts, LayerKind


class Gemma3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_parts(cls, cfg: Any) -> DecoderParts:
        if getattr(cfg, "attn_logit_softcapping", None) or getattr(cfg, "final_logit_softcapping", None):
            raise ValueError("Gemma 3 with logit soft-capping is not supported in this version")
        llama = super().decoder_parts(cfg)
        layers = tuple(LayerKind(kind.window, rope=cfg.layer_types[i]) for i, kind in enumerate(llama.layers))
        return dataclasses.replace(
            llama,
            layers=layers,
            qk_norm="head",
            attn_scale=float(cfg.query_pre_attn_scalar) ** -0.5,
            norms="sandwich",
            norm_offset=True,
            embed_scale=float(cfg.hidden_size) ** 0.5,
        )
