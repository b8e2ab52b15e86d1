"""The ways in, on the caller's side: the ZeroMQ client SDK, the offline `LLM` API and batch mode.

`EngineClient` (blocking) and `AsyncEngineClient` (asyncio) talk to running `ember-core`s (`sdk`,
`async_client`, `dp_client` with `dp_router` over data-parallel cores); `llm.LLM` and `batch` run
an engine core in the caller's process (`dp_engine` for several). `from coreproc.client import
EngineClient, AsyncEngineClient` is the SDK's public path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coreproc.client.async_client import AsyncEngineClient
    from coreproc.client.sdk import EngineClient, EngineDeadError, EngineRequestError, connect_engines

__all__ = ["AsyncEngineClient", "EngineClient", "EngineDeadError", "EngineRequestError", "connect_engines"]


def __getattr__(name: str) -> Any:
    # imported when asked for: `coreproc.client.llm` alone needs neither ZeroMQ client
    if name in __all__:
        from coreproc.client import sdk

        return getattr(sdk, name)
    raise AttributeError(name)
