"""Runs one OpenAI completion or chat request against the engine core and answers it.

Runs in the HTTP server process (uvloop). A request's prompts x n sequences are submitted through the
engine client the SDK uses (`DPEngineClient`, which picks the core); their outputs are merged,
detokenized and checked for stop strings by a per-request `OutputProcessor`, then sent as one JSON body
or as SSE chunks (`data: {...}`, `data: [DONE]`). Leaving early (client disconnect, error) cancels the
streams, which aborts the requests in the core. A request's sequences are submitted as one unit and
admitted together before a stream starts, so refusals get their status code (400 invalid or never
fitting, 503 queue full or shutting down); an engine that dies later becomes a 503 or an SSE error
event. A stream whose reader falls too far behind (`--max-stream-buffer-tokens`) or takes no data for
`--stream-send-timeout` seconds is aborted, never buffered without bound. A chat's images are taken in
(`render`: fetched on threads, decoded and processed in the `ember-media` processes) before its
sequences are built; only the first sequence of a prompt carries their pixels. A request whose model is
a LoRA adapter's name runs every sequence with it, and its responses name the adapter.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message, Send

from coreproc.base.limits import RequestLimits
from coreproc.base.protocol import (
    EngineInfo,
    EngineOutput,
    EngineRequest,
    FinishReason,
    LoRARef,
    SamplingParams,
)
from coreproc.client.dp_client import DPEngineClient
from coreproc.client.sdk import EngineDeadError, EngineRequestError
from coreproc.text.chat_features import ChatFeatures
from coreproc.text.media import MediaIntake
from coreproc.text.media_config import MediaConfig
from coreproc.text.openai_fields import FieldPolicy
from coreproc.text.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    to_sampling_params,
)
from coreproc.text.output_processor import OutputProcessor, SequenceDelta
from coreproc.text.render import Prompt, render_prompts, response_body, take_images_async
from frontend.http.metrics import EngineMetrics, RequestTimer
from frontend.http.sse_chunks import ChunkWriter, sse

log = logging.getLogger("ember.server")


@dataclass
class ServingContext:
    """What every request handler needs; built once when the server starts."""

    client: DPEngineClient  # one engine core, or several (data parallelism)
    tokenizer: Any
    info: EngineInfo
    model_name: str
    metrics: EngineMetrics
    chat_template: str | None = None
    dead: str | None = None  # why the engine is gone, once it is
    limits: RequestLimits = field(default_factory=RequestLimits)  # the core's, from its info
    max_stream_buffer_tokens: int | None = None  # a stream's unread tokens before it is aborted
    stream_send_timeout: float | None = None  # seconds a client may take to accept one SSE chunk
    features: ChatFeatures = field(default_factory=ChatFeatures)  # tools, reasoning, unknown fields
    fields: FieldPolicy = field(default_factory=FieldPolicy)
    media_config: MediaConfig = field(default_factory=MediaConfig)  # the `media` flags
    media: MediaIntake | None = None  # image input (a multimodal model only)
    loras: dict[str, str] = field(default_factory=dict)  # the adapters served: name -> folder

    def decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=True)


async def render(ctx: ServingContext, req: CompletionRequest | ChatCompletionRequest) -> list[Prompt]:
    """A request's prompts, a chat's images taken in (fetched on threads, processed in the image
    processes) with its effective image kwargs (its own refused unless the server trusts them)."""
    if not isinstance(req, ChatCompletionRequest):
        return render_prompts(req, ctx.tokenizer, ctx.info.vocab_size)
    media_kwargs = ctx.media_config.request_kwargs(req.mm_processor_kwargs, req.media_io_kwargs)
    kwargs = ctx.features.template_kwargs(req)
    prompts = render_prompts(
        req, ctx.tokenizer, ctx.info.vocab_size, ctx.chat_template, kwargs, ctx.media is not None
    )
    return [await take_images_async(p, ctx.media, media_kwargs) for p in prompts]


def error_response(err: RequestError) -> JSONResponse:
    return JSONResponse(err.error_body(), status_code=err.status)


def engine_dead_error(reason: str) -> RequestError:
    return RequestError(f"the engine is not available: {reason}", status=503, err_type="service_unavailable")


def refusal_error(e: EngineRequestError | EngineDeadError) -> RequestError:
    """The HTTP error for a request the engine refused or failed (`e.code` says which), or for an
    engine that died."""
    if isinstance(e, EngineDeadError):
        return engine_dead_error(str(e))
    if e.code in ("overloaded", "unavailable"):
        return RequestError(str(e), status=503, err_type="service_unavailable")
    if e.code == "invalid_request":
        return RequestError(str(e), e.param)
    if e.code == "slow_consumer":
        return RequestError(str(e), code="slow_consumer", status=408, err_type="timeout_error")
    return RequestError(str(e), status=500, err_type="internal_error")


@dataclass
class Generation:
    """One API request in flight: its sequences in the engine and the merged output stream.

    The sequences are submitted as one unit and admitted together; nothing per sequence is tracked
    (detokenizers, outputs) before the engine has admitted them all. One task pulls the merged
    outputs into a one-slot queue, so a slow reader backs up into the client's bounded buffer."""

    ctx: ServingContext
    req: CompletionRequest | ChatCompletionRequest
    prompts: list[Prompt]
    params: list[SamplingParams]
    lora: str | None = None  # the adapter every sequence runs with (None: the base model)
    hexid: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    timer: RequestTimer | None = None

    def __post_init__(self) -> None:
        self.processor = OutputProcessor(self.ctx.tokenizer)
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=1)
        self.rids: list[str] = []
        self.generated = 0  # tokens produced so far, all sequences
        self.task: asyncio.Task | None = None
        self._built: list[tuple[str, str | None, list[int], list[EngineRequest]]] = []
        self._registered = False

    @property
    def model_name(self) -> str:
        """The model its responses name: the adapter, or the served model."""
        return self.lora or self.ctx.model_name

    @property
    def num_sequences(self) -> int:
        return sum(p.n for p in self.params)

    def start(self, max_buffered_tokens: int | None = None) -> None:
        """Submit every sequence as one unit; `max_buffered_tokens` bounds what a slow reader may
        leave unread before the request is aborted."""
        self.timer = self.ctx.metrics.request_started()
        req = self.req
        lora = None if self.lora is None else LoRARef(self.lora, "")
        for k, (prompt, params) in enumerate(zip(self.prompts, self.params)):
            rid = f"{self.hexid}-{k}"
            self.rids.append(rid)
            ers = self.processor.engine_requests(
                rid,
                prompt.ids,
                params,
                priority=req.priority,
                cache_salt=req.cache_salt,
                mm_refs=prompt.mm_refs,
                lora=lora,
            )
            self._built.append((rid, prompt.text, prompt.ids, ers))
        self.admitted = asyncio.get_running_loop().create_future()
        requests = [er for *_, ers in self._built for er in ers]
        self.task = asyncio.create_task(self._pump(requests, max_buffered_tokens))

    async def _pump(self, requests: list[EngineRequest], max_buffered_tokens: int | None) -> None:
        outputs = self.ctx.client.generate_many(
            requests, admitted=self.admitted, max_buffered_tokens=max_buffered_tokens
        )
        try:
            async for out in outputs:
                await self.queue.put(out)
        except Exception as e:  # EngineDeadError, EngineRequestError: surfaced by `deltas`
            if not self.admitted.done():
                self.admitted.set_exception(e)
            await self.queue.put(e)
        finally:  # cancelled while waiting for the reader: abort what still runs, now
            await outputs.aclose()

    async def wait_admitted(self) -> None:
        """Return once the engine accepted every sequence (then track them); raise the refusal."""
        await asyncio.shield(self.admitted)
        if not self._registered:
            self._registered = True
            first_choice = 0
            for rid, text, ids, ers in self._built:
                self.processor.register(rid, text, ids, ers, first_choice)
                first_choice += len(ers)

    async def deltas(self) -> AsyncIterator[SequenceDelta]:
        """Sequence deltas as they come; ends when every sequence has finished."""
        await self.wait_admitted()  # raises the refusal
        remaining = self.num_sequences
        while remaining:
            item = await self.queue.get()
            if isinstance(item, Exception):
                raise item
            out: EngineOutput = item
            deltas, to_abort = self.processor.process([out])
            for eid in to_abort:
                await self.ctx.client.abort(eid)
            for d in deltas:
                if d.token_ids:
                    self.generated += len(d.token_ids)
                    self.timer.tokens(len(d.token_ids))
                if d.finish_reason is not None:
                    remaining -= 1
                yield d

    def results(self) -> list:
        return [self.processor.pop_finished(rid) for rid in self.rids]

    async def close(self, finish_reason: FinishReason) -> None:
        """Cancel what still runs (aborting it in the engine) and record the request's metrics.

        Everything but the final wait is synchronous: under a cancelled scope (a client that hung up)
        the await may be interrupted, and the aborts and metrics must happen anyway.
        """
        if self.task is not None:
            self.task.cancel()
        if self.admitted.done() and not self.admitted.cancelled():
            self.admitted.exception()  # nobody else may look at it
        if self.timer is not None:
            prompt_tokens = sum(len(p.ids) for p in self.prompts)
            generated = sum(
                len(s.output.token_ids) for p in self.processor.parents.values() for s in p.sequences
            )
            self.timer.finish(finish_reason, prompt_tokens, generated)
            self.timer = None
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)


