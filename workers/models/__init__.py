"""Registry of model architectures, keyed by the Hugging Face `architectures` string.

Runs in worker processes (and is read by the config in every process). Entries name a module and a
class so that looking up what is supported never imports torch; `resolve()` imports the class.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.models.llama import LlamaForCausalLM

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "workers.models.llama:LlamaForCausalLM",
    "LlavaForConditionalGeneration": "workers.models.llava:LlavaForConditionalGeneration",
    "MistralForCausalLM": "workers.models.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": "workers.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "workers.models.qwen3:Qwen3ForCausalLM",
}


def resolve(architecture: str) -> type[LlamaForCausalLM]:
    """Import and return the model class for an HF architecture name (all of them specialise Llama's)."""
    try:
        target = SUPPORTED_ARCHITECTURES[architecture]
    except KeyError:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {supported}") from None
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)
