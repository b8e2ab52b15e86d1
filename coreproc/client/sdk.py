"""The ZeroMQ client SDK: talk to running `ember-core`s directly, without HTTP.

Runs in the user's process. `AsyncEngineClient` (asyncio, coreproc/client/async_client.py) talks to one
core; `connect_engines` gives a `DPEngineClient` over one core or several data-parallel ones (what
the HTTP frontend uses); `EngineClient` is the blocking form, with a private event loop in a thread.
Streams of `EngineOutput`s, utility calls (info, stats, the prefix cache, LoRA adapters) and
`EngineDeadError` instead of a hang when a core is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from typing import Any

from coreproc.base.errors import EngineDeadError, EngineRequestError
from coreproc.base.protocol import (
    EngineInfo,
    EngineOutput,
    EngineRequest,
    SamplingParams,
    SchedulerStats,
)
from coreproc.client.async_client import AsyncEngineClient
from coreproc.client.dp_client import DPEngineClient
from coreproc.client.dp_router import Routing


async def connect_engines(
    addresses: Sequence[str], *, routing: Routing | None = None, timeout: float = 30.0, **keys: Any
) -> DPEngineClient:
    """A `DPEngineClient` of the cores at `addresses` (connected in parallel; one address is fine);
    EngineDeadError if any does not answer. `routing`: default, the cores' `--dp-routing`."""
    tasks = [asyncio.ensure_future(AsyncEngineClient.connect(a, timeout=timeout, **keys)) for a in addresses]
    done = await asyncio.gather(*tasks, return_exceptions=True)
    failed = next((d for d in done if isinstance(d, BaseException)), None)
    if failed is not None:
        for d in done:
            if isinstance(d, AsyncEngineClient):
                await d.aclose()
        raise failed
    return DPEngineClient([d for d in done if isinstance(d, AsyncEngineClient)], routing)


class EngineClient:
    """Blocking client: the same calls as `AsyncEngineClient`, on a private event-loop thread."""

    def __init__(self, address: str | Sequence[str], *, timeout: float = 30.0, **keys: Any) -> None:
        """`address`: one core's, or a list of data-parallel cores' (`ember core -dp D` prints them;
        requests are routed among them, `routing=` "least-loaded" or "prefix")."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ember-client", daemon=True)
        self._thread.start()
        self._pumps: set = set()
        try:
            connect: Coroutine[Any, Any, AsyncEngineClient | DPEngineClient]
            if isinstance(address, str):
                connect = AsyncEngineClient.connect(address, timeout=timeout, **keys)
            else:
                connect = connect_engines(address, timeout=timeout, **keys)
            self._client: AsyncEngineClient | DPEngineClient = self._run(connect)
        except BaseException:
            self._stop_loop()
            raise
        self.info_cache = self._client.info_cache

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def info(self) -> EngineInfo:
        return self._run(self._client.info())

    def stats(self) -> SchedulerStats:
        return self._run(self._client.stats())

    def reset_prefix_cache(self) -> int:
        return self._run(self._client.reset_prefix_cache())

    def load_lora(self, name: str, path: str) -> dict[str, Any]:
        return self._run(self._client.load_lora(name, path))

    def unload_lora(self, name: str) -> dict[str, Any]:
        return self._run(self._client.unload_lora(name))

    def abort(self, request_id: str) -> None:
        self._run(self._client.abort(request_id))

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams | None = None, **kw: Any
    ) -> Iterator[EngineOutput]:
        """Blocking iterator over one request's outputs (`lora="name"`, ...); closing it early aborts it."""
        return self._iterate(lambda: self._client.generate(prompt_token_ids, params, **kw))

    def generate_many(self, requests: list[EngineRequest], **kw: Any) -> Iterator[EngineOutput]:
        """Blocking iterator over the merged outputs of requests submitted as one unit (see
        `AsyncEngineClient.generate_many`); closing it early aborts them."""
        return self._iterate(lambda: self._client.generate_many(requests, **kw))

    def _iterate(self, outputs: Callable[[], AsyncIterator[EngineOutput]]) -> Iterator[EngineOutput]:
        items: queue.Queue = queue.Queue()
        end = object()

        async def pump() -> None:
            try:
                async for out in outputs():
                    items.put(out)
            except Exception as e:
                items.put(e)
            finally:
                items.put(end)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        self._pumps.add(future)
        future.add_done_callback(self._pumps.discard)
        finished = False
        try:
            while (item := items.get()) is not end:
                if isinstance(item, Exception):
                    raise item
                yield item
            finished = True
        finally:
            if not finished and not self._loop.is_closed():
                future.cancel()  # cancels the stream, which aborts the request in the engine
                with contextlib.suppress(BaseException):
                    future.result(timeout=30)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        for pump in list(self._pumps):  # open streams: cancel them (which aborts their requests)
            pump.cancel()
            with contextlib.suppress(BaseException):
                pump.result(timeout=30)
        self._run(self._client.aclose())
        self._stop_loop()
        self._loop.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["AsyncEngineClient", "EngineClient", "EngineDeadError", "EngineRequestError", "connect_engines"]
