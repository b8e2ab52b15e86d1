"""Gemma2ForCausalLM: sliding-window and global layers in turn, with soft-capped attention and logits.

Runs in worker processes. Gemma's parts: a norm before and after both attention and MLP, every
RMSNorm scaling by 1 + weight, the attention scale from `query_pre_attn_scalar`, GeGLU with
tanh-GELU, token embeddings times sqrt(hidden), the head tied to the embedding; Gemma 2's own: each
attention score capped to c * tanh(score / c) (`attn_logit_softcapping`) and the logits likewise
(`final_logit_softcapping`). `layer_types` says which layers slide (every other one, from the first).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from workers.models.llama import LlamaForCausalLM
from workers.models.parts import DecoderParts


class Gemma2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_parts(cls, cfg: Any) -> DecoderParts:
        return dataclasses.replace(
            super().decoder_parts(cfg),
            attn_scale=float(cfg.query_pre_attn_scalar) ** -0.5,
            norms="sandwich",
            norm_offset=True,
            embed_scale=float(cfg.hidden_size) ** 0.5,
            attn_softcap=float(getattr(cfg, "attn_logit_softcapping", None) or 0.0),
            final_softcap=float(getattr(cfg, "final_logit_softcapping", None) or 0.0),
        )
