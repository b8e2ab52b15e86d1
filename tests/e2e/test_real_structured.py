"""Structured outputs and tool calls on a real trained model, with the real `openai` client.

Qwen2.5-Coder-0.5B-Instruct (its GGUF file, from `tools/real_models.py`) behind `ember serve
--tool-call-parser hermes --enable-auto-tool-choice`. `chat.completions.parse()` with Pydantic models
(nested objects, arrays, enums, bounded numbers) returns objects that validate; regex and choice
outputs match; named and required tool choices give arguments that validate against the tool's
schema; "auto" on a prompt that needs a tool gives a parsed call; streamed and whole answers agree;
a history with tool calls and tool results renders exactly as transformers renders it. Requests run
concurrently (one batch). Run: `pytest -q -s -m real tests/e2e/test_real_structured.py`.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server_util import start_server, stop_server

pytestmark = pytest.mark.real


class Address(BaseModel):
    street: str = Field(max_length=40)
    city: str = Field(max_length=30)


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=130)
    address: Address


class Inventory(BaseModel):
    fruits: list[Literal["apple", "banana", "cherry", "grape"]] = Field(min_length=1, max_length=4)
    total: int = Field(ge=0, le=100)


class Review(BaseModel):
    rating: float = Field(ge=0, le=5)
    sentiment: Literal["positive", "negative", "mixed"]
    summary: str = Field(max_length=80)


SCHEMAS: list[tuple[type[BaseModel], str]] = [
    (Person, "Invent a person who lives in Berlin and give their name, age and address."),
    (Inventory, "A basket holds two apples and three bananas. List the fruits and the total count."),
    (Review, "Review this phone: great screen, poor battery."),
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "the city name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
STOCK = {
    "type": "function",
    "function": {
        "name": "get_stock_price",
        "description": "Get the latest price of a stock",
        "parameters": {
            "type": "object",
            "properties": {"ticker": {"type": "string", "maxLength": 8}},
            "required": ["ticker"],
        },
    },
}
TOOLS = [WEATHER, STOCK]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What's the weather like in Paris right now, in celsius?"}]


@pytest.fixture(scope="module")
def qwen() -> dict[str, Path]:
    from tools.real_models import prepare

    return prepare("qwen-0.5b")


@pytest.fixture(scope="module")
def server(qwen: dict[str, Path]):
    flags = ("--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--max-model-len", "2048")
    proc, url = start_server(str(qwen["gguf"]), *flags, name="qwen")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=600)


def concurrently(*calls: Any) -> list[Any]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        name, arguments = (
            (call["name"], call["arguments"])
            if isinstance(call, dict)
            else (
                call.function.name,
                call.function.arguments,
            )
        )
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMA_OF[name])


def streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, list[dict], str | None]:
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"name": piece.function.name, "arguments": ""})
            call["arguments"] += piece.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], finish


def test_parse_returns_objects_that_validate(client: openai.OpenAI) -> None:
    def ask(model: type[BaseModel], prompt: str) -> Any:
        return client.chat.completions.parse(
            model="qwen",
            messages=[{"role": "user", "content": prompt}],
            response_format=model,
            temperature=0,
            max_tokens=160,
        )

    replies = concurrently(*[lambda m=m, p=p: ask(m, p) for m, p in SCHEMAS])
    for (model, _), reply in zip(SCHEMAS, replies):
        choice = reply.choices[0]
        print(f"{model.__name__}: {choice.message.content}")
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, model)


def test_regex_and_choice_outputs_match(client: openai.OpenAI) -> None:
    date = r"\d{4}-\d{2}-\d{2}"

    def regex() -> str:
        reply = client.chat.completions.create(
            model="qwen",
            messages=[{"role": "user", "content": "On which date did the Apollo 11 crew land on the Moon?"}],
            extra_body={"structured_outputs": {"regex": date}},
            temperature=0,
            max_tokens=20,
        )
        return reply.choices[0].message.content

    def choice() -> str:
        reply = client.chat.completions.create(
            model="qwen",
            messages=[{"role": "user", "content": "Sentiment of 'I love this phone, it is wonderful'?"}],
            extra_body={"structured_outputs": {"choice": ["positive", "negative", "neutral"]}},
            temperature=0,
        )
        return reply.choices[0].message.content

    day, mood = concurrently(regex, choice)
    print(f"regex: {day!r}, choice: {mood!r}")
    assert re.fullmatch(date, day)
    assert mood == "positive"


def test_tool_choices_give_valid_calls_streamed_and_whole(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [(named, "stop"), ("required", "tool_calls"), ("auto", "tool_calls")]

    def whole(choice: Any) -> Any:
        return client.chat.completions.create(
            model="qwen", messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=120
        )

    def stream(choice: Any) -> Any:
        kw = dict(
            model="qwen", messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=120
        )
        return streamed(client, **kw)

    results = concurrently(
        *[lambda c=c: whole(c) for c, _ in cases], *[lambda c=c: stream(c) for c, _ in cases]
    )
    for (choice, finish), reply, (content, calls, stream_finish) in zip(cases, results[:3], results[3:]):
        message = reply.choices[0].message
        print(f"{choice}: {[(c.function.name, c.function.arguments) for c in message.tool_calls or []]}")
        assert reply.choices[0].finish_reason == finish == stream_finish
        check_calls(message.tool_calls, {"get_weather"} if choice is named else set(SCHEMA_OF))
        assert message.tool_calls[0].function.name == "get_weather"  # the one the question needs
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
            (c["name"], c["arguments"]) for c in calls
        ]
        assert not (message.content or "").strip() and not content.strip()


def test_history_with_tool_calls_renders_as_transformers_does(qwen: dict[str, Path], server: str) -> None:
    from transformers import AutoTokenizer

    arguments = '{"city": "Paris", "unit": "celsius"}'
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    messages = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "sky": "cloudy"}'},
    ]
    hf = AutoTokenizer.from_pretrained(qwen["hf-v5"])
    hf_messages = [
        *messages[:1],
        {
            **messages[1],
            "tool_calls": [{**call, "function": {**call["function"], "arguments": json.loads(arguments)}}],
        },
        messages[2],
    ]
    want = hf.apply_chat_template(hf_messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    body = {"model": "qwen", "messages": messages, "tools": TOOLS}
    assert httpx.post(f"{server}/tokenize", json=body, timeout=60).json()["tokens"] == want
    reply = openai.OpenAI(base_url=f"{server}/v1", api_key="none").chat.completions.create(
        model="qwen", messages=messages, tools=TOOLS, temperature=0, max_tokens=60
    )
    print(f"after the tool result: {reply.choices[0].message.content!r}")
    assert "18" in (reply.choices[0].message.content or "")
