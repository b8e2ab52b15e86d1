"""MistralForCausalLM: Llama with an optional sliding attention window on every layer.

Runs in worker processes. When `sliding_window` is set in the config, a query at position i sees only
keys at positions i - window + 1 .. i, in both attention backends.
"""

from __future__ import annotations

from workers.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    sliding_window_all_layers = True
