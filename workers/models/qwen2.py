"""Qwen2ForCausalLM: Llama with a bias on the q/k/v projections (none on o_proj).

Runs in worker processes; everything else is inherited from `workers.models.llama`.
Sliding-window layers, when a config enables them, come from its `layer_types`.
"""

from __future__ import annotations

from workers.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False
