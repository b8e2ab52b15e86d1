"""The OpenAPI 3.1 document the HTTP server serves at `GET /openapi.json`.

Runs in the frontend (built once when the server starts). Request-body schemas are generated from the
msgspec Structs the server decodes with (`openai_protocol.py`), so the document cannot drift from what
is accepted. Response bodies are described by documentation-only Structs below that mirror the dicts
built in `openai_responses.py`; every error response shares one `ErrorResponse` schema. The LoRA
routes are in the document only when the server answers them (--enable-lora-runtime-updates).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from coreproc.text.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)

REF = "#/components/schemas/{name}"

# ----------------------------------------------------------------------------- response shapes (docs only)


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(msgspec.Struct):
    """The body of every 4xx/5xx answer, as OpenAI sends it."""

    error: ErrorDetail


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: dict[str, list[Any]] | None
    finish_reason: str | None


class CompletionResponse(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: dict[str, list[Any]] | None
    finish_reason: str | None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(msgspec.Struct):
    """The served model, or a LoRA adapter of it (`parent`: the served model's id; `root`: its folder)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int | None = None


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class VersionResponse(msgspec.Struct):
    version: str


class LoRAAdapterResponse(msgspec.Struct):
    message: str
    lora_name: str
    lora_path: str | None = None  # (load) the folder, resolved on the server's host
    rank: int | None = None  # (load)


_SCHEMA_TYPES = (
    CompletionRequest,
    ChatCompletionRequest,
    TokenizeRequest,
    DetokenizeRequest,
    ErrorResponse,
    CompletionResponse,
    ChatCompletionResponse,
    ModelList,
    TokenizeResponse,
    DetokenizeResponse,
    VersionResponse,
)
_LORA_SCHEMA_TYPES = (LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, LoRAAdapterResponse)

# Reusable error responses: status -> (component name, description).
ERRORS = {
    400: ("BadRequest", "The request is invalid; `error.param` names the offending field."),
    401: ("Unauthorized", "Missing or wrong bearer token (only when the server runs with --api-key)."),
    404: ("NotFound", "The model named in the request is not served here."),
    413: ("PayloadTooLarge", "The request body is larger than the server accepts."),
    503: ("ServiceUnavailable", "The engine is not running or not ready."),
}

_SSE_DESCRIPTION = (
    "Server-sent events when `stream` is true: one `data: {{chunk}}` line per chunk (the JSON of a "
    "`{obj}` object with deltas), a usage-only chunk when `stream_options.include_usage` is true, "
    "then `data: [DONE]`."
)


# ----------------------------------------------------------------------------- document


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(name=name)}


def _json(schema_name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(schema_name)}}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"$ref": f"#/components/responses/{ERRORS[c][0]}"} for c in codes}


def _operation(
    summary: str,
    responses: dict[str, Any],
    *,
    body: str | None = None,
    secured: bool = False,
    tag: str = "server",
) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "tags": [tag], "responses": responses}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(body)}}}
    if secured:
        op["security"] = [{"bearerAuth": []}]
    return op


def _generation(summary: str, body: str, response: str, chunk_object: str) -> dict[str, Any]:
    ok = {
        "description": "The result; a stream of server-sent events when `stream` is true.",
        "content": {
            "application/json": {"schema": _ref(response)},
            "text/event-stream": {
                "schema": {"type": "string", "description": _SSE_DESCRIPTION.format(obj=chunk_object)}
            },
        },
    }
    responses = {"200": ok, **_errors(400, 401, 404, 413, 503)}
    return _operation(summary, responses, body=body, secured=True, tag="openai")


def _probe(summary: str, ok: str, unavailable: str) -> dict[str, Any]:
    return _operation(summary, {"200": {"description": ok}, "503": {"description": unavailable}})


def _paths() -> dict[str, Any]:
    return {
        "/v1/completions": {
            "post": _generation(
                "Create a text completion", "CompletionRequest", "CompletionResponse", "text_completion"
            )
        },
        "/v1/chat/completions": {
            "post": _generation(
                "Create a chat completion",
                "ChatCompletionRequest",
                "ChatCompletionResponse",
                "chat.completion.chunk",
            )
        },
        "/v1/models": {
            "get": _operation(
                "List the served model and its loaded LoRA adapters",
                {"200": _json("ModelList", "The served model, then one card per adapter."), **_errors(401)},
                secured=True,
                tag="openai",
            )
        },
        "/tokenize": {
            "post": _operation(
                "Tokenize a prompt or chat messages (rendered with the chat template)",
                {"200": _json("TokenizeResponse", "The token ids."), **_errors(400, 404, 413, 503)},
                body="TokenizeRequest",
            )
        },
        "/detokenize": {
            "post": _operation(
                "Turn token ids back into text",
                {"200": _json("DetokenizeResponse", "The text."), **_errors(400, 404, 413, 503)},
                body="DetokenizeRequest",
            )
        },
        "/version": {"get": _operation("Ember's version", {"200": _json("VersionResponse", "The version.")})},
        "/reset_prefix_cache": {
            "post": _operation(
                "Forget every cached prefix block",
                {
                    "200": {
                        "description": "The cache was reset; `dropped_blocks` counts the blocks forgotten.",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    **_errors(401, 503),
                },
                secured=True,
            )
        },
        "/health": {
            "get": _probe(
                "Liveness and progress",
                "The engine is alive and making progress.",
                "Dead or stalled (reason).",
            )
        },
        "/ready": {"get": _probe("Readiness", "The model is loaded and accepts requests.", "Not ready yet.")},
        "/metrics": {
            "get": _operation(
                "Prometheus metrics",
                {
                    "200": {
                        "description": "Metrics in the Prometheus text exposition format.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            )
        },
    }


def _lora_paths() -> dict[str, Any]:
    ok = _json("LoRAAdapterResponse", "Done; the adapter's name is (or is no longer) a model of this server.")
    return {
        "/v1/load_lora_adapter": {
            "post": _operation(
                "Serve a PEFT LoRA folder on the server's host as a model (a name again, with "
                "load_inplace: its new weights for new requests)",
                {"200": ok, **_errors(400, 401, 413, 503)},
                body="LoadLoRAAdapterRequest",
                secured=True,
            )
        },
        "/v1/unload_lora_adapter": {
            "post": _operation(
                "Stop serving a LoRA adapter (requests running with it finish)",
                {"200": ok, **_errors(400, 401, 413, 503)},
                body="UnloadLoRAAdapterRequest",
                secured=True,
            )
        },
    }


def build_openapi(title: str, version: str, *, lora_updates: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the server; schemas generated from the request Structs.
    `lora_updates`: the server answers the LoRA load / unload routes (--enable-lora-runtime-updates)."""
    types = _SCHEMA_TYPES + (_LORA_SCHEMA_TYPES if lora_updates else ())
    _, schemas = msgspec.json.schema_components(types, ref_template=REF)
    responses = {name: _json("ErrorResponse", description) for name, description in ERRORS.values()}
    description = (
        "An OpenAI-compatible LLM inference server. The /v1/* and /reset_prefix_cache endpoints accept "
        "a bearer token "
        "(`Authorization: Bearer <key>`), enforced only when the server is started with --api-key; "
        "/tokenize, /detokenize, /version, /health, /ready and /metrics are always open."
    )
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": description},
        "paths": {**_paths(), **(_lora_paths() if lora_updates else {})},
        "components": {
            "schemas": dict(sorted(schemas.items())),
            "responses": responses,
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "The --api-key given to the server; not checked when none was given.",
                }
            },
        },
    }
