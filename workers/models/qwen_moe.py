"""Qwen2MoeForCausalLM and Qwen3MoeForCausalLM: Qwen2 / Qwen3 with experts in place of the MLP.

Runs in worker processes. The router's softmax over all experts, its top-k renormalized only with
`norm_topk_prob`; a layer is sparse unless `mlp_only_layers` lists it or it falls between every
`decoder_sparse_step`-th layer, a dense one keeping an MLP of `intermediate_size`. Qwen2-MoE adds a
shared expert every token goes through, its output gated by sigmoid(`shared_expert_gate`(x)), and
slides its window only with `use_sliding_window`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from workers.models.moe import MoEParts
from workers.models.parts import DecoderParts, LayerKind
from workers.models.qwen2 import Qwen2ForCausalLM
from workers.models.qwen3 import Qwen3ForCausalLM


def qwen_moe(cfg: Any, parts: DecoderParts, shared: int = 0) -> DecoderParts:
    """Qwen's experts (and shared expert of `shared` intermediate size) on a model's parts."""
    moe = MoEParts(
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
        renormalize=bool(cfg.norm_topk_prob),
        shared_intermediate=shared,
        shared_gate=shared > 0,
    )
    step, only = (
        int(getattr(cfg, "decoder_sparse_step", 1) or 1),
        set(getattr(cfg, "mlp_only_layers", []) or []),
    )
    dense = frozenset(i for i in range(cfg.num_hidden_layers) if i in only or (i + 1) % step)
    if not getattr(cfg, "use_sliding_window", False):
        parts = dataclasses.replace(parts, layers=tuple(LayerKind(None, k.rope) for k in parts.layers))
    return dataclasses.replace(parts, moe=moe, dense_layers=dense)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    @classmethod
    def decoder_parts(cls, cfg: Any) -> DecoderParts:
        return qwen_moe(cfg, super().decoder_parts(cfg), int(cfg.shared_expert_intermediate_size))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def decoder_parts(cls, cfg: Any) -> DecoderParts:
        return qwen_moe(cfg, super().decoder_parts(cfg))
