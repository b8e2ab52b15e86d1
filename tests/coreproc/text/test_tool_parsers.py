"""Tool-call parsers (hermes, llama3_json): recorded model outputs parse to the expected OpenAI calls.

Each output is parsed whole, then streamed split at random points (hypothesis): the streamed content and
per-call id, name and arguments must add up to the whole parse. Malformed outputs never raise and come
back as content. Run: `pytest -q tests/coreproc/text/test_tool_parsers.py`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coreproc.text.tool_parsers import (
    TOOL_CALL_FORMATS,
    TOOL_PARSERS,
    ParsedTools,
    ToolCall,
    ToolDelta,
    ToolParser,
    get_tool_parser,
)

pytestmark = pytest.mark.unit

WEATHER = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
)
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'
NESTED_ARGS = (
    r'{"query": "a {b} [c] \"quoted\" </tool_call> <tool_call>", '
    r'"filters": {"tags": ["x", {"y": null}], "limit": 5, "score": -1.5e3, "exact": true}}'
)
TOOLS = {"get_weather", "get_time"}

# (case id, parser, output, tool names, expected content, expected (name, arguments) calls)
WELL_FORMED = [
    ("single", "hermes", WEATHER, None, None, [("get_weather", WEATHER_ARGS)]),
    (
        "parallel",
        "hermes",
        WEATHER + "\n" + TIME,
        None,
        None,
        [("get_weather", WEATHER_ARGS), ("get_time", '{"timezone": "Europe/Paris"}')],
    ),
    (
        "content_then_call",
        "hermes",
        "I'll look up the current weather in Paris for you.\n\n" + WEATHER,
        TOOLS,
        "I'll look up the current weather in Paris for you.",
        [("get_weather", WEATHER_ARGS)],
    ),
    (
        "content_around",
        "hermes",
        "Sure.\n" + WEATHER + "\nI have asked for the weather.",
        None,
        "Sure.\n\nI have asked for the weather.",
        [("get_weather", WEATHER_ARGS)],
    ),
    (
        "nested_braces_quotes_tags_in_strings",
        "hermes",
        '<tool_call>\n{"name": "search", "arguments": ' + NESTED_ARGS + "}\n</tool_call>",
        None,
        None,
        [("search", NESTED_ARGS)],
    ),
    (
        "unicode",
        "hermes",
        '<tool_call>\n{"name": "translate", "arguments": {"text": "日本語 🙂 naïve", "note": "caf\\u00e9"}}'
        "\n</tool_call>",
        None,
        None,
        [("translate", '{"text": "日本語 🙂 naïve", "note": "caf\\u00e9"}')],
    ),
    (
        "arguments_before_name",
        "hermes",
        '<tool_call>\n{"arguments": {"city": "Tokyo"}, "name": "get_weather"}\n</tool_call>',
        TOOLS,
        None,
        [("get_weather", '{"city": "Tokyo"}')],
    ),
    (
        "no_arguments",
        "hermes",
        '<tool_call>\n{"name": "get_time"}\n</tool_call>',
        None,
        None,
        [("get_time", "{}")],
    ),
    (
        "no_closing_tag",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n',
        None,
        None,
        [("get_weather", '{"city": "Oslo"}')],
    ),
    (
        "compact",
        "hermes",
        '<tool_call>{"name":"get_weather","arguments":{}}</tool_call>',
        None,
        None,
        [("get_weather", "{}")],
    ),
    ("prose", "hermes", "The capital of France is Paris.", None, "The capital of France is Paris.", []),
    ("partial_tag_at_end", "hermes", "Calls look like <tool_call", None, "Calls look like <tool_call", []),
    # malformed before the name is known: content, in both modes
    (
        "invalid_json",
        "hermes",
        '<tool_call>\n{name: "get_weather", arguments: {}}\n</tool_call>',
        None,
        '<tool_call>\n{name: "get_weather", arguments: {}}\n</tool_call>',
        [],
    ),
    (
        "unknown_tool",
        "hermes",
        'Deleting.\n<tool_call>\n{"name": "delete_files", "arguments": {"path": "/"}}\n</tool_call>',
        TOOLS,
        'Deleting.\n<tool_call>\n{"name": "delete_files", "arguments": {"path": "/"}}\n</tool_call>',
        [],
    ),
    (
        "missing_name",
        "hermes",
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',
        [],
    ),
    (
        "name_not_a_string",
        "hermes",
        '<tool_call>\n{"name": 42, "arguments": {}}\n</tool_call>',
        None,
        '<tool_call>\n{"name": 42, "arguments": {}}\n</tool_call>',
        [],
    ),
    (
        "arguments_not_an_object",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": 1}"}\n</tool_call>',
        None,
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": 1}"}\n</tool_call>',
        [],
    ),
    (
        "truncated_before_name",
        "hermes",
        'Let me check.\n<tool_call>\n{"na',
        None,
        'Let me check.\n<tool_call>\n{"na',
        [],
    ),
    ("empty_block", "hermes", "<tool_call>\n</tool_call>", None, "<tool_call>\n</tool_call>", []),
    (
        "broken_then_good",
        "hermes",
        "<tool_call>\nnot json at all\n</tool_call>\n" + WEATHER,
        None,
        "<tool_call>\nnot json at all\n</tool_call>",
        [("get_weather", WEATHER_ARGS)],
    ),
    # llama3_json
    (
        "python_tag",
        "llama3_json",
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}',
        None,
        None,
        [("f", '{"x": 1}')],
    ),
    (
        "plain",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        TOOLS,
        None,
        [("get_weather", WEATHER_ARGS)],
    ),
    (
        "two_calls",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
        None,
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    (
        "arguments_key",
        "llama3_json",
        '\n\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n',
        None,
        None,
        [("get_weather", '{"city": "Rome"}')],
    ),
    (
        "nested_unicode",
        "llama3_json",
        '{"name": "search", "parameters": {"q": "naïve {café}; \\"x\\"", "k": [1, {"z": null}]}}',
        None,
        None,
        [("search", '{"q": "naïve {café}; \\"x\\"", "k": [1, {"z": null}]}')],
    ),
    ("no_parameters", "llama3_json", '{"name": "get_time"}', None, None, [("get_time", "{}")]),
    (
        "text_after",
        "llama3_json",
        '{"name": "get_time", "parameters": {}}\n\nI asked for the time.',
        None,
        "I asked for the time.",
        [("get_time", "{}")],
    ),
    (
        "trailing_semicolon",
        "llama3_json",
        '{"name": "f", "parameters": {"x": 1}};',
        None,
        None,
        [("f", '{"x": 1}')],
    ),
    ("prose", "llama3_json", "It is sunny in Paris, 21 °C.\n", None, "It is sunny in Paris, 21 °C.", []),
    (
        "json_after_prose",
        "llama3_json",
        'Here is the call: {"name": "f", "parameters": {}}',
        None,
        'Here is the call: {"name": "f", "parameters": {}}',
        [],
    ),
    (
        "python_code",
        "llama3_json",
        '<|python_tag|>print("hello")',
        None,
        '<|python_tag|>print("hello")',
        [],
    ),
    (
        "invalid_json",
        "llama3_json",
        '{name: "f", "parameters": {}}',
        None,
        '{name: "f", "parameters": {}}',
        [],
    ),
    (
        "unknown_tool",
        "llama3_json",
        '{"name": "rm", "parameters": {"path": "/"}}',
        TOOLS,
        '{"name": "rm", "parameters": {"path": "/"}}',
        [],
    ),
    ("truncated_before_name", "llama3_json", '{"nam', None, '{"nam', []),
]

# malformed after the name is known: `parse` gives content; streaming has announced the call (documented)
BROKEN_LATE = [
    ("truncated_mid_arguments", "hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),
    (
        "invalid_after_name",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
    ),
    ("truncated_mid_parameters", "llama3_json", '{"name": "get_weather", "parameters": {"city": "Par'),
    ("second_invalid", "llama3_json", '{"name": "get_weather", "parameters": {}}; {"name": oops}'),
]


def counting_ids() -> Callable[[], str]:
    count = itertools.count()
    return lambda: f"call_{next(count)}"


def make(parser: str, tools: set[str] | None = None) -> ToolParser:
    return get_tool_parser(parser)(tools, counting_ids())


def collect(deltas: list[ToolDelta]) -> ParsedTools:
    """Adds up streamed deltas the way an OpenAI client does, checking each delta's shape."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.content is not None:
            assert d.index is None and d.id is None and d.content, d
            content.append(d.content)
        elif d.index not in calls:
            assert d.index == len(calls) and d.id and d.name and d.arguments is not None, d
            calls[d.index] = [d.id, d.name, d.arguments]
        else:
            assert d.id is None and d.name is None and d.arguments, d
            calls[d.index][2] += d.arguments
    return ParsedTools("".join(content) or None, [ToolCall(*call) for call in calls.values()])


