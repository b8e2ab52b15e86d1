"""The HTTP frontend's middleware and error pages: body size limit (413), API key (401), CORS.

Runs in the frontend process, in front of the routes of `frontend/http/server.py`. Every refusal here,
and every 404, 405 and unhandled error, answers with an OpenAI-shaped body:
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import hashlib
import hmac
import logging

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coreproc.text.openai_protocol import RequestError
from frontend.http.completions import error_response
from frontend.http.settings import ServerConfig

log = logging.getLogger("ember.server")


class BodyLimit:
    """413 for bodies over the limit, whether announced by Content-Length or streamed in chunks."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._reject(scope, receive, send)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.limit:
                raise _TooLarge
            return msg

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._reject(scope, receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = RequestError(f"request body exceeds {self.limit} bytes", status=413, code="request_too_large")
        await error_response(err)(scope, receive, send)


class _TooLarge(Exception):
    pass


PROTECTED = ("/v1", "/reset_prefix_cache")  # paths that need the API key (when one is set)


class ApiKey:
    """Requires `Authorization: Bearer <key>` (any of the keys) on /v1 routes and admin routes. The token
    is hashed once and its digest compared with every key's, without stopping at a match: the time
    taken tells neither which key matched nor how much of one."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        assert keys, "ApiKey needs at least one key"
        self.app = app
        self.digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def allows(self, token: bytes) -> bool:
        digest = hashlib.sha256(token).digest()
        matched = 0
        for key in self.digests:
            matched |= hmac.compare_digest(digest, key)
        return bool(matched)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if not self.allows(token.strip()) or scheme.lower() != b"bearer":
                err = RequestError("invalid or missing API key", status=401, err_type="authentication_error")
                return await error_response(err)(scope, receive, send)
        await self.app(scope, receive, send)


def middleware(cfg: ServerConfig) -> list[Middleware]:
    """CORS (when origins are allowed) outermost, then the body limit, then the API key (when set)."""
    stack = [Middleware(BodyLimit, limit=cfg.max_request_bytes)]
    if cfg.api_key:
        stack.append(Middleware(ApiKey, keys=cfg.api_key))
    if cfg.allowed_origins:
        cors = Middleware(
            CORSMiddleware, allow_origins=list(cfg.allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )
        stack.insert(0, cors)
    return stack


async def internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    err = RequestError(f"internal error: {type(exc).__name__}", status=500, err_type="internal_error")
    return error_response(err)


async def not_found(request: Request, exc: Exception) -> Response:
    err = RequestError(f"no route {request.url.path}", status=404, err_type="not_found_error")
    return error_response(err)


async def not_allowed(request: Request, exc: Exception) -> Response:
    err = RequestError(f"{request.method} is not allowed on {request.url.path}", status=405)
    return error_response(err)


EXCEPTION_HANDLERS = {Exception: internal_error, 404: not_found, 405: not_allowed}
