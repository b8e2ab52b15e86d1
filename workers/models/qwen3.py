"""Qwen3ForCausalLM: Llama with per-head RMSNorm on queries and keys (before rotary).

Runs in worker processes; biases follow `attention_bias` (off in released Qwen3 checkpoints) and the
head size comes from the config's explicit `head_dim`. Everything else is inherited from llama.
"""

from __future__ import annotations

from workers.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
