"""Phi3ForCausalLM: Llama's shape with q/k/v and gate/up fused in the checkpoint, and LongRoPE.

Runs in worker processes. The checkpoint holds `qkv_proj` and `gate_up_proj` already stacked, so
they load whole (each cut to this rank's slices: `ColumnLinear.weight_loader`) instead of by parts;
`sliding_window`, when the config sets one, applies to every layer; a partial rotary factor comes
from the rope parameters. LongRoPE (`longrope`) runs its short factors, as transformers does for
sequences within `original_max_position_embeddings`, the longest context Ember allows it
(coreproc.base.model_config.longrope_limit).
"""

from __future__ import annotations

from typing import Any

from workers.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    sliding_window_all_layers = True
    stacked_params: tuple[tuple[str, str, Any], ...] = ()  # fused in the checkpoint already
    # a GGUF file's LongRoPE factors, which its config already carries
    ignored_suffixes = (
        *LlamaForCausalLM.ignored_suffixes,
        "rope_factors_long.weight",
        "rope_factors_short.weight",
    )
