"""GraniteForCausalLM: Llama with four multipliers from its config.

Runs in worker processes. Token embeddings times `embedding_multiplier`, the attention scale is
`attention_multiplier` (not 1/sqrt(head_dim)), each block's output times `residual_multiplier`
before the residual add, and the logits divided by `logits_scaling`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from workers.models.llama import LlamaForCausalLM
from workers.models.parts import DecoderParts


class GraniteForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_parts(cls, cfg: Any) -> DecoderParts:
        return dataclasses.replace(
            super().decoder_parts(cfg),
            embed_scale=float(cfg.embedding_multiplier),
            attn_scale=float(cfg.attention_multiplier),
            residual_scale=float(cfg.residual_multiplier),
            logit_divisor=float(cfg.logits_scaling),
        )
