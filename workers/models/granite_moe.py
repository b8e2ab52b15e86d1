"""GraniteMoeForCausalLM: Granite's four multipliers with experts in place of each MLP.

Runs in worker processes. The router takes the top-k logits and a softmax over them (moe.py's
`topk_softmax`). The checkpoint stacks a layer's experts in 3-D tensors: `input_linear` [E, 2I, H]
(gate then up) and `output_linear` [E, H, I], cut here into each expert's projections, and names the
router `router.layer`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from workers.models.granite import GraniteForCausalLM
from workers.models.moe import MoEParts
from workers.models.parts import DecoderParts

RENAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".mlp.router.layer.", ".mlp.gate."),
    (".mlp.input_linear.", ".mlp.experts.gate_up_proj."),
    (".mlp.output_linear.", ".mlp.experts.down_proj."),
)


class GraniteMoeForCausalLM(GraniteForCausalLM):
    @classmethod
    def decoder_parts(cls, cfg: Any) -> DecoderParts:
        moe = MoEParts(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, "topk_softmax")
        return dataclasses.replace(super().decoder_parts(cfg), moe=moe)

    def expand_tensor(self, name: str, tensor: Any) -> Iterator[tuple[str, Any]]:
        """Granite's names as the MoE layer's: its stacked experts are cut as any (moe.split_experts)."""
        for old, new in RENAMES:
            name = name.replace(old, new)
        yield from super().expand_tensor(name, tensor)
