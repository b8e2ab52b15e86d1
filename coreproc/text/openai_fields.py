"""The OpenAI request fields beyond sampling: structured outputs, tools, and the unknown-field rule.

Runs in the HTTP frontend and in batch mode (through `openai_protocol.py`). Holds the Structs of
`response_format`, vLLM's `structured_outputs`, `tools` and `tool_choice`, the list of fields that
are accepted as bookkeeping or refused when set, and `FieldPolicy`: a field that is neither in the
schema nor one of Ember's extras is a 400 naming it (it catches typos such as `max_token`), unless
the server runs with `--allow-unknown-fields`, which drops it and logs each name once.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any, Literal

import msgspec
from msgspec import inspect as mi

log = logging.getLogger("ember.api")

# set but unused by design (OpenAI bookkeeping, routing hints): accepted and ignored
BOOKKEEPING = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
# in OpenAI's schema but not served by Ember: a 400 when set to anything but their "off" value
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "functions": (None,),  # the deprecated spelling of tools: send `tools`
    "function_call": (None,),  # ... and of tool_choice
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "suffix": (None, ""),
}


class JsonSchemaFormat(msgspec.Struct, frozen=True, kw_only=True):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, frozen=True, kw_only=True):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParam(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """vLLM's `structured_outputs` extra: exactly one of these constraints."""

    json: dict[str, Any] | bool | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None


class FunctionDef(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(msgspec.Struct, frozen=True):
    name: str


class NamedToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"


class AssistantToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call in an assistant message of the history (as the API returned it)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


# ----------------------------------------------------------------------------- unknown fields


class FieldPolicy:
    """What to do with a field the schema does not know: refuse (default) or drop and log once."""

    def __init__(self, allow_unknown: bool = False) -> None:
        self.allow_unknown = allow_unknown
        self._logged: set[str] = set()

    def check(self, body: Any, typ: type) -> list[str]:
        """The unknown fields of `body` (a decoded JSON value) for `typ`, as dotted paths; they are
        removed from `body` when allowed (and logged once per name), else the caller refuses."""
        unknown = _walk(body, _info(typ), "")
        if unknown and self.allow_unknown:
            for path, owner, key in unknown:
                owner.pop(key, None)
                if path not in self._logged:
                    self._logged.add(path)
                    log.warning("ignoring unknown request field %r (--allow-unknown-fields)", path)
            return []
        return [path for path, _, _ in unknown]


@cache
def _info(typ: type) -> Any:
    return mi.type_info(typ)


def _walk(value: Any, t: Any, path: str) -> list[tuple[str, dict, str]]:
    """(path, the dict holding it, key) of every key of `value` that `t` has no field for."""
    if isinstance(t, mi.UnionType):
        kind = dict if isinstance(value, dict) else list if isinstance(value, list) else None
        for sub in t.types:
            if (kind is dict and isinstance(sub, mi.StructType)) or (
                kind is list and isinstance(sub, mi.ListType)
            ):
                return _walk(value, sub, path)
        return []
    if isinstance(t, mi.StructType) and isinstance(value, dict):
        fields = {f.encode_name: f for f in t.fields}
        found = [(f"{path}{k}", value, k) for k in value if k not in fields]
        for key, f in fields.items():
            if key in value:
                found += _walk(value[key], f.type, f"{path}{key}.")
        return found
    if isinstance(t, mi.ListType) and isinstance(value, list):
        base = path[:-1]
        return [hit for i, v in enumerate(value) for hit in _walk(v, t.item_type, f"{base}[{i}].")]
    return []


def unsupported_field(req: Any) -> str | None:
    """The first OpenAI field set on `req` that Ember does not serve."""
    for name, off in UNSUPPORTED.items():
        if getattr(req, name, None) not in off:
            return name
    return None
