"""MixtralForCausalLM: Mistral with eight experts in place of each MLP, two per token.

Runs in worker processes. The router's softmax over all experts, its top-k renormalized to sum to 1
(moe.py); the checkpoint names the layer's experts `block_sparse_moe.experts.N.w1/w3/w2` (gate, up,
down), read here as the MoE layer's `mlp.experts.N.gate_proj/up_proj/down_proj`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from workers.models.mistral import MistralForCausalLM
from workers.models.moe import MoEParts
from workers.models.parts import DecoderParts

EXPERT_NAMES = ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


class MixtralForCausalLM(MistralForCausalLM):
    @classmethod
    def decoder_parts(cls, cfg: Any) -> DecoderParts:
        moe = MoEParts(
            cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, renormalize=True
        )
        return dataclasses.replace(super().decoder_parts(cfg), moe=moe)

    def expand_tensor(self, name: str, tensor: Any) -> Iterator[tuple[str, Any]]:
        """The checkpoint's expert names as the MoE layer's; a GGUF file's stacked experts cut."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if ".experts." in name:
            for old, new in EXPERT_NAMES:
                name = name.replace(old, new)
        yield from super().expand_tensor(name, tensor)
