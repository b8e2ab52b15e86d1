"""Ember's scheduler side: the engine core, its configuration, wire protocol and the offline `LLM` API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coreproc.llm import LLM
    from coreproc.outputs import CompletionOutput, RequestOutput
    from coreproc.protocol import InvalidParam, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "InvalidParam"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and transformers, the protocol msgspec: imported when asked for (a light
    # command such as `ember snapshot restore` imports a coreproc module without them)
    if name in ("SamplingParams", "InvalidParam"):
        from coreproc import protocol

        return getattr(protocol, name)
    if name == "LLM":
        from coreproc.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from coreproc import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
