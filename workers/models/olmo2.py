"""Olmo2ForCausalLM: Llama with its norms after attention and MLP, and q/k norms over all heads.

Runs in worker processes. Each block's output is normalized before the residual add
(`post_attention_layernorm`, `post_feedforward_layernorm`; nothing before the blocks), and the
queries and keys are RMS-normalized over the whole projection before rotary. The norm over all heads
needs every head on one rank: tensor parallelism is refused for it in this version.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from workers.models.llama import LlamaForCausalLM
from workers.models.parts import DecoderParts


class Olmo2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_parts(cls, cfg: Any) -> DecoderParts:
        return dataclasses.replace(super().decoder_parts(cfg), qk_norm="all", norms="post")
