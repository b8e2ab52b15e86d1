"""Reasoning parsers (deepseek_r1, qwen3): recorded outputs split into `<think>` reasoning and the answer.

Each output is split whole, then streamed split at random points (hypothesis): the streamed reasoning
and content pieces must add up to the whole split, with partial tags held back.
Run: `pytest -q tests/coreproc/text/test_reasoning.py`.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coreproc.text.reasoning import REASONING_PARSERS, ReasoningParser, get_reasoning_parser

pytestmark = pytest.mark.unit

R1 = "<think>\nThe user asks for 2 + 2. That is 4.\n</think>\n\nThe answer is **4**."

# (parser, output, expected reasoning, expected content)
CASES = [
    ("deepseek_r1", R1, "\nThe user asks for 2 + 2. That is 4.\n", "\n\nThe answer is **4**."),
    (
        "deepseek_r1",
        R1.removeprefix("<think>"),
        "\nThe user asks for 2 + 2. That is 4.\n",
        "\n\nThe answer is **4**.",
    ),
    ("deepseek_r1", "<think>\nLet me weigh the options: first", "\nLet me weigh the options: first", None),
    ("deepseek_r1", "Let me weigh the options", "Let me weigh the options", None),
    ("deepseek_r1", "<think></think>Paris.", None, "Paris."),
    ("deepseek_r1", "<think>\n\n</think>\n\nParis.", "\n\n", "\n\nParis."),
    ("deepseek_r1", "<think>all done</think>", "all done", None),
    ("deepseek_r1", "</think>The answer.", None, "The answer."),
    ("deepseek_r1", "<thi", "<thi", None),
    (
        "deepseek_r1",
        "<think>日本語で考える 🙂</think>答えは「はい」です。",
        "日本語で考える 🙂",
        "答えは「はい」です。",
    ),
    ("deepseek_r1", "", None, None),
    (
        "qwen3",
        "<think>\nOkay, the user greets me.\n</think>\n\nHello! How can I help?",
        "\nOkay, the user greets me.\n",
        "\n\nHello! How can I help?",
    ),
    ("qwen3", "Hello! How can I help you today?", None, "Hello! How can I help you today?"),
    (  # the template opened the block (`thinking`): the output starts inside it
        "qwen3+",
        "The user wants a haiku.\n</think>\n\nAutumn moonlight",
        "The user wants a haiku.\n",
        "\n\nAutumn moonlight",
    ),
    (  # no block opened, none in the output: an answer, streamed as it comes
        "qwen3",
        "The user wants a haiku.\n</think>\n\nAutumn moonlight",
        None,
        "The user wants a haiku.\n</think>\n\nAutumn moonlight",
    ),
    ("qwen3", "<think>\nLet me count the letters in", "\nLet me count the letters in", None),
    ("qwen3", "<think>\n\n</think>\n\nHi.", "\n\n", "\n\nHi."),
    ("qwen3", "<think></think>", None, None),
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3+", "a </think> b </think> c", "a ", " b </think> c"),
    ("qwen3+", "still thinking when cut off", "still thinking when cut off", None),
    ("qwen3", "", None, None),
]


def make(name: str) -> ReasoningParser:
    """A parser; "qwen3+" is qwen3 after a prompt that left `<think>` open."""
    return get_reasoning_parser(name.removesuffix("+"))(thinking=name.endswith("+"))


def stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    out = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1][:20]!r}")
def test_split(case):
    name, text, reasoning, content = case
    assert make(name).split(text) == (reasoning, content)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1][:20]!r}")
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_stream_adds_up_to_split(case, data):
    name, text, reasoning, content = case
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10), label="cuts"))
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert stream(make(name), pieces) == (reasoning or "", content or "")
    assert stream(make(name), list(text)) == (reasoning or "", content or "")


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_end_tag_split_across_chunks_is_held_back(name):
    parser = make(name)
    assert parser.feed("<th") == ("", "")
    assert parser.feed("ink>Two plus two is four.</th") == ("Two plus two is four.", "")
    assert parser.feed("in") == ("", "")
    assert parser.feed("k>\n\n4") == ("", "\n\n4")
    assert parser.finish() == ("", "")


def test_deepseek_streams_reasoning_before_the_end_tag():
    parser = get_reasoning_parser("deepseek_r1")()
    assert parser.feed("First, ") == ("First, ", "")
    assert parser.feed("then <") == ("then ", "")
    assert parser.feed("b>") == ("<b>", "")
    assert parser.finish() == ("", "")


def test_qwen3_answer_without_think_tag_streams_at_once():
    parser = get_reasoning_parser("qwen3")()
    assert parser.feed("Hello") == ("", "Hello")
    assert parser.feed(" there!") == ("", " there!")
    assert parser.finish() == ("", "")
    opened = get_reasoning_parser("qwen3")()
    assert opened.feed("<think>Hmm") == ("Hmm", "")
    prompted = get_reasoning_parser("qwen3")(thinking=True)
    assert prompted.feed("Hmm, ") == ("Hmm, ", "")
    assert prompted.feed("ok</think>Hi") == ("ok", "Hi")


def test_registry():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("granite")


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@settings(max_examples=300, deadline=None)
@given(
    text=st.lists(
        st.sampled_from(["<think>", "</think>", "<", "</th", "ink>", "<t", "a", "é", "\n", " "])
    ).map("".join),
    data=st.data(),
)
def test_any_output_streams_like_split(name, text, data):
    reasoning, content = make(name).split(text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10), label="cuts"))
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert stream(make(name), pieces) == (reasoning or "", content or "")
