"""Incremental detokenization: whole characters only, exact final text, stop strings held back.

Uses the tiny checkpoint's real byte-level BPE tokenizer, whose small vocabulary splits multi-byte
characters across tokens. Run: `pytest -q tests/coreproc/text/test_detokenizer.py`.
"""

from __future__ import annotations

import pytest

from coreproc.base.protocol import SamplingParams
from coreproc.base.tokenizer import load_tokenizer
from coreproc.text.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.unit

TEXT = "print('héllo wörld') # 日本語のテキスト 🙂🚀 naïve café — “quotes”\n"


@pytest.fixture(scope="module")
def tokenizer(make_ckpt):
    return load_tokenizer(str(make_ckpt("llama")))


def test_no_broken_characters_and_exact_text(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert len(ids) > len(TEXT.encode()) // 3, "expected multi-byte characters split across tokens"
    prompt = tokenizer("x = ").input_ids
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    pieces = []
    for t in ids:
        assert detok.update([t]) is None
        piece = detok.delta(finished=False)
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(detok.delta(finished=True))
    assert "".join(pieces) == TEXT == tokenizer.decode(ids)


def test_stop_string_split_across_tokens_is_never_streamed(tokenizer):
    stop = "wörld"
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop]))
    streamed = ""
    hit = None
    for t in ids:
        hit = detok.update([t])
        streamed += detok.delta(finished=hit is not None)
        assert stop not in streamed
        if hit:
            break
    assert hit == stop
    assert streamed == TEXT[: TEXT.index(stop)]


def test_include_stop_string(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(
        tokenizer, [], SamplingParams(stop=["日本", "zzz"], include_stop_str_in_output=True)
    )
    for t in ids:
        if detok.update([t]):
            break
    assert detok.text == TEXT[: TEXT.index("日本") + 2]


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["café", "héllo"]))
    hit = detok.update(ids)
    assert hit == "héllo" and detok.text == "print('"


def test_special_tokens_skipped_unless_asked(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer("abc", add_special_tokens=False).input_ids + [eos]
    skip = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    skip.update(ids)
    keep = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    keep.update(ids)
    assert skip.text == "abc"
    assert keep.text == "abc" + tokenizer.eos_token