def stream(parser: ToolParser, pieces: list[str]) -> ParsedTools:
    return collect([d for piece in pieces for d in parser.feed(piece)] + parser.finish())


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("case", WELL_FORMED, ids=lambda c: f"{c[1]}-{c[0]}")
def test_parse(case):
    _, parser, text, tools, content, calls = case
    parsed = make(parser, tools).parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    assert [c.id for c in parsed.tool_calls] == [f"call_{i}" for i in range(len(calls))]
    assert all(isinstance(json.loads(c.arguments), dict) for c in parsed.tool_calls)


@pytest.mark.parametrize("case", WELL_FORMED, ids=lambda c: f"{c[1]}-{c[0]}")
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_stream_adds_up_to_parse(case, data):
    _, parser, text, tools, _, _ = case
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12), label="cuts")
    assert stream(make(parser, tools), split_at(text, cuts)) == make(parser, tools).parse(text)


@pytest.mark.parametrize("case", WELL_FORMED, ids=lambda c: f"{c[1]}-{c[0]}")
def test_stream_char_by_char(case):
    _, parser, text, tools, _, _ = case
    assert stream(make(parser, tools), list(text)) == make(parser, tools).parse(text)


@pytest.mark.parametrize("case", BROKEN_LATE, ids=lambda c: f"{c[1]}-{c[0]}")
def test_broken_after_name_is_content_whole_and_announced_streaming(case):
    _, parser, text = case
    assert make(parser).parse(text) == ParsedTools(text, [])
    streamed = stream(make(parser), list(text))
    assert streamed.content is None
    assert streamed.tool_calls[0].name == "get_weather"


