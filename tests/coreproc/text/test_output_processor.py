"""The output processor: an API request's prompts x n sequences keep their choice index end to end.

Uses the tiny checkpoint's tokenizer and a stand-in engine that only records what it was given.
Run: `pytest -q tests/coreproc/text/test_output_processor.py`.
"""

from __future__ import annotations

import pytest

from coreproc.base.protocol import EngineOutput, EngineRequest, SamplingParams
from coreproc.base.tokenizer import load_tokenizer
from coreproc.text.output_processor import OutputProcessor

pytestmark = pytest.mark.unit


class RecordingEngine:
    def __init__(self) -> None:
        self.requests: list[EngineRequest] = []

    def add_requests(self, requests: list[EngineRequest]) -> None:
        self.requests += requests


@pytest.fixture(scope="module")
def tokenizer(make_ckpt):
    return load_tokenizer(str(make_ckpt("llama")))


def test_choice_index_counts_across_prompts(tokenizer):
    proc, engine = OutputProcessor(tokenizer), RecordingEngine()
    params = SamplingParams(n=2, max_tokens=1)
    proc.submit(engine, [("a", None, [1, 5], params), ("b", None, [1, 6], params)], eos_token_ids=[])
    assert [r.request_id for r in engine.requests] == ["0_a", "1_a", "0_b", "1_b"]
    outputs = [EngineOutput(r.request_id, [7], finish_reason="length") for r in reversed(engine.requests)]
    deltas, to_abort = proc.process(outputs)
    assert not to_abort
    got = [(d.request_id, d.index, d.choice_index, d.finish_reason) for d in deltas]
    assert got == [("b", 1, 3, "length"), ("b", 0, 2, "length"), ("a", 1, 1, "length"), ("a", 0, 0, "length")]
    assert [o.index for o in proc.pop_finished("b").outputs] == [0, 1]  # within its prompt
