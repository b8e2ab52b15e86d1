"""Ember's scheduler side: the engine core, its configuration, wire protocol and the offline `LLM` API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coreproc.errors import InvalidParam
    from coreproc.llm import LLM
    from coreproc.outputs import CompletionOutput, RequestOutput
    from coreproc.protocol import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "InvalidParam"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and transformers, the protocol msgspec: imported when asked for (a light
    # command such as `ember snapshot restore` imports a coreproc module without them)
    if name == "InvalidParam":
        from coreproc.errors import InvalidParam

        return InvalidParam
    if name == "SamplingParams":
        from coreproc.protocol import SamplingParams

        return SamplingParams
    if name == "LLM":
        from coreproc.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from coreproc import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
