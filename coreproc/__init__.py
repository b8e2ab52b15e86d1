"""Ember's scheduler side: the engine core, its configuration, wire protocol and the offline `LLM` API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from coreproc.protocol import InvalidParam, SamplingParams

if TYPE_CHECKING:
    from coreproc.llm import LLM
    from coreproc.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "InvalidParam"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and transformers; import it only when asked for
    if name == "LLM":
        from coreproc.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from coreproc import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
