"""Fuzzing `ember batch` input files with hypothesis.

Each example is one input file: good completion lines mixed with hypothesis-made bad ones (any JSON
value, every field and body field of the wrong type, huge numbers, NaN and Infinity literals, escaped
lone surrogates, invalid UTF-8, lines cut short, blank lines, long lines, custom_ids used twice). The
file runs through `ember batch` in-process; the run must exit 0, every good line gets one 200 record,
every other non-blank line exactly one record (a line-level error names its line; a request error
carries the line's custom_id), and nothing else is written. CI runs EMBER_FUZZ_BATCH_FILES=30 files
of up to 24 lines; a long run:
`EMBER_FUZZ_BATCH_FILES=500 pytest -q -s -m reliability tests/e2e/test_fuzz_batch.py`.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.cli import main
from tests.coreproc.client.test_batch import engine_flags
from tests.wire_fuzz import FUZZ, Tally

pytestmark = pytest.mark.reliability

FILES = int(os.environ.get("EMBER_FUZZ_BATCH_FILES", "30"))
URLS = ["/v1/completions", "/v1/chat/completions"]
LINE_CODES = {
    "invalid_json",
    "invalid_line",
    "missing_custom_id",
    "duplicate_custom_id",
    "invalid_method",
    "invalid_url",
    "missing_body",
}

json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=12),
    ),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
# raw JSON text that is not plain JSON, or that strains the parser
odd_literals = st.sampled_from(
    ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" * 400, '"\\ud800"', '"\\udfff x"', "nul"]
)
BODY_FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "logprobs",
    "echo",
    "stream",
    "model",
    "logit_bias",
    "priority",
    "response_format",
]


def good_body(i: int) -> dict:
    return {"prompt": f"hello {i}", "max_tokens": 2, "temperature": 0}


def good_line(cid: str, i: int) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": good_body(i)}


@st.composite
def bad_line(draw: st.DrawFn, cid: str, earlier: list[str]) -> bytes:
    """One line that is wrong in one way (its custom_id, when it has one, is `cid`)."""
    kind = draw(st.sampled_from(["value", "field", "body", "literal", "bytes", "cut", "long", "dup"]))
    line: object
    if kind == "value":  # any JSON value at all
        line = draw(json_values)
    elif kind == "field":  # one top-level field replaced by anything (or dropped)
        line = good_line(cid, 0)
        name = draw(st.sampled_from(["custom_id", "method", "url", "body"]))
        if draw(st.booleans()):
            line[name] = draw(json_values | st.sampled_from(["GET", "post", *URLS]))
        else:
            del line[name]
    elif kind == "body":  # one body field of the wrong type or out of range
        body: dict = good_body(0)
        body[draw(st.sampled_from(BODY_FIELDS))] = draw(json_values)
        url = draw(st.sampled_from(URLS))
        line = {"custom_id": cid, "method": "POST", "url": url, "body": body}
    elif kind == "literal":  # a literal msgspec (and JSON) refuses, somewhere in a line
        where = draw(st.sampled_from(["custom_id", "max_tokens", "temperature", "line"]))
        lit = draw(odd_literals)
        text = json.dumps(good_line(cid, 0))
        target = {"custom_id": f'"{cid}"', "max_tokens": "2", "temperature": "0"}.get(where)
        return (text.replace(target, lit, 1) if target else lit).encode()
    elif kind == "bytes":  # invalid UTF-8 inside a string, or noise
        raw = draw(st.binary(min_size=1, max_size=40)).replace(b"\n", b" ")
        if draw(st.booleans()):
            return raw
        return json.dumps(good_line(cid, 0)).encode().replace(b"hello", b"he\xff\xfe" + raw[:4], 1)
    elif kind == "cut":  # a good line cut short
        text = json.dumps(good_line(cid, 0))
        return text[: draw(st.integers(1, len(text) - 1))].encode()
    elif kind == "long":  # a very long prompt, or a long custom_id
        line = good_line(cid, 0)
        if draw(st.booleans()):
            line["body"]["prompt"] = "word " * draw(st.integers(2_000, 20_000))
        else:
            line["custom_id"] = cid + "x" * draw(st.integers(1_000, 100_000))
    else:  # a custom_id an earlier line used
        line = good_line(draw(st.sampled_from(earlier)) if earlier else cid, 1)
    return json.dumps(line, ensure_ascii=draw(st.booleans())).encode()


@st.composite
def batch_file(draw: st.DrawFn) -> list[tuple[str, str | None, bytes]]:
    """Lines as (what, custom_id it was built with, bytes): what is "good", "bad" or "blank"."""
    lines: list[tuple[str, str | None, bytes]] = []
    used: list[str] = []
    for i in range(draw(st.integers(1, 24))):
        what = draw(st.sampled_from(["good", "good", "bad", "bad", "bad", "blank"]))
        cid = f"{what}-{i}"
        if what == "good":
            lines.append((what, cid, json.dumps(good_line(cid, i)).encode()))
            used.append(cid)
        elif what == "bad":
            lines.append((what, cid, draw(bad_line(cid, used))))
        else:
            lines.append((what, None, draw(st.sampled_from([b"", b"   ", b"\t", b"\r"]))))
    return lines


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> str:
    return str(make_ckpt("llama"))


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    for line in Tally.summary():
        print(line)


def line_custom_id(raw: bytes) -> object:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return obj.get("custom_id") if isinstance(obj, dict) else None


def check(lines: list[tuple[str, str | None, bytes]], records: list[dict]) -> None:
    """Every good line one 200 record, every other non-blank line one record, nothing else."""
    nonblank = [(n, what, cid, raw) for n, (what, cid, raw) in enumerate(lines, 1) if raw.strip()]
    assert len(records) == len(nonblank), f"{len(records)} records for {len(nonblank)} lines"
    line_errors = {}
    for r in records:
        if r["response"] is None:
            assert r["error"]["code"] in LINE_CODES, r
            prefix = r["error"]["message"].split(":", 1)[0]
            assert prefix not in line_errors, f"two line errors for {prefix}"
            line_errors[prefix] = r
    answered = Counter(r["custom_id"] for r in records if r["response"] is not None)
    assert all(n == 1 for n in answered.values()), f"a custom_id answered twice: {answered}"
    responses = {r["custom_id"]: r["response"] for r in records if r["response"] is not None}
    for n, what, cid, raw in nonblank:
        err = line_errors.pop(f"line {n}", None)
        if what == "good":
            assert err is None and responses.pop(cid)["status_code"] == 200, f"good line {n}"
            continue
        if err is not None:
            assert err["custom_id"] is None or isinstance(err["custom_id"], str)
            continue
        got = line_custom_id(raw)
        assert got in responses, f"line {n} ({got!r}) has no record"
        status = responses.pop(got)["status_code"]
        assert status in (200, 400), f"line {n} answered {status}"
    assert not line_errors and not responses, f"records for no line: {line_errors} {responses}"


@given(lines=batch_file())
@settings(FUZZ, max_examples=FILES)
def test_each_line_gets_one_record(ckpt, tmp_path_factory, lines):
    Tally.add("batch lines")
    folder = tmp_path_factory.mktemp("fuzzbatch")
    src, out = folder / "in.jsonl", folder / "out.jsonl"
    src.write_bytes(b"".join(raw + b"\n" for _, _, raw in lines))
    assert main(["batch", "-i", str(src), "-o", str(out), *engine_flags(ckpt)]) == 0
    records = [json.loads(x) for x in Path(out).read_bytes().splitlines()]
    check(lines, records)


def test_a_url_of_the_wrong_type_fails_its_line_only(ckpt, tmp_path):
    """A line whose url was a JSON object or array raised TypeError (unhashable) in the URL lookup,
    which stopped the whole run with exit 1 instead of writing an error record for that line."""
    lines = [("good", "good-0", json.dumps(good_line("good-0", 0)).encode())]
    for i, url in enumerate([{"-q": ""}, ["/v1/completions"], 3], 1):
        bad = {**good_line(f"bad-{i}", i), "url": url}
        lines.append(("bad", f"bad-{i}", json.dumps(bad).encode()))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(b"".join(raw + b"\n" for _, _, raw in lines))
    assert main(["batch", "-i", str(src), "-o", str(out), *engine_flags(ckpt)]) == 0
    records = [json.loads(x) for x in out.read_bytes().splitlines()]
    check(lines, records)
    assert sorted(r["error"]["code"] for r in records if r["error"]) == ["invalid_url"] * 3
