"""Glm4MoeForCausalLM (GLM-4.5): DeepSeek-V3's routing on a Llama-shaped decoder.

Runs in worker processes. The router's sigmoid scores plus a learned correction bias choose the
experts (the bias only chooses: the weights are the plain scores), the top-k taken within the
`topk_group` best of `n_group` expert groups, renormalized with `norm_topk_prob` and times
`routed_scaling_factor`; `n_shared_experts` shared experts (one MLP of that many times the expert
size, no gate) add to every token; the first `first_k_dense_replace` layers keep a dense MLP.
Attention has q/k/v biases (`attention_bias`), q/k norms per head with `use_qk_norm`, and rotary on
the first `partial_rotary_factor` of each head (rotate-half). The checkpoint's `shared_experts` is
the MoE layer's `shared_expert`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from workers.models.llama import LlamaForCausalLM
from workers.models.moe import MoEParts
from workers.models.parts import DecoderParts


def v3_routing(cfg: Any, shared: int) -> MoEParts:
    """DeepSeek-V3's router as GLM-4.5's config names it (`shared`: the shared experts' size)."""
    return MoEParts(
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
        scoring="sigmoid",
        renormalize=bool(cfg.norm_topk_prob),
        shared_intermediate=shared,
        groups=int(cfg.n_group or 1),
        topk_groups=int(cfg.topk_group or 1),
        routed_scale=float(cfg.routed_scaling_factor),
        correction_bias=True,
    )


class Glm4MoeForCausalLM(LlamaForCausalLM):
    o_bias = False  # `attention_bias` gives q, k and v biases only

    @classmethod
    def decoder_parts(cls, cfg: Any) -> DecoderParts:
        shared = int(cfg.moe_intermediate_size) * int(cfg.n_shared_experts or 0)
        dense = frozenset(range(min(int(cfg.first_k_dense_replace), cfg.num_hidden_layers)))
        parts = super().decoder_parts(cfg)
        qk_norm = "head" if getattr(cfg, "use_qk_norm", False) else None
        return dataclasses.replace(parts, qk_norm=qk_norm, moe=v3_routing(cfg, shared), dense_layers=dense)

    def expand_tensor(self, name: str, tensor: Any) -> Iterator[tuple[str, Any]]:
        """GLM's `shared_experts` is the MoE layer's `shared_expert`; a GGUF file's correction bias
        (`exp_probs_b.bias`) is the router's `e_score_correction_bias`; the multi-token-prediction
        layers after the last decoder layer are not run (nothing loads); experts cut as any MoE's."""
        parts = name.split(".")
        if name.startswith("model.layers.") and int(parts[2]) >= self.config.num_hidden_layers:
            return
        name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
        name = name.replace(".mlp.gate.e_score_correction.bias", ".mlp.gate.e_score_correction_bias")
        yield from super().expand_tensor(name, tensor)