async def _fail(gen: Generation, e: EngineDeadError | EngineRequestError) -> JSONResponse:
    """The error response for a request the engine refused (counted as rejected, by status) or
    failed (counted as finished with an error)."""
    err = refusal_error(e)
    if isinstance(e, EngineRequestError) and e.code is not None:
        gen.ctx.metrics.request_rejected(err.status)
        gen.timer = None
    await gen.close("error")
    return error_response(err)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def respond(gen: Generation, request: Request) -> Response:
    """A non-streaming response; a client that hangs up cancels the work."""

    async def consume() -> None:
        async for _ in gen.deltas():
            pass

    work = asyncio.ensure_future(consume())
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            work.cancel()
            await gen.close("abort")
            return Response(status_code=499)
        work.result()
    except (EngineDeadError, EngineRequestError) as e:
        return await _fail(gen, e)
    finally:
        watch.cancel()
    results = gen.results()
    reasons = [o.finish_reason for r in results for o in r.outputs]
    await gen.close("error" if "error" in reasons else reasons[0] or "stop")
    ctx = gen.ctx
    body = response_body(
        gen.req, results, gen.model_name, gen.created, gen.hexid, ctx.decode, ctx.features, ctx.tokenizer
    )
    return JSONResponse(body)


async def stream(gen: Generation) -> AsyncIterator[bytes]:
    """SSE chunks for a streaming request (completion or chat: frontend/http/sse_chunks.py), then
    `data: [DONE]`; an engine that fails mid-stream is an error event."""
    chunks = ChunkWriter(gen)
    reason: FinishReason = "abort"
    try:
        for chunk in chunks.opening():
            yield chunk
        async for d in gen.deltas():
            for chunk in chunks.delta(d):
                yield chunk
        reason = "stop"
        usage = chunks.usage()
        if usage is not None:
            yield usage
    except (EngineDeadError, EngineRequestError) as e:
        reason = "error"
        yield sse(refusal_error(e).error_body())
    finally:
        await gen.close(reason)
    yield b"data: [DONE]\n\n"