def test_arguments_stream_before_the_block_ends():
    parser, seen = make("hermes"), []
    for i, ch in enumerate(WEATHER):
        seen += [(i, d) for d in parser.feed(ch)]
    first = WEATHER.index('"arguments": {') + len('"arguments": {') - 1
    assert seen[0] == (first, ToolDelta(index=0, id="call_0", name="get_weather", arguments="{"))
    assert len(seen) == len(WEATHER_ARGS) and seen[-1][0] < WEATHER.index("</tool_call>")
    assert parser.finish() == []


def test_partial_opening_tag_is_held_back():
    parser = make("hermes")
    assert parser.feed("Let me check. <tool_c") == [ToolDelta(content="Let me check.")]
    assert parser.feed("all>\n") == []
    rest = parser.feed(WEATHER[len("<tool_call>\n") :]) + parser.finish()
    assert [d.content for d in rest] == [None] and rest[0].name == "get_weather"
    held = make("hermes")
    assert held.feed("a <tool") == [ToolDelta(content="a")]
    assert held.finish() == [ToolDelta(content=" <tool")]


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_FORMATS))
@pytest.mark.parametrize("args", [{}, {"city": "Paris"}, {"q": '}{ ]"', "n": [1, {"m": None}], "u": "é🙂"}])
def test_call_formats_parse_back(parser, args):
    begin, end = TOOL_CALL_FORMATS[parser]
    arguments = json.dumps(args, ensure_ascii=False)
    text = begin.replace("{name}", "get_weather") + arguments + end
    expected = ParsedTools(None, [ToolCall("call_0", "get_weather", arguments)])
    assert make(parser, TOOLS).parse(text) == expected
    two = make(parser, TOOLS).parse(text + ("\n" if parser == "hermes" else "; ") + text)
    assert [(c.name, c.arguments) for c in two.tool_calls] == [("get_weather", arguments)] * 2


