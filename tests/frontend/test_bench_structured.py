"""`ember bench throughput --structured` (frontend/bench/throughput.py): one real in-process run on a tiny
checkpoint through the CLI, checked via --result-json: a free and a constrained run of equal work, and the
constraint's per-step overhead; plus the constraints' sizing, which must outlast `--output-len`.

Run: `pytest -q tests/frontend/test_bench_structured.py`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from frontend.bench.throughput import structured_spec
from frontend.cli import main

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("kind", ["json-schema", "regex"])
def test_constraint_outlasts_the_output(kind: str) -> None:
    spec = structured_spec(kind, 16)
    assert spec is not None
    if kind == "json-schema":
        assert json.loads(spec.spec)["minItems"] >= 16
    else:  # 16 one-digit integers (31 tokens at least) do not complete it; 17 do
        assert not re.fullmatch(spec.spec, ",".join(["1"] * 16))
        assert re.fullmatch(spec.spec, ",".join(["1"] * 17))
    assert structured_spec("none", 16) is None


def test_json_schema_overhead(make_ckpt, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "throughput.json"
    argv = [
        "bench", "throughput", "--model", str(make_ckpt("llama")), "--dtype", "float32",
        "--mode", "inproc", "--num-prompts", "2", "--input-len", "8", "--output-len", "16",
        "--structured", "json-schema", "--result-json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    free, constrained = json.loads(out.read_text())
    assert (free["mode"], constrained["mode"]) == ("inproc", "inproc")
    assert (free["structured"], constrained["structured"]) == ("none", "json-schema")
    assert free["output_tokens"] == constrained["output_tokens"] == 2 * 16
    assert free["prompt_tokens"] == constrained["prompt_tokens"] == 2 * 8
    assert free["steps"] > 0 and constrained["steps"] > 0
    assert free["overhead_ms_per_step"] is None and free["overhead_pct"] is None
    assert constrained["free_ms_per_step"] == pytest.approx(free["ms_per_step"])
    extra = constrained["ms_per_step"] - free["ms_per_step"]
    assert constrained["overhead_ms_per_step"] == pytest.approx(extra)
    assert constrained["overhead_pct"] == pytest.approx(100 * extra / free["ms_per_step"])
    text = capsys.readouterr().out
    assert "summary: json-schema constraint at batch 2" in text and "% of the free" in text
