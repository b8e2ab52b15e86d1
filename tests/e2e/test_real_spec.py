"""Speculative decoding on the real Qwen2.5-Coder pair: greedy tokens equal those of plain decoding.

Target Qwen2.5-Coder-1.5B-Instruct, draft Qwen2.5-Coder-0.5B-Instruct, both the shipped Q4_K_M GGUF
files read directly (`tools/real_models.py` fetches them on first use). The prompts are the code
workloads of `ember bench latency` (function headers to complete, and one short rewrite request).
n-gram and draft-model speculation, batch 1 and batch 8: each request's greedy tokens equal the
target's alone. A verification step multiplies more rows at once than a plain step, and the GGUF
integer-dot kernels may round the last bits of other row counts apart, so a request may part from
the plain run only where the plain run's top-2 logprobs are within `TIE` (a near-tie), counted and
printed (how many depends on the CPU); every other token must be equal. Adaptive plans follow the
step times (a fake clock here, so the plans are the same on every CPU) and the tokens do not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from coreproc import LLM, SamplingParams
from frontend.bench.workloads import COMPLETIONS, REWRITE_ASK, chat_prompt

pytestmark = pytest.mark.real


@pytest.fixture(scope="module", autouse=True)
def native(native_kernels: None) -> None:
    """The pair on the GGUF integer-dot kernels, also in a suite run with EMBER_CPU_KERNELS=torch: the
    torch references would dequantize both models to float32 (about 20 GB with the draft)."""


NEW_TOKENS = 16
TIE = 1e-3
SHORT_FUNCTION = (
    "def area(w, h):\n    if w < 0 or h < 0:\n        raise ValueError('negative side')\n    return w * h\n"
)


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path]:
    from tools.real_models import DEFAULT_CACHE, MODELS, fetch

    return fetch(MODELS["qwen-1.5b"], DEFAULT_CACHE), fetch(MODELS["qwen-0.5b"], DEFAULT_CACHE)


def run(target: Path, prompts: list, batch: int, spec: dict | None) -> list[tuple[list[int], list]]:
    return run_with_stats(target, prompts, batch, spec)[0]


def run_with_stats(
    target: Path, prompts: list, batch: int, spec: dict | None
) -> tuple[list[tuple[list[int], list]], Any]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=2)
    config = json.dumps(spec) if spec else None
    with LLM(str(target), show_progress=False, max_model_len=1024, speculative_config=config) as llm:
        outs = []
        for i in range(0, len(prompts), batch):
            outs += llm.generate(prompts[i : i + batch], params, use_tqdm=False)
        stats = llm.stats()
        if spec:
            assert stats.spec_num_accepted > 0
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], stats


def near_tie_partings(plain: list, got: list) -> int:
    """How many prompts part from the plain run; each must part where the plain run's top two
    logprobs are within TIE, and stop at the plain run's length otherwise."""
    ties = 0
    for i, ((want, lps), (tokens, _)) in enumerate(zip(plain, got, strict=True)):
        same = next((j for j, (a, b) in enumerate(zip(want, tokens)) if a != b), None)
        if same is None:
            assert len(tokens) == len(want), f"prompt {i}: stopped at a different length"
            continue
        top = sorted((lp.logprob for lp in lps[same].values()), reverse=True)
        assert top[0] - top[1] < TIE, f"prompt {i}, token {same}: {tokens[same]} instead of {want[same]}"
        ties += 1
    return ties


@pytest.fixture(scope="module")
def prompts(pair: tuple[Path, Path]) -> list:
    with LLM(str(pair[1]), show_progress=False, max_model_len=256) as llm:  # the tokenizer is shared
        rewrite = chat_prompt(llm.tokenizer, f"{REWRITE_ASK}\n\n```python\n{SHORT_FUNCTION}```")
    return [rewrite, *(c for c in COMPLETIONS[:7])]


@pytest.fixture(scope="module")
def plain(pair: tuple[Path, Path], prompts: list) -> dict[int, list]:
    return {batch: run(pair[0], prompts, batch, None) for batch in (1, 8)}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("batch", [1, 8])
def test_speculation_keeps_the_greedy_tokens(pair, prompts, plain, method: str, batch: int) -> None:
    spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False}  # verify every step
    if method == "draft_model":
        spec["model"] = str(pair[1])
    ties = near_tie_partings(plain[batch], run(pair[0], prompts, batch, spec))
    # how many prompts meet a near-tie depends on how this CPU's kernels round: printed, not asserted
    print(
        f"{method} batch {batch}: {len(prompts) - ties} of {len(prompts)} identical, {ties} near-tie partings"
    )


def test_plans_follow_the_step_times_and_the_tokens_do_not(pair, prompts, plain, monkeypatch) -> None:
    """Adaptive draft plans are chosen from the step times the engine measures, which differ by CPU
    and load. A fake clock says the draft model costs a twentieth of a target step in one run and as
    much as one in the other: the plans differ (counted from the fake times alone, so the counts are
    the same on every CPU), the greedy tokens do not."""
    from coreproc.core.ngram import StepCost

    record, record_draft = StepCost.record, StepCost.record_draft

    def step_seconds(tokens: int) -> float:
        return 0.1 + 0.002 * tokens  # a CPU's decode step: the weights read once, a little per token

    spec = {"method": "draft_model", "model": str(pair[1]), "num_speculative_tokens": 4}
    proposed = {}
    for share in (0.05, 1.0):
        monkeypatch.setattr(StepCost, "record", lambda self, t, _s: record(self, t, step_seconds(t)))
        monkeypatch.setattr(
            StepCost,
            "record_draft",
            lambda self, fw, share=share: record_draft(self, [(t, share * step_seconds(t)) for t, _ in fw]),
        )
        got, stats = run_with_stats(pair[0], prompts, 8, spec)
        ties = near_tie_partings(plain[8], got)
        proposed[share] = stats.spec_num_proposed
        kept = f"{stats.spec_num_accepted}/{stats.spec_num_proposed}"
        print(f"draft at {share} of a step: {kept} proposals kept, {ties} near-tie partings")
    assert proposed[0.05] != proposed[1.0], "the plans should follow the step times"
