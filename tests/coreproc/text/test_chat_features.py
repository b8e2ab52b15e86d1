"""`ChatFeatures`: request constraints from response_format / tool_choice, and the output parser.

Pure Python with a small stand-in tokenizer (only `encode`/`decode` of tag text matter here). Outputs
are the ones Qwen2.5-Coder-0.5B-Instruct wrote in the real-model tests: a bare JSON call without the
<tool_call> tags, a tagged call, and reasoning around an answer; each is parsed whole and streamed
one character at a time, with the same message. Run: `pytest -q tests/coreproc/text/test_chat_features.py`.
"""

from __future__ import annotations

import json

import pytest

from coreproc.base.errors import ConfigError
from coreproc.text.chat_features import ChatFeatures, OutputParser
from coreproc.text.openai_protocol import RequestError, parse_chat_request

pytestmark = pytest.mark.unit

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
BARE = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TAGGED = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class CharTokenizer:
    """One token per character: enough to find tags in a prompt."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


def request(**body):
    return parse_chat_request({"messages": ASK, **body})


def streamed(parser: OutputParser, text: str) -> dict:
    """A message assembled from streamed deltas, as a client would."""
    message: dict = {"content": "", "reasoning_content": "", "calls": {}}
    pieces = [d for i, c in enumerate(text) for d in parser.feed(c, final=i == len(text) - 1)]
    for d in pieces:
        message["content"] += d.get("content") or ""
        message["reasoning_content"] += d.get("reasoning_content") or ""
        for call in d.get("tool_calls", []):
            got = message["calls"].setdefault(call["index"], {"name": None, "arguments": ""})
            got["name"] = call["function"].get("name") or got["name"]
            got["arguments"] += call["function"].get("arguments", "")
    return message


def whole_and_streamed(features: ChatFeatures, req, text: str, prompt: str = "") -> tuple[dict, dict]:
    ids = CharTokenizer().encode(prompt)
    whole = features.output_parser(req, CharTokenizer(), ids)
    stream = features.output_parser(req, CharTokenizer(), ids)
    assert whole is not None and stream is not None
    return whole.message(text), streamed(stream, text)


def test_a_bare_json_call_and_a_tagged_call_parse_alike_streamed_or_not() -> None:
    features = ChatFeatures(tool_call_parser="hermes", enable_auto_tool_choice=True)
    req = request(tools=TOOLS)
    for text, content in ((BARE, None), (TAGGED, "Let me check.")):
        message, stream = whole_and_streamed(features, req, text)
        assert message["content"] == content and (stream["content"] or None) == content
        (call,) = message["tool_calls"]
        arguments = call["function"]["arguments"]
        assert call["function"]["name"] == "get_weather" and json.loads(arguments)["city"] == "Paris"
        assert stream["calls"] == {0: {"name": "get_weather", "arguments": arguments}}
    plain, _ = whole_and_streamed(features, req, "It is sunny in Paris.")
    assert plain["content"] == "It is sunny in Paris." and plain["tool_calls"] == []
    broken, _ = whole_and_streamed(features, req, '<tool_call>\n{"name": "get_weather", "argu')
    assert broken["tool_calls"] == [] and broken["content"].startswith("<tool_call>")


def test_reasoning_is_split_off_and_the_constraint_waits_for_its_end() -> None:
    features = ChatFeatures(reasoning_parser="deepseek_r1")
    req = request(response_format={"type": "json_object"})
    tok = CharTokenizer()
    open_prompt = "<|im_start|>assistant\n<think>\n"
    spec = features.constraint(req, tok, tok.encode(open_prompt))
    assert spec is not None and spec.kind == "json_object" and spec.after == tok.encode("</think>")
    message, stream = whole_and_streamed(features, req, 'Paris is in France.</think>{"a": 1}', open_prompt)
    assert message["reasoning_content"] == "Paris is in France." == stream["reasoning_content"]
    assert message["content"] == '{"a": 1}' == stream["content"]
    closed = features.constraint(req, tok, tok.encode("<think>\n\n</think>\n\n"))  # thinking off
    assert closed is not None and closed.after == []
    qwen3 = ChatFeatures(reasoning_parser="qwen3")
    assert qwen3.constraint(req, tok, tok.encode("assistant\n")).after == []  # no block opened: none
    assert qwen3.constraint(req, tok, tok.encode(open_prompt)).after == tok.encode("</think>")


def test_tool_choices_become_structural_tags_in_the_parsers_format() -> None:
    features = ChatFeatures(tool_call_parser="llama3_json")
    named = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    spec = features.constraint(named, CharTokenizer(), [])
    assert spec is not None and spec.kind == "structural_tag"
    fmt = json.loads(spec.spec)["format"]
    assert fmt["stop_after_first"] and fmt["tags"][0]["begin"] == '{"name": "get_weather", "parameters": '
    assert fmt["tags"][0]["content"]["json_schema"] == TOOLS[0]["function"]["parameters"]
    required = features.constraint(request(tools=TOOLS, tool_choice="required"), CharTokenizer(), [])
    assert required is not None and not json.loads(required.spec)["format"]["stop_after_first"]
    assert features.constraint(request(tools=TOOLS, tool_choice="none"), CharTokenizer(), []) is None
    with pytest.raises(RequestError, match="--enable-auto-tool-choice"):
        features.constraint(request(tools=TOOLS), CharTokenizer(), [])  # default choice "auto"
    with pytest.raises(ConfigError, match="needs --tool-call-parser"):
        ChatFeatures(enable_auto_tool_choice=True)


def test_template_gets_tools_and_history_arguments_as_objects() -> None:
    from coreproc.text.chat import template_messages

    features = ChatFeatures()
    req = request(tools=TOOLS, tool_choice="none", chat_template_kwargs={"enable_thinking": False})
    kwargs = features.template_kwargs(req)
    assert kwargs["enable_thinking"] is False and kwargs["tools"] == TOOLS
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    history = parse_chat_request(
        {
            "messages": [
                *ASK,
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ]
        }
    )
    rendered = template_messages(history.messages)
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    bad = {**call, "function": {**call["function"], "arguments": "{nope"}}
    with pytest.raises(RequestError, match="not valid JSON"):
        template_messages(
            parse_chat_request({"messages": [{"role": "assistant", "tool_calls": [bad]}]}).messages
        )
