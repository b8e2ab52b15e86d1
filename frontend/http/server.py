"""The OpenAI-compatible HTTP server: a Starlette app under uvicorn + uvloop (`ember serve`).

Runs in the frontend process; the engine runs in `ember-core` children (one per data-parallel rank, each
with its workers), reached through the same `DPEngineClient` as the SDK, which routes each request to
one core. /health and /metrics cover every core (`engine` label: the core's rank). Routes:
/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /version, /health (alive
*and* making progress), /ready, /metrics (Prometheus) and /openapi.json; with
--enable-lora-runtime-updates also /v1/load_lora_adapter and /v1/unload_lora_adapter (without it they do
not exist: 404). A request's model is the served model or a loaded LoRA adapter (the frontend's list,
from the core's info and the results of those two routes). The middleware (body size limit, API key,
CORS) and the error pages are in `frontend/http/middleware.py`; every error body is OpenAI-shaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from coreproc.base.host import engine_version
from coreproc.base.limits import RequestLimits
from coreproc.base.protocol import SchedulerStats
from coreproc.client.sdk import EngineDeadError, EngineRequestError, connect_engines
from coreproc.text.media import MediaIntake
from coreproc.text.openai_protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    RequestError,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    check_messages,
    parse_body,
    parse_chat_request,
    parse_completion_request,
)
from frontend.http.completions import (
    ServingContext,
    engine_dead_error,
    error_response,
    render,
    serve_generation,
)
from frontend.http.metrics import EngineMetrics
from frontend.http.middleware import EXCEPTION_HANDLERS, middleware
from frontend.http.settings import ServerConfig

if TYPE_CHECKING:
    from coreproc.base.tokenizer import Tokenizer

log = logging.getLogger("ember.server")

STATS_INTERVAL_S = 1.0


class Api:
    """Route handlers over one `ServingContext` (created when the app starts)."""

    def __init__(
        self,
        addresses: list[str],
        model_dir: str,
        cfg: ServerConfig,
        tokenizer: Tokenizer | None = None,
        api_server: int = 0,
    ) -> None:
        self.addresses, self.model_dir, self.cfg = addresses, model_dir, cfg
        self.api_server = api_server  # this process's index among `--api-server-count` servers
        self.tokenizer = tokenizer
        self.model_name = cfg.served_model_name or Path(model_dir).name
        self.accepted = {self.model_name, model_dir, str(Path(model_dir).resolve())}
        self.ctx: ServingContext | None = None
        self.stats: dict[int, SchedulerStats | str] = {}  # each core's (or why it is gone), every second
        self.stats_at = 0.0
        self.warm_media = True  # a server parked for a snapshot starts its image processes after restore

    # ------------------------------------------------------------------ lifecycle

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette):
        from coreproc.base.tokenizer import load_tokenizer

        client = await connect_engines(self.addresses)
        template = self.cfg.chat_template
        if template is not None and Path(template).is_file():
            template = Path(template).read_text()
        info = client.info_cache
        assert info is not None, "connect() fetches the engine's info"
        media = None
        if info.image_token_id is not None:  # a multimodal model: its image processes start now
            media = MediaIntake.from_model(info.model, info.image_token_id, self.cfg.media)
            if self.warm_media:
                media.warm()
        loras = dict(info.loras)
        for name in sorted(self.accepted & set(loras)):
            log.warning(
                "LoRA adapter %r has the served model's name: requests naming it get the base model", name
            )
        self.ctx = ServingContext(
            client=client,
            tokenizer=self.tokenizer or load_tokenizer(info.model),
            info=info,
            model_name=self.model_name,
            metrics=EngineMetrics(self.model_name, api_server=self.api_server),
            chat_template=template,
            limits=RequestLimits.of(info.limits or None),
            max_stream_buffer_tokens=self.cfg.max_stream_buffer_tokens,
            stream_send_timeout=self.cfg.stream_send_timeout,
            features=self.cfg.features,
            fields=self.cfg.features.fields(),
            media_config=self.cfg.media,
            media=media,
            loras=loras,
        )
        poller = asyncio.create_task(self._poll_engine())
        try:
            yield
        finally:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
            await client.aclose()
            if media is not None:
                await asyncio.to_thread(media.close)

    async def _poll_engine(self) -> None:
        """Refresh every core's stats (health, gauges, routing) every second; notice dead cores."""
        ctx = self.ctx
        while ctx.dead is None:
            try:
                self.stats = await ctx.client.stats_by_rank(timeout=5.0)
                self.stats_at = time.monotonic()
                for rank, stats in self.stats.items():
                    if isinstance(stats, SchedulerStats) and self.api_server == 0:  # once, not per server
                        ctx.metrics.update_engine(stats, rank)
                ctx.metrics.update_routed([e.routed for e in ctx.client.router.engines])
                ctx.metrics.update_open(sum(len(c.streams) for c in ctx.client.clients))
            except EngineDeadError:
                pass
            ctx.dead = ctx.client.dead  # every core gone
            await asyncio.sleep(STATS_INTERVAL_S)

    # ------------------------------------------------------------------ helpers

    def _check_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's model names (None: the served model); 404 for any other."""
        if model is None or model in self.accepted:
            return None
        if self.ctx is not None and model in self.ctx.loras:
            return model
        adapters = " and LoRA adapters (GET /v1/models lists them)" if self.ctx and self.ctx.loras else ""
        raise RequestError(
            f"the model {model!r} does not exist; this server serves {self.model_name!r}{adapters}",
            param="model",
            code="model_not_found",
            status=404,
            err_type="NotFoundError",
        )

    def _available(self) -> None:
        if self.ctx is None or self.ctx.dead is not None or self.ctx.client.dead is not None:
            reason = (self.ctx and (self.ctx.dead or self.ctx.client.dead)) or "starting"
            raise engine_dead_error(reason)

    # ------------------------------------------------------------------ routes

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            body = await request.body()
            limits = self.ctx.limits if self.ctx is not None else None
            fields = self.ctx.fields if self.ctx is not None else None
            parse = parse_chat_request if chat else parse_completion_request
            req = parse(body, limits, fields)
            lora = self._check_model(req.model)
            self._available()
            prompts = await render(self.ctx, req)
            return await serve_generation(self.ctx, request, req, prompts, lora)
        except RequestError as e:
            if self.ctx is not None:
                self.ctx.metrics.request_rejected(e.status)
            return error_response(e)

    async def models(self, request: Request) -> Response:
        """The served model, then one card per LoRA adapter (its `parent` the served model)."""
        info = self.ctx.info if self.ctx else None
        loras = self.ctx.loras if self.ctx else {}
        models = [(self.model_name, self.model_dir, None)]
        models += [(name, path, self.model_name) for name, path in loras.items() if name not in self.accepted]
        cards = []
        for name, root, parent in models:
            card = {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "ember",
                "root": root,
                "parent": parent,
            }
            if info is not None:
                card["max_model_len"] = info.max_model_len
            cards.append(card)
        return JSONResponse({"object": "list", "data": cards})

    async def load_lora_adapter(self, request: Request) -> Response:
        """Serve a PEFT LoRA folder (on this host) as a model (--enable-lora-runtime-updates)."""

        async def load(ctx: ServingContext, req: LoadLoRAAdapterRequest) -> dict[str, Any]:
            name = req.lora_name
            if not ctx.info.lora_enabled:
                raise RequestError("LoRA is not enabled in this engine (start it with --enable-lora)")
            if name in self.accepted:
                raise RequestError(f"{name!r} is the served model's name, not an adapter's", "lora_name")
            if name in ctx.loras and not req.load_inplace:
                message = f"a LoRA adapter named {name!r} is already loaded (load_inplace: true replaces it)"
                raise RequestError(message, "lora_name")
            loaded = await ctx.client.load_lora(name, req.lora_path)
            ctx.loras[name] = loaded["lora_path"]
            return {"message": f"LoRA adapter {name!r} loaded from {loaded['lora_path']}", **loaded}

        return await self._update_loras(request, LoadLoRAAdapterRequest, load, None)

    async def unload_lora_adapter(self, request: Request) -> Response:
        """Stop serving an adapter; requests running with it finish (--enable-lora-runtime-updates)."""

        async def unload(ctx: ServingContext, req: UnloadLoRAAdapterRequest) -> dict[str, Any]:
            try:
                await ctx.client.unload_lora(req.lora_name)
            finally:  # whatever the core answers (unloaded, never there), no new request names it
                ctx.loras.pop(req.lora_name, None)
            return {"message": f"LoRA adapter {req.lora_name!r} unloaded", "lora_name": req.lora_name}

        return await self._update_loras(request, UnloadLoRAAdapterRequest, unload, "lora_name")

    async def _update_loras(
        self,
        request: Request,
        typ: type,
        update: Callable[[ServingContext, Any], Awaitable[dict]],
        param: str | None,
    ) -> Response:
        """Parse the body, run `update` against the core, answer its message; the core's refusals
        (missing folder, rank, targets, slots, unknown name) are 400s naming `param`."""
        try:
            req = parse_body(await request.body(), typ, self.ctx.fields if self.ctx else None)
            self._available()
            answer = await update(self.ctx, req)
        except RequestError as e:
            return error_response(e)
        except EngineRequestError as e:
            return error_response(RequestError(str(e), param, code="invalid_lora_adapter"))
        except EngineDeadError as e:
            return error_response(engine_dead_error(str(e)))
        log.info("%s", answer["message"])
        return JSONResponse(answer)

    async def tokenize(self, request: Request) -> Response:
        try:
            req = parse_body(await request.body(), TokenizeRequest, self.ctx.fields if self.ctx else None)
            self._check_model(req.model)
            self._available()
            ctx = self.ctx
            if req.messages is not None:
                check_messages(req.messages, ctx.limits)
                chat = ChatCompletionRequest(
                    messages=req.messages,
                    add_generation_prompt=req.add_generation_prompt,
                    tools=req.tools,
                    chat_template_kwargs=req.chat_template_kwargs,
                )
                ids = (await render(ctx, chat))[0].ids  # images expanded into their placeholders
            elif req.prompt is not None:
                ids = ctx.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
            else:
                raise RequestError("give either prompt or messages", param="prompt")
            return JSONResponse({"count": len(ids), "max_model_len": ctx.info.max_model_len, "tokens": ids})
        except RequestError as e:
            return error_response(e)

    async def detokenize(self, request: Request) -> Response:
        try:
            req = parse_body(await request.body(), DetokenizeRequest)
            self._check_model(req.model)
            self._available()
            vocab = self.ctx.info.vocab_size
            if any(t < 0 or t >= vocab for t in req.tokens):
                raise RequestError(f"token ids must be in [0, {vocab})", param="tokens")
            return JSONResponse({"prompt": self.ctx.tokenizer.decode(req.tokens)})
        except RequestError as e:
            return error_response(e)

    async def reset_prefix_cache(self, request: Request) -> Response:
        """Forget every cached prefix block (e.g. after changing what prompts mean); work continues."""
        try:
            self._available()
            dropped = await self.ctx.client.reset_prefix_cache()
        except RequestError as e:
            return error_response(e)
        except EngineDeadError as e:
            return error_response(engine_dead_error(str(e)))
        log.info("prefix cache reset: %d cached blocks dropped", dropped)
        return JSONResponse({"reset": True, "dropped_blocks": dropped})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": engine_version()})

    async def health(self, request: Request) -> Response:
        problem = self._health_problem()
        if problem is not None:
            return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
        return JSONResponse({"status": "ok"})

    def _health_problem(self) -> str | None:
        ctx = self.ctx
        if ctx is None:
            return "starting"
        if ctx.dead is not None or ctx.client.dead is not None:
            return f"engine dead: {ctx.dead or ctx.client.dead}"
        dead = ctx.client.dead_ranks()  # some cores gone: the others serve, but say so
        if dead:
            return "; ".join(f"engine core {r} dead: {why}" for r, why in sorted(dead.items()))
        age = time.monotonic() - self.stats_at
        if age > 5 * STATS_INTERVAL_S + 5.0:
            return f"engine has not answered for {age:.0f}s"
        stalled = [
            (r, s.stalled) for r, s in self.stats.items() if isinstance(s, SchedulerStats) and s.stalled
        ]
        if not stalled:
            return None
        if ctx.client.size == 1:
            return stalled[0][1]  # the core's watchdog (`--stall-timeout`)
        return "; ".join(f"engine core {r}: {why}" for r, why in stalled)

    async def ready(self, request: Request) -> Response:
        if self.ctx is None or self.ctx.dead is not None or self.ctx.client.dead is not None:
            return JSONResponse({"ready": False}, status_code=503)
        return JSONResponse({"ready": True, "model": self.model_name})

    async def metrics(self, request: Request) -> Response:
        if self.ctx is None:
            return Response(b"", media_type="text/plain")
        body, content_type = self.ctx.metrics.render()
        return Response(body, media_type=content_type)

    async def openapi(self, request: Request) -> Response:
        from frontend.http.openapi import build_openapi

        return JSONResponse(
            build_openapi("Ember", engine_version(), lora_updates=self.cfg.enable_lora_runtime_updates)
        )


def build_app(
    addresses: list[str],
    model_dir: str,
    cfg: ServerConfig,
    tokenizer: Tokenizer | None = None,
    api_server: int = 0,
) -> Starlette:
    """The ASGI app for the engine cores listening at `addresses` (one per data-parallel rank; the
    tokenizer loads at start-up unless given); `api_server`: which of `--api-server-count` this is."""
    api = Api(addresses, model_dir, cfg, tokenizer, api_server)
    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/version", api.version, methods=["GET"]),
        Route("/reset_prefix_cache", api.reset_prefix_cache, methods=["POST"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/ready", api.ready, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/openapi.json", api.openapi, methods=["GET"]),
    ]
    if cfg.enable_lora_runtime_updates:  # without the flag these routes do not exist (404)
        routes += [
            Route("/v1/load_lora_adapter", api.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", api.unload_lora_adapter, methods=["POST"]),
        ]
    app = Starlette(
        routes=routes,
        middleware=middleware(cfg),
        lifespan=api.lifespan,
        exception_handlers=EXCEPTION_HANDLERS,
    )
    app.state.api = api
    return app
