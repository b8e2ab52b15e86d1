"""Structured outputs, tool calls and the unknown-field rule through the OpenAI API and batch mode.

A tiny random checkpoint behind `ember serve --tool-call-parser hermes --enable-auto-tool-choice`,
driven with the real `openai` client: `parse()` with Pydantic models, regex and choice, named and
required tool choices (arguments that validate, streamed and whole alike), and every 400: unknown
and unsupported fields, invalid schemas (also streaming), unsupported combinations. Batch mode: the
same rules per line, and `--allow-unknown-fields`. Run: `pytest -q tests/e2e/test_structured_api.py`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from frontend.cli import main
from tests.coreproc.client.test_batch import by_id, chat, engine_flags, read_records, write_jsonl
from tests.server_util import start_server, stop_server

pytestmark = pytest.mark.e2e

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


class Pet(BaseModel):
    name: str = Field(max_length=10)
    legs: int = Field(ge=0, le=8)
    kind: Literal["cat", "dog", "bird"]


class Owner(BaseModel):
    pets: list[Pet] = Field(max_length=2)
    score: float = Field(ge=0, le=1)


@pytest.fixture(scope="module")
def server(make_ckpt):
    proc, url = start_server(
        str(make_ckpt("llama")), "--tool-call-parser", "hermes", "--enable-auto-tool-choice", name="tiny"
    )
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def check_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit", "days"}, args
    assert isinstance(args["city"], str) and len(args["city"]) <= 20
    assert args["unit"] in ("celsius", "fahrenheit") and 1 <= args["days"] <= 7


def test_parse_returns_objects_that_validate(client: openai.OpenAI) -> None:
    for model in (Pet, Owner):
        reply = client.chat.completions.parse(
            model="tiny", messages=MESSAGES, response_format=model, temperature=0, max_tokens=200
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, model)
        model.model_validate_json(choice.message.content)


def test_regex_choice_and_json_object(client: openai.OpenAI) -> None:
    regex = client.completions.create(
        model="tiny",
        prompt="a phone number:",
        max_tokens=30,
        extra_body={"structured_outputs": {"regex": r"\+\d{2} \d{3}-\d{4}"}},
    )
    assert re.fullmatch(r"\+\d{2} \d{3}-\d{4}", regex.choices[0].text)
    pick = client.chat.completions.create(
        model="tiny", messages=MESSAGES, n=3, extra_body={"structured_outputs": {"choice": ["sun", "rain"]}}
    )
    assert all(c.message.content in ("sun", "rain") for c in pick.choices)
    obj = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=100,
        temperature=0,
    )
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def stream_calls(client: openai.OpenAI, **kw) -> tuple[list[dict], str | None, str]:
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for piece in delta.tool_calls or []:
            call = calls.setdefault(
                piece.index, {"id": piece.id, "name": piece.function.name, "arguments": ""}
            )
            if piece.id is not None:
                assert call["id"] == piece.id and piece.function.name, "id and name come with the first piece"
            call["arguments"] += piece.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish, content


def test_named_and_required_tool_choices_give_valid_arguments_streamed_or_not(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, finish in ((named, "stop"), ("required", "tool_calls")):
        kw = dict(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice, temperature=0)
        reply = client.chat.completions.create(parallel_tool_calls=False, **kw)  # up to the context
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == finish and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        if choice is named:
            assert call.function.name == "get_weather"
        if call.function.name == "get_weather":
            check_weather(call.function.arguments)
        else:
            assert isinstance(json.loads(call.function.arguments), dict)
        streamed, stream_finish, content = stream_calls(
            client, max_tokens=300, parallel_tool_calls=False, **kw
        )
        assert stream_finish == finish and not content and message.content is None
        assert [(c["name"], c["arguments"]) for c in streamed] == [
            (call.function.name, call.function.arguments)
        ]


def test_required_tool_choice_may_call_several_tools(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=1.0,
        seed=3,
        n=4,
        max_tokens=400,
    )
    for choice in reply.choices:
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.function.name in ("get_weather", "get_time")
            json.loads(call.function.arguments)


def status_of(client: openai.OpenAI, stream: bool = False, **body) -> tuple[int, str, str | None]:
    try:
        reply = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=4, stream=stream, extra_body=body
        )
        if stream:
            list(reply)
    except openai.APIStatusError as e:
        error = e.body if isinstance(e.body, dict) else {}
        return e.status_code, str(error.get("message")), error.get("param")
    return 200, "", None


@pytest.mark.parametrize("stream", [False, True])
def test_every_refusal_is_a_400_naming_the_field(client: openai.OpenAI, stream: bool) -> None:
    cases = [
        ({"max_token": 3}, "unknown field 'max_token'", "max_token"),
        ({"messages": [{"role": "user", "content": "hi", "nmae": "x"}]}, "unknown field", "messages[0].nmae"),
        ({"audio": {"voice": "alloy"}}, "audio is not supported", "audio"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "needs json_schema.schema",
            None,
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
            "invalid json",
            None,
        ),
        ({"structured_outputs": {"regex": "(["}}, "invalid regex constraint", None),
        ({"structured_outputs": {"grammar": "root ::= nothing"}}, "invalid grammar constraint", None),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of", "structured_outputs"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "not both",
            "structured_outputs",
        ),
        ({"tool_choice": "required"}, "tool_choice needs tools", "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not in tools",
            "tool_choice",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
            "tool_choice",
        ),
    ]
    for body, message, param in cases:
        status, got, got_param = status_of(client, stream, **body)
        assert status == 400 and message in got, (body, status, got)
        if param is not None:
            assert got_param == param, (body, got_param)
    assert (
        status_of(client, stream, user="u1", metadata={"k": "v"}, store=False, service_tier="auto")[0] == 200
    )


def test_batch_lines_follow_the_same_rules(make_ckpt, tmp_path: Path) -> None:
    ckpt = str(make_ckpt("llama"))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    good = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    items = [
        chat("json", messages=MESSAGES, response_format=good, max_tokens=30, temperature=0),
        chat(
            "bad-schema",
            messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": {"schema": {"type": 1}}},
        ),
        chat("typo", messages=MESSAGES, max_token=3),
        chat("auto-tools", messages=MESSAGES, tools=[WEATHER]),
        chat(
            "named",
            messages=MESSAGES,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        ),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", items)
    out = tmp_path / "out.jsonl"
    assert main(["batch", "-i", str(src), "-o", str(out), *engine_flags(ckpt)]) == 0
    rec = {k: v["response"] for k, v in by_id(read_records(out)).items()}
    assert rec["json"]["status_code"] == 200
    assert set(json.loads(rec["json"]["body"]["choices"][0]["message"]["content"])) == {"ok"}
    assert rec["bad-schema"]["status_code"] == 400
    assert "invalid json constraint" in rec["bad-schema"]["body"]["error"]["message"]
    assert rec["typo"]["status_code"] == 400 and rec["typo"]["body"]["error"]["param"] == "max_token"
    assert rec["auto-tools"]["status_code"] == 400  # "auto" needs --enable-auto-tool-choice
    named = rec["named"]["body"]["choices"][0]
    assert rec["named"]["status_code"] == 200 and named["message"]["content"] is None
    check_weather(named["message"]["tool_calls"][0]["function"]["arguments"])
    lenient = tmp_path / "lenient.jsonl"
    flags = engine_flags(ckpt, "--allow-unknown-fields")
    assert (
        main(
            ["batch", "-i", str(write_jsonl(tmp_path / "typo.jsonl", items[2:3])), "-o", str(lenient), *flags]
        )
        == 0
    )
    assert read_records(lenient)[0]["response"]["status_code"] == 200
