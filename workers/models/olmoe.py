"""OlmoeForCausalLM: OLMo's experts, with Llama's pre-norms and q/k norms over all heads.

Runs in worker processes. The router's softmax over all experts, top-k renormalized only with
`norm_topk_prob`; the queries and keys RMS-normalized over the whole projection before rotary (every
head on one rank: tensor parallelism is refused for it, as for OLMo 2). `clip_qkv` is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from workers.models.llama import LlamaForCausalLM
from workers.models.moe import MoEParts
from workers.models.parts import DecoderParts


class OlmoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_parts(cls, cfg: Any) -> DecoderParts:
        if getattr(cfg, "clip_qkv", None) is not None:
            raise ValueError("OlmoeForCausalLM with clip_qkv is not supported in this version")
        moe = MoEParts(
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.intermediate_size,
            renormalize=bool(cfg.norm_topk_prob),
        )
        return dataclasses.replace(super().decoder_parts(cfg), qk_norm="all", moe=moe)