class BoundedStream(StreamingResponse):
    """An SSE response whose every chunk must be taken by the client within `send_timeout` seconds;
    a client that stops reading is cut off (its generation is aborted) instead of holding the
    response, and the connection, forever."""

    def __init__(self, content: AsyncIterator[bytes], send_timeout: float | None) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.send_timeout = send_timeout

    async def stream_response(self, send: Send) -> None:
        async def timed(message: Message) -> None:
            await asyncio.wait_for(send(message), self.send_timeout)

        try:
            await super().stream_response(timed)
        except asyncio.TimeoutError:
            log.warning("a streaming client took no data for %ss: closing its stream", self.send_timeout)
        finally:
            await self.body_iterator.aclose()


async def serve_generation(
    ctx: ServingContext,
    request: Request,
    req: CompletionRequest | ChatCompletionRequest,
    prompts: list[Prompt],
    lora: str | None = None,
) -> Response:
    """Validate sampling against the context and the limits, submit as one unit (with adapter `lora`,
    if named), and answer (JSON or SSE)."""
    limit = ctx.info.max_model_len
    constraint = ctx.features.constraint
    params = [
        to_sampling_params(req, len(p.ids), limit, constraint(req, ctx.tokenizer, p.ids)) for p in prompts
    ]
    gen = Generation(ctx, req, prompts, params, lora)
    if req.stream:
        gen.start(ctx.max_stream_buffer_tokens)
        try:
            await gen.wait_admitted()
        except (EngineDeadError, EngineRequestError) as e:
            return await _fail(gen, e)
        return BoundedStream(stream(gen), ctx.stream_send_timeout)
    gen.start()
    return await respond(gen, request)
