"""The asyncio client of one engine core: `AsyncEngineClient`, the SDK's base (coreproc/client/sdk.py).

Runs in the user's process and in the HTTP frontend. A DEALER socket to the core's ROUTER submits
`EngineRequest`s (one, or the sequences of one API request together) and streams their
`EngineOutput`s back (token ids, logprobs, finish reason); leaving a stream early aborts the
requests. Utility calls: info, stats, the prefix cache, LoRA adapters loaded and unloaded at run
time. A socket monitor notices a lost connection, and an `EngineDead` from the core fails every open
stream with `EngineDeadError` instead of hanging. CURVE keys are used for non-loopback TCP.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from coreproc.base.errors import EngineDeadError, EngineRequestError
from coreproc.base.ipc import Codec, apply_curve_client
from coreproc.base.protocol import (
    TO_CLIENT,
    UTILITY_METHODS,
    AbortRequests,
    EngineDead,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    MultiModalRef,
    OutputBatch,
    SamplingParams,
    SchedulerStats,
    SubmitRequests,
    UtilityCall,
    UtilityMethod,
    UtilityResult,
    make_request,
)
from coreproc.core.mm_store import MediaShadow

HEARTBEAT_S = 1.0


def _settle(fut: asyncio.Future | None, error: BaseException | None = None) -> None:
    if fut is not None and not fut.done():
        if error is None:
            fut.set_result(True)
        else:
            fut.set_exception(error)


_FATAL_EVENTS = {
    zmq.EVENT_DISCONNECTED: "connection to the engine lost",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the engine refused our key",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "security handshake failed (does the engine require CURVE keys?)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "security handshake failed",
}


class _Stream:
    """The outputs of one submission not yet read, counted in tokens so a bound can be kept."""

    def __init__(self, max_tokens: int | None) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.max_tokens = max_tokens
        self.buffered = 0
        self.overflowed = False

    def put(self, out: EngineOutput) -> bool:
        """Queue an output; True when the bound is now exceeded."""
        self.buffered += len(out.new_token_ids)
        self.queue.put_nowait(out)
        return self.max_tokens is not None and self.buffered > self.max_tokens

    def fail(self, error: BaseException) -> None:
        self.overflowed = True
        while not self.queue.empty():
            self.queue.get_nowait()
        self.buffered = 0
        self.queue.put_nowait(error)

    async def get(self) -> EngineOutput | BaseException:
        item = await self.queue.get()
        if isinstance(item, EngineOutput):
            self.buffered -= len(item.new_token_ids)
        return item


class AsyncEngineClient:
    """asyncio client of one engine core. Use `await AsyncEngineClient.connect(address)`."""

    def __init__(
        self, address: str, *, server_key: Path | None = None, client_key: Path | None = None
    ) -> None:
        self.address = address
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)  # outputs are never dropped on our side either
        self.sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
        if server_key is not None:
            if client_key is None:
                raise ValueError("CURVE needs both the server's public key and our secret key")
            apply_curve_client(self.sock, server_key, client_key)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | sum(_FATAL_EVENTS))
        self.sock.connect(address)
        self.codec = Codec(TO_CLIENT)
        self.streams: dict[str, _Stream] = {}  # by request id (the requests of one submission share one)
        self.calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self.dead: str | None = None
        self.info_cache: EngineInfo | None = None
        self.media: MediaShadow | None = None  # what the core's image store holds (after `connect`)
        self._readers: list[asyncio.Task] = []

    @classmethod
    async def connect(cls, address: str, *, timeout: float = 30.0, **keys: Any) -> AsyncEngineClient:
        """Connect and fetch the engine's info; raises EngineDeadError if it does not answer."""
        client = cls(address, **keys)
        try:
            client.info_cache = await client.info(timeout=timeout)
            client.media = MediaShadow(client.info_cache.mm_cache_bytes)
        except BaseException:
            await client.aclose()
            raise
        return client

    # ------------------------------------------------------------------ background reading

    def _start(self) -> None:
        if not self._readers:
            self._readers = [
                asyncio.ensure_future(c) for c in (self._read(), self._watch(), self._heartbeat())
            ]

    async def _heartbeat(self) -> None:
        """While streams are open, tell the core we are alive (it aborts the requests of silent clients)."""
        while self.dead is None:
            if self.streams:
                await self.sock.send_multipart(self.codec.encode(UtilityCall(0, "ping")))
            await asyncio.sleep(HEARTBEAT_S)

    async def _read(self) -> None:
        while self.dead is None:
            try:
                msg = self.codec.decode(await self.sock.recv_multipart())
            except zmq.ZMQError:
                return
            if isinstance(msg, OutputBatch):
                for out in msg.outputs:
                    stream = self.streams.get(out.request_id)
                    if stream is not None and stream.put(out):
                        await self._overflow(stream)
            elif isinstance(msg, UtilityResult):
                fut = self.calls.pop(msg.call_id, None)
                if fut is not None and not fut.done():
                    if msg.error is not None:
                        fut.set_exception(EngineRequestError(msg.error))
                    else:
                        fut.set_result(msg.result)
            elif isinstance(msg, EngineDead):
                self._die(f"engine dead: {msg.reason}")

    async def _watch(self) -> None:
        while self.dead is None:
            try:
                event = parse_monitor_message(await self.monitor.recv_multipart())
            except zmq.ZMQError:
                return
            reason = _FATAL_EVENTS.get(zmq.Event(event["event"]))
            if reason is not None:
                self._die(reason)

    def declare_dead(self, reason: str) -> None:
        """Give the engine up (it stopped answering): every open stream and call fails with `reason`."""
        self._die(reason)

    def _die(self, reason: str) -> None:
        if self.dead is not None:
            return
        self.dead = reason
        for stream in {id(s): s for s in self.streams.values()}.values():
            stream.queue.put_nowait(EngineDeadError(reason))
        for fut in self.calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self.calls.clear()

    async def _overflow(self, stream: _Stream) -> None:
        """A consumer fell too far behind: drop what it has not read, abort its requests."""
        rids = [rid for rid, s in self.streams.items() if s is stream]
        for rid in rids:
            del self.streams[rid]
        stream.fail(
            EngineRequestError(
                f"aborted: the reader fell more than {stream.max_tokens} tokens behind the engine",
                "slow_consumer",
            )
        )
        await self.sock.send_multipart(self.codec.encode(AbortRequests(rids)))

    async def _send(self, msg: object) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self._start()
        await self.sock.send_multipart(self.codec.encode(msg))

    # ------------------------------------------------------------------ public calls

    async def call(self, method: UtilityMethod, timeout: float | None = 30.0, **args: Any) -> Any:
        """A utility RPC (see `UtilityMethod`); ValueError for a method the core does not answer."""
        if method not in UTILITY_METHODS:
            raise ValueError(f"unknown utility method {method!r}; the core answers {UTILITY_METHODS}")
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self.calls[call_id] = fut
        await self._send(UtilityCall(call_id, method, args))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self.calls.pop(call_id, None)
            raise EngineDeadError(
                f"the engine at {self.address} did not answer {method!r} in {timeout}s"
            ) from None

    async def info(self, timeout: float | None = 30.0) -> EngineInfo:
        return msgspec.convert(await self.call("info", timeout), EngineInfo)

    async def stats(self, timeout: float | None = 30.0) -> SchedulerStats:
        return msgspec.convert(await self.call("stats", timeout), SchedulerStats)

    async def reset_prefix_cache(self) -> int:
        return await self.call("reset_prefix_cache")

    async def load_lora(self, name: str, path: str, timeout: float | None = 60.0) -> dict[str, Any]:
        """Serve the PEFT LoRA folder `path` (on the core's host) as adapter `name` from the next request
        on (a name again: new weights for new requests); {"lora_name", "lora_path", "rank"}, or
        `EngineRequestError` saying why it cannot be served."""
        return await self.call("load_lora", timeout, lora_name=name, lora_path=path)

    async def unload_lora(self, name: str) -> dict[str, Any]:
        """No new requests for adapter `name`; those running with it finish with it."""
        return await self.call("unload_lora", lora_name=name)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        eos_token_ids: list[int] | None = None,
        admitted: asyncio.Future | None = None,
        mm_refs: list[MultiModalRef] | None = None,
        lora: str | None = None,
    ) -> AsyncIterator[EngineOutput]:
        """Submit one request (one sequence: `params.n` must be 1) and stream its outputs; the last one
        has `finished` set. `admitted`, if given, resolves when the engine accepts the request (or
        fails with the refusal), before any token. `mm_refs`: its images, placeholders already in the
        prompt (`coreproc.text.media.MediaIntake` builds both from image files or URLs). `lora`: the
        name of a loaded adapter to run with (`load_lora`, `--lora-modules`); None: the base model."""
        request = make_request(
            prompt_token_ids,
            params,
            request_id=request_id,
            priority=priority,
            cache_salt=cache_salt,
            eos_token_ids=eos_token_ids,
            mm_refs=mm_refs,
            lora=lora,
        )
        async for out in self.generate_many([request], admitted=admitted):
            yield out

    async def generate_many(
        self,
        requests: list[EngineRequest],
        *,
        admitted: asyncio.Future | None = None,
        max_buffered_tokens: int | None = None,
    ) -> AsyncGenerator[EngineOutput, None]:
        """Submit several requests as one unit (the sequences of one API request: admitted together or
        refused together) and stream their outputs merged, in arrival order, until all have finished.

        A refusal or a failure of any of them raises `EngineRequestError` (the others are aborted).
        With `max_buffered_tokens` (at least 8 per request, a few steps' worth), a consumer that falls
        further behind than that many tokens gets `EngineRequestError(code="slow_consumer")` instead of
        an ever-growing buffer, and the requests are aborted in the engine.

        Images (`EngineRequest.mm_refs` with pixels) the core should still hold travel as their hash; if
        it no longer does (its "mm_cache_miss" refusal), the requests are sent once more with pixels."""
        if max_buffered_tokens is not None:
            max_buffered_tokens = max(max_buffered_tokens, 8 * len(requests))
        stream = _Stream(max_buffered_tokens)
        self._check_size(requests)
        rids = [r.request_id for r in requests]
        for rid in rids:
            if rid in self.streams:
                raise EngineRequestError(
                    f"request id {rid!r} is already in use", "invalid_request", "request_id"
                )
        for rid in rids:
            self.streams[rid] = stream
        open_ids = set(rids)
        media = self.media if any(r.mm_refs for r in requests) else None
        try:
            await self._send(SubmitRequests(media.prepare(requests) if media is not None else requests))
            while open_ids:
                item = await stream.get()
                if isinstance(item, BaseException):
                    _settle(admitted, item)
                    raise item
                if item.error_code == "mm_cache_miss" and media is not None:
                    media.forget(requests)
                    while not stream.queue.empty():  # the refusals of the other sequences (one batch)
                        stream.queue.get_nowait()
                    await self._send(SubmitRequests(media.prepare(requests)))
                    media = None  # once: that resend carried every image's pixels
                    continue
                if item.finish_reason == "error":
                    open_ids.discard(item.request_id)  # its siblings, if admitted, are aborted below
                    error = EngineRequestError(
                        item.error or "request failed", item.error_code, item.error_param
                    )
                    _settle(admitted, error)
                    raise error
                _settle(admitted)
                if item.finished:
                    open_ids.discard(item.request_id)
                elif not (item.new_token_ids or item.new_prompt_logprobs):
                    continue  # the admission acknowledgement
                yield item
        finally:
            for rid in rids:
                self.streams.pop(rid, None)
            if open_ids and self.dead is None and not stream.overflowed:
                self.sock.send_multipart(self.codec.encode(AbortRequests(sorted(open_ids))))

    def _check_size(self, requests: list[EngineRequest]) -> None:
        """Refuse a submission the core would not take (it disconnects clients that send one)."""
        limit = (self.info_cache.limits if self.info_cache else {}).get("max_submit_bytes")
        if not requests:
            return
        try:
            size = len(msgspec.msgpack.encode(requests[0])) * len(requests)  # the sequences differ little
        except (OverflowError, TypeError, ValueError) as e:
            raise EngineRequestError(
                f"the request cannot be sent to the engine: {e}", "invalid_request"
            ) from None
        if limit is not None and size > limit:
            raise EngineRequestError(
                f"the request is too large for the engine: about {size} bytes encoded, limit {limit} "
                "(--max-submit-bytes)",
                "invalid_request",
            )

    async def abort(self, request_id: str) -> None:
        await self._send(AbortRequests([request_id]))

    async def aclose(self) -> None:
        """Abort what is still streaming, then close."""
        if self.streams and self.dead is None:
            await self.sock.send_multipart(self.codec.encode(AbortRequests(list(self.streams))))
        for task in self._readers:
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        self.close()

    def close(self) -> None:
        """Close the sockets (prefer `await aclose()` inside a running loop)."""
        for task in self._readers:
            task.cancel()
        self.monitor.close(0)
        self.sock.disable_monitor()
        self.sock.close(0)
        self.ctx.term()
