"""Ember's engine below the HTTP server, in role folders: `base/` (the shared base every layer may
import), `core/` (the core process), `startup/` (who starts whom), `client/` (the SDK, the offline
`LLM`, batch mode) and `text/` (text in and out). This module is the public face: `LLM`,
`SamplingParams`, `RequestOutput`, `CompletionOutput` and `InvalidParam`, imported when asked for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coreproc.base.errors import InvalidParam
    from coreproc.base.protocol import SamplingParams
    from coreproc.client.llm import LLM
    from coreproc.text.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "InvalidParam"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and transformers, the protocol msgspec: imported when asked for (a light
    # command such as `ember snapshot restore` imports a coreproc module without them)
    if name == "InvalidParam":
        from coreproc.base.errors import InvalidParam

        return InvalidParam
    if name == "SamplingParams":
        from coreproc.base.protocol import SamplingParams

        return SamplingParams
    if name == "LLM":
        from coreproc.client.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from coreproc.text import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
