"""The model classes of the architecture registry (coreproc.base.model_config.ARCHITECTURES).

Runs in worker processes. Entries name a module and a class so that looking up what is supported
never imports torch; `resolve()` imports the class.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from coreproc.base.model_config import ARCHITECTURES

if TYPE_CHECKING:
    from workers.models.llama import LlamaForCausalLM

SUPPORTED_ARCHITECTURES = ARCHITECTURES  # the registry lives in the shared base (coreproc.base.model_config)


def resolve(architecture: str) -> type[LlamaForCausalLM]:
    """Import and return the model class for an HF architecture name (all of them specialise Llama's)."""
    try:
        target = SUPPORTED_ARCHITECTURES[architecture]
    except KeyError:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {supported}") from None
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)