def test_registry_and_default_ids():
    assert set(TOOL_PARSERS) == set(TOOL_CALL_FORMATS) == {"hermes", "llama3_json"}
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_tool_parser("mistral")
    (call,) = get_tool_parser("hermes")().parse(WEATHER).tool_calls
    assert call.id.startswith("call_") and len(call.id) == len("call_") + 24


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
NO_TAGS = st.text(st.characters(blacklist_characters="<"), max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.sampled_from(sorted(TOOLS)), st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4)
        ),
        max_size=3,
    ),
    texts=st.lists(NO_TAGS, min_size=4, max_size=4),
    indent=st.sampled_from([None, 2]),
    ascii_only=st.booleans(),
    data=st.data(),
)
def test_generated_hermes_outputs(calls, texts, indent, ascii_only, data):
    raw = [json.dumps(args, indent=indent, ensure_ascii=ascii_only) for _, args in calls]
    blocks = [
        f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n</tool_call>'
        for (name, _), args in zip(calls, raw)
    ]
    text = texts[0] + "".join(block + texts[i + 1] for i, block in enumerate(blocks))
    content = (texts[0] + "".join(texts[1 : len(blocks) + 1])).strip() or None
    parsed = make("hermes", TOOLS).parse(text)
    assert parsed == ParsedTools(
        content, [ToolCall(f"call_{i}", n, a) for i, ((n, _), a) in enumerate(zip(calls, raw))]
    )
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12), label="cuts")
    assert stream(make("hermes", TOOLS), split_at(text, cuts)) == parsed


@settings(max_examples=100, deadline=None)
@given(
    calls=st.lists(st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4), min_size=1, max_size=3),
    tag=st.booleans(),
    data=st.data(),
)
def test_generated_llama3_outputs(calls, tag, data):
    raw = [json.dumps(args, ensure_ascii=False) for args in calls]
    text = ("<|python_tag|>" if tag else "") + "; ".join(f'{{"name": "f", "parameters": {a}}}' for a in raw)
    parsed = make("llama3_json").parse(text)
    assert parsed == ParsedTools(None, [ToolCall(f"call_{i}", "f", a) for i, a in enumerate(raw)])
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12), label="cuts")
    assert stream(make("llama3_json"), split_at(text, cuts)) == parsed


PIECES = ["<tool_call>", "</tool_call>", "<|python_tag|>", "<tool", "{", "}", "[", "]", '"', "\\", ":", ","]
PIECES += [";", " ", "\n", '"name"', '"arguments"', '"parameters"', '"get_time"', "1", "x", "{}"]


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from(PIECES), max_size=40).map("".join), data=st.data())
def test_garbage_never_raises(parser, text, data):
    parsed = make(parser).parse(text)
    assert all(isinstance(json.loads(c.arguments), dict) for c in parsed.tool_calls)
    if not parsed.tool_calls:
        assert parsed.content == (text.strip() or None)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8), label="cuts")
    stream(make(parser), split_at(text, cuts))  # well-shaped deltas, no exception
