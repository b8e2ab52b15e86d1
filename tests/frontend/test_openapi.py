"""The OpenAPI document: its shape, its paths, and that its request schemas match the real parsers.

Pure Python. Bodies are generated from the schema and fed to the server's own parsers, so a field the
document calls required (or optional) must be required (or optional) in `openai_protocol.py` too.
Run: `pytest -q tests/frontend/test_openapi.py`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from coreproc.text.openai_protocol import (
    DetokenizeRequest,
    RequestError,
    TokenizeRequest,
    parse_body,
    parse_chat_request,
    parse_completion_request,
)
from frontend.http.openapi import build_openapi

pytestmark = pytest.mark.unit

ROUTES = {
    "/v1/completions": {"post"},
    "/v1/chat/completions": {"post"},
    "/v1/models": {"get"},
    "/tokenize": {"post"},
    "/detokenize": {"post"},
    "/version": {"get"},
    "/health": {"get"},
    "/ready": {"get"},
    "/metrics": {"get"},
    "/reset_prefix_cache": {"post"},
}
SECURED = ("/v1/", "/reset_prefix_cache")
PARSERS: dict[str, Callable[[Any], Any]] = {
    "CompletionRequest": parse_completion_request,
    "ChatCompletionRequest": parse_chat_request,
    "TokenizeRequest": lambda body: parse_body(body, TokenizeRequest),
    "DetokenizeRequest": lambda body: parse_body(body, DetokenizeRequest),
}


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return build_openapi("Ember", "0.1.0")


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if "$ref" in node else []
        return own + [r for v in node.values() for r in refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in refs(v)]
    return []


def sample(doc: dict[str, Any], schema: dict[str, Any], *, all_fields: bool) -> Any:
    """A value the schema accepts: required properties (or all, at their defaults) filled in."""
    if "$ref" in schema:
        return sample(doc, resolve(doc, schema["$ref"]), all_fields=all_fields)
    if "anyOf" in schema:
        options = [s for s in schema["anyOf"] if s.get("type") != "null"]
        return sample(doc, options[0], all_fields=all_fields)
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        body = {}
        for name, prop in schema.get("properties", {}).items():
            if "default" in prop and all_fields:
                body[name] = prop["default"]
            elif name in schema.get("required", ()):
                body[name] = sample(doc, prop, all_fields=all_fields)
        return body
    if kind == "array":
        return [sample(doc, schema["items"], all_fields=all_fields)] if "items" in schema else []
    return {"string": "hi", "integer": 3, "number": 0.5, "boolean": True}[kind]


def request_schema(doc: dict[str, Any], path: str) -> dict[str, Any]:
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return resolve(doc, ref)


def test_document_is_openapi_31(doc: dict[str, Any]) -> None:
    assert doc["openapi"].startswith("3.1")
    assert doc["info"]["title"] == "Ember" and doc["info"]["version"] == "0.1.0"
    assert "--api-key" in doc["info"]["description"]
    assert set(doc["components"]) >= {"schemas", "responses", "securitySchemes"}
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": doc["components"]["securitySchemes"]["bearerAuth"]["description"],
    }
    json.dumps(doc)  # served as JSON: must serialize as is
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert op["responses"] and all(code.isdigit() for code in op["responses"]), (path, method)


def test_every_route_with_its_methods(doc: dict[str, Any]) -> None:
    assert {path: set(item) for path, item in doc["paths"].items()} == ROUTES


def test_bearer_auth_on_v1_and_admin_paths_only(doc: dict[str, Any]) -> None:
    for path, item in doc["paths"].items():
        for op in item.values():
            secured = op.get("security") == [{"bearerAuth": []}]
            assert secured == path.startswith(SECURED), path
            assert ("401" in op["responses"]) == path.startswith(SECURED), path


def test_generation_endpoints_answer_json_or_event_stream(doc: dict[str, Any]) -> None:
    for path, response in (
        ("/v1/completions", "CompletionResponse"),
        ("/v1/chat/completions", "ChatCompletionResponse"),
    ):
        op = doc["paths"][path]["post"]
        content = op["responses"]["200"]["content"]
        assert content["application/json"]["schema"] == {"$ref": f"#/components/schemas/{response}"}
        assert "[DONE]" in content["text/event-stream"]["schema"]["description"]
        assert op["requestBody"]["required"] is True
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    for probe in ("/health", "/ready"):
        assert set(doc["paths"][probe]["get"]["responses"]) == {"200", "503"}


def test_errors_share_one_error_response_schema(doc: dict[str, Any]) -> None:
    seen = set()
    for item in doc["paths"].values():
        for op in item.values():
            for code, response in op["responses"].items():
                if code in ("400", "401", "404", "413") or (code == "503" and "$ref" in response):
                    schema = resolve(doc, response["$ref"])["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
                    seen.add(code)
    assert seen == {"400", "401", "404", "413", "503"}
    error = resolve(doc, "#/components/schemas/ErrorResponse")
    detail = resolve(doc, error["properties"]["error"]["$ref"])
    assert set(detail["properties"]) == {"message", "type", "param", "code"}
    code_types = {s["type"] for s in detail["properties"]["code"]["anyOf"]}
    assert code_types == {"string", "integer", "null"}
    # The server's real error body fits the documented shape.
    body = RequestError("bad", "prompt").error_body()
    assert set(body) == set(error["properties"]) and set(body["error"]) == set(detail["properties"])


def test_every_ref_resolves(doc: dict[str, Any]) -> None:
    all_refs = refs(doc)
    assert len(all_refs) > 20
    for ref in all_refs:
        assert isinstance(resolve(doc, ref), dict), ref


def test_request_schemas_carry_the_real_fields(doc: dict[str, Any]) -> None:
    completion = request_schema(doc, "/v1/completions")
    want = {"prompt", "max_tokens", "logprobs", "echo", "stream", "stream_options", "cache_salt", "priority"}
    assert want <= set(completion["properties"])
    assert completion["required"] == ["prompt"]
    assert completion["properties"]["max_tokens"]["default"] == 16
    chat = request_schema(doc, "/v1/chat/completions")
    assert {"messages", "max_completion_tokens", "top_logprobs", "logprobs"} <= set(chat["properties"])
    assert chat["required"] == ["messages"]
    message = resolve(doc, chat["properties"]["messages"]["items"]["$ref"])
    assert set(message["properties"]["role"]["enum"]) == {"system", "developer", "user", "assistant", "tool"}
    assert {"tools", "tool_choice", "response_format", "structured_outputs"} <= set(chat["properties"])
    assert {"response_format", "structured_outputs"} <= set(completion["properties"])
    assert set(request_schema(doc, "/tokenize")["properties"]) >= {"prompt", "messages"}
    assert request_schema(doc, "/detokenize")["required"] == ["tokens"]
    tokenize = doc["paths"]["/tokenize"]["post"]["responses"]["200"]["content"]["application/json"]
    assert set(resolve(doc, tokenize["schema"]["$ref"])["properties"]) == {"count", "max_model_len", "tokens"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_bodies_the_schema_accepts_are_parsed(doc: dict[str, Any], path: str) -> None:
    schema = request_schema(doc, path)
    parse = PARSERS[schema["title"]]
    minimal = sample(doc, schema, all_fields=False)
    assert set(minimal) == set(schema.get("required", ()))
    parse(minimal)
    parse(json.dumps(minimal).encode())
    full = sample(doc, schema, all_fields=True)
    assert set(full) == set(schema["properties"])  # every documented field is a field the parser takes
    req = parse(full)
    for name, prop in schema["properties"].items():
        if "default" in prop:
            assert getattr(req, name) == prop["default"], name


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/detokenize"])
def test_fields_required_by_the_schema_are_required_by_the_parser(doc: dict[str, Any], path: str) -> None:
    schema = request_schema(doc, path)
    parse = PARSERS[schema["title"]]
    assert schema["required"]
    for name in schema["required"]:
        body = sample(doc, schema, all_fields=True)
        del body[name]
        with pytest.raises(RequestError) as err:
            parse(body)
        assert err.value.param == name


def test_sample_body_validates_against_the_schema(doc: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = {**request_schema(doc, "/v1/completions"), "components": doc["components"]}
    validator = jsonschema.Draft202012Validator(schema)
    good = {"prompt": [[1, 2], [3]], "max_tokens": 8, "logprobs": 2, "echo": True, "stream": True}
    good["stream_options"] = {"include_usage": True}
    validator.validate(good)
    parse_completion_request(good)
    assert not validator.is_valid({"max_tokens": 8})  # prompt is required
    assert not validator.is_valid({"prompt": "hi", "max_tokens": "eight"})
