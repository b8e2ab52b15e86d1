"""Speculative decoding (n-gram): the proposer, the scheduler's bookkeeping, and outputs against the
engine without speculation — greedy and seeded token for token, stop conditions inside an accepted
run, and a chi-square test that unseeded sampling keeps the target distribution.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections import Counter

import pytest

from coreproc import LLM, SamplingParams
from coreproc.base.config import ConfigError, EngineConfig, SpeculativeConfig
from coreproc.base.protocol import EngineRequest, RunnerOutput, TokenLogprobs
from coreproc.core.ngram import (
    DraftCandidate,
    DraftPause,
    ProposalLength,
    SpecStats,
    StepCost,
    plan_drafts,
    propose_ngram,
)
from coreproc.core.scheduler import Scheduler
from tests.paths import ASSETS
from tests.sched_util import fake_runner_output, make_config
from workers.draft import DraftState

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
NGRAM_FIXED = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "adaptive": false}'


@pytest.mark.unit
def test_ngram_proposer():
    assert propose_ngram([1, 2, 3, 4, 1, 2], k=3, n_min=1, n_max=3) == [3, 4, 1]
    assert propose_ngram([5, 1, 2, 9, 1, 2, 7, 1, 2], k=2, n_min=1, n_max=2) == [7, 1]  # the latest match
    assert propose_ngram([1, 2, 3], k=3, n_min=1, n_max=3) == []
    assert propose_ngram([7, 7, 7], k=2, n_min=1, n_max=2) == [7]  # overlapping occurrence
    assert propose_ngram([4, 9, 1, 4, 2, 1], k=2, n_min=2, n_max=3) == []  # only 1-grams match
    stats = SpecStats()
    stats.record(3, 1)
    stats.record(2, 2)
    stats.record(0, 0)
    d = stats.as_dict()
    assert (d["spec_num_drafts"], d["spec_num_proposed"], d["spec_num_accepted"]) == (2, 5, 3)
    assert d["spec_accepted_per_position"] == [2, 1, 0] and d["spec_proposed_per_position"] == [2, 2, 1]
    assert d["spec_mean_accepted_length"] == 2.5


@pytest.mark.unit
def test_config_parsing():
    assert SpeculativeConfig.parse(NGRAM).num_speculative_tokens == 4
    for bad, msg in (
        ("{", "not valid JSON"),
        ('{"method": "x"}', "unknown speculative method"),
        ('{"k": 1}', "unknown speculative-config key"),
        ('{"num_speculative_tokens": 0}', r"in \[1, 16\]"),
    ):
        with pytest.raises(ConfigError, match=msg):
            SpeculativeConfig.parse(bad)


@pytest.mark.unit
def test_scheduler_verifies_proposals_and_rolls_back_rejected_ones():
    sched = Scheduler(make_config(budget=64, spec_k=3), num_kv_blocks=40)
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    sched.add_request(
        EngineRequest(request_id="a", prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=20))
    )
    out = sched.schedule()
    sched.update_from_output(out, RunnerOutput(["a"], [[5]], [[TokenLogprobs([5], [0.0], 1)]]))
    req = sched.requests["a"]
    assert req.spec_token_ids == [6, 3, 4]  # ... 3 4 5 -> what followed "4 5" before
    out = sched.schedule()
    assert out.spec_token_ids == {"a": [6, 3, 4]} and out.num_scheduled_tokens == {"a": 4}
    assert req.num_computed_tokens == 11 + 3
    # the target keeps 6 and 3, then says 9: three tokens come out, KV for one proposal is recomputed
    lps = [[TokenLogprobs([t], [0.0], 1) for t in (6, 3, 9)]]
    (o,) = sched.update_from_output(out, RunnerOutput(["a"], [[6, 3, 9]], lps))
    assert o.new_token_ids == [6, 3, 9] and req.num_computed_tokens == req.num_tokens - 1 == 13
    assert sched.stats().spec_num_accepted == 2 and sched.stats().spec_num_proposed == 3
    rng = random.Random(0)
    while sched.has_unfinished_requests():  # proposals never run past max_tokens
        out = sched.schedule()
        sched.update_from_output(out, fake_runner_output(sched, out, rng))
    assert sched.kv.num_blocks_in_use() == 0


@pytest.mark.unit
def test_proposal_length_weighs_acceptance_against_cost():
    """k maximizes expected tokens per unit of step time: long proposals while they hold and verifying
    is cheap, shorter ones as tokens cost more, none once proposals fail (an n-gram request keeps
    checking its would-be proposal, and a paused one drifts back to the prior)."""
    length = ProposalLength(5)
    assert length.acceptance == 0.5 and length.choose(0.01) == 5
    assert length.choose(0.3) == 1  # expensive verification at the prior acceptance
    for _ in range(10):
        length.update(5, 5)
    assert length.acceptance > 0.95 and length.choose(0.1) == 5
    for _ in range(60):
        length.update(5, 0)
    assert length.acceptance < 0.01 and length.choose(0.03) == 0
    assert length.take([7, 8], 0.03) == [] and length.guess == 7
    length.observe(7)  # its would-be proposal came true: worth proposing again
    assert length.take([7, 8], 0.03) == [7]
    for _ in range(400):
        length.relax()
    assert length.acceptance == pytest.approx(0.5, abs=0.02)
    fixed = ProposalLength(3, adaptive=False)
    for _ in range(5):
        fixed.update(3, 0)
    assert fixed.choose(0.5) == 3


@pytest.mark.unit
def test_step_cost_fits_the_steps():
    cost = StepCost()
    assert cost.verify_share() == 0.05  # the prior, before any step
    narrow = StepCost()
    for tokens in (8, 9, 8, 10, 9, 8):  # close sizes: the slope is shrunk toward zero
        narrow.record(tokens, 0.1 + 0.004 * tokens)
    assert 0 < (narrow.steps.fit()[2] or 0) < 0.002
    for tokens in (1, 26, 12, 40, 1, 33, 20):  # spread: the fit is close to the line
        cost.record(tokens, 0.1 + 0.004 * tokens)
    assert cost.verify(8) == pytest.approx(0.004, rel=0.05)
    assert cost.step(8) == pytest.approx(0.132, rel=0.05)
    for requests in (1, 4):  # each request owns 1 / requests of their plain step
        share = cost.step(requests) / requests
        assert cost.verify_share(requests) == pytest.approx(cost.verify(requests) / share)
    cost.record_draft([(1, 0.02), (3, 0.024), (2, 0.022)])  # a line: 0.018 s + 0.002 s a token
    assert 0.0215 < cost.draft.at(4) < 0.026  # tokens 1-3: a narrow spread, shrunk toward flat


def planned(
    acceptance: list[float], lags: list[int], draft: tuple[float, float], k_max: int = 4
) -> list[int]:
    """plan_drafts over requests of these acceptances and lags, for a target step of 0.16 s + 3 ms a
    token and a draft forward of draft[0] s + draft[1] s a token."""
    cost = StepCost()
    for tokens in (8, 30, 12, 22, 8, 16):
        cost.record(tokens, 0.16 + 0.003 * tokens)
    for tokens in (1, 40, 8, 16, 4, 100):
        cost.record_draft([(tokens, draft[0] + draft[1] * tokens)])
    cands = []
    for a, lag in zip(acceptance, lags):
        length = ProposalLength(k_max, kept=a * 100, trials=100)
        cands.append(DraftCandidate(length, lag, horizon=32))
    return plan_drafts(cands, len(cands), cost)


@pytest.mark.unit
def test_draft_plans_weigh_the_batch():
    """The draft's proposal lengths are chosen for the step's requests together: a draft forward's
    fixed cost is shared by those that propose, a paused request's catch-up is priced, and where no
    plan beats plain decoding nobody proposes (so the draft runs no forward at all)."""
    assert planned([0.9], [0], (0.01, 0.0005)) == [4]  # batch 1, a cheap draft: propose far
    # batch 8: a draft forward of 28 ms + 3 ms a token pays for the ones that accept well
    ks = planned([0.9] * 6 + [0.2, 0.1], [0] * 8, (0.028, 0.003))
    assert ks[:6] == [ks[0]] * 6 and ks[0] > 0 and ks[6:] == [0, 0]
    # the same draft, but proposals of one in three kept: nothing beats plain decoding
    assert planned([0.35] * 8, [0] * 8, (0.028, 0.003)) == [0] * 8
    # one request alone would not pay the draft's fixed cost that eight share
    assert planned([0.9] + [0.0] * 7, [0] * 8, (0.06, 0.003)) == [0] * 8
    # a long paused request's catch-up is priced: the others propose without it
    ks = planned([0.9] * 4, [0, 0, 0, 4000], (0.028, 0.003))
    assert ks[3] == 0 and ks[0] > 0
    pause, cands = DraftPause(), [DraftCandidate(ProposalLength(4), lag, 32) for lag in (9, 3, 5)]
    probes = [pause.probe(cands, [0, 0, 0]) for _ in range(40)]
    assert [i for i, ks in enumerate(probes) if any(ks)] == [0, 2, 6, 14, 30]  # after 1, 2, 4 ... idle steps
    assert all(ks in ([0, 0, 0], [0, 1, 0]) for ks in probes)  # the one with the shortest catch-up
    assert pause.probe(cands, [2, 0, 0]) == [2, 0, 0] and pause.backoff == 1  # a plan resets the pause
    cold = ProposalLength(4)
    assert plan_drafts([DraftCandidate(cold, 10, 32)], 1, StepCost()) == [cold.choose(0.05)]  # untimed


@pytest.mark.unit
def test_draft_state_keeps_the_proposals_the_target_kept():
    """The draft's KV holds positions < computed plus its pending proposals; settle keeps those the
    request's tokens confirm, short of the last token (the next forward starts from it)."""
    tokens = [1, 2, 3, 4, 5, 6]
    state = DraftState(computed=3, pending=[4, 5, 9])
    assert state.settle(tokens.__getitem__, len(tokens)) == 5 and state.pending == []
    state = DraftState(computed=3, pending=[4, 7])
    assert state.settle(tokens.__getitem__, len(tokens)) == 4  # 7 was rejected
    state = DraftState(computed=3, pending=[4])
    assert state.settle(tokens.__getitem__, 4) == 3  # token 4 is the last: it is fed again


@pytest.mark.unit
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_rejected_proposals_pause_speculation(method: str):
    """When the target never keeps a proposal, the adaptive scheduler soon stops proposing (a draft
    model is asked for none but now and then, as its estimate drifts back to the prior); without
    adaptation it proposes k each step."""
    proposed = {}
    for adaptive in (True, False):
        config = make_config(budget=64, spec_k=4, spec_method=method)
        spec = dataclasses.replace(config.speculative, adaptive=adaptive)
        sched = Scheduler(dataclasses.replace(config, speculative=spec), num_kv_blocks=200)
        prompt = [3, 4, 5, 6] * 6  # n-gram always finds a continuation
        params = SamplingParams(max_tokens=120, ignore_eos=True)
        sched.add_request(EngineRequest(request_id="a", prompt_token_ids=prompt, sampling_params=params))
        asked = []
        while sched.has_unfinished_requests():
            out = sched.schedule()
            asked.append(out.draft_lengths.get("a", 4))
            req = sched.requests["a"]
            spec_tokens = out.spec_token_ids.get("a", [])
            if out.num_scheduled_tokens.get("a", 0) == 0:
                continue
            samples = (
                req.num_computed_tokens - len(spec_tokens) == req.num_tokens + req.num_output_placeholders - 1
            )
            guess = req.proposal_length.guess if req.proposal_length else None
            avoid = spec_tokens[0] if spec_tokens else 3 if method == "draft_model" else guess
            token = next(t for t in (3, 4, 5, 6) if t != avoid)  # never what was (or would be) proposed
            toks = [token] if samples else []
            drafted = {"a": [3] * asked[-1]} if method == "draft_model" and toks else {}
            lps = [[TokenLogprobs([t], [0.0], 1) for t in toks]]
            timing = dict(
                forward_seconds=0.1 + 0.004 * out.total_num_scheduled_tokens,
                draft_seconds=0.02 * asked[-1],
                draft_forwards=[(1, 0.02)] * asked[-1],
            )
            result = RunnerOutput(["a"], [toks], lps, spec_token_ids=drafted, **timing)
            sched.update_from_output(out, result)
        proposed[adaptive] = sched.stats().spec_num_proposed
        assert sched.stats().spec_num_accepted == 0
        if adaptive and method == "draft_model":
            assert asked.count(0) > len(asked) / 2  # paused most of the time
    assert proposed[False] > 300 and proposed[True] < 50, proposed  # mostly the first few steps


@pytest.fixture(scope="module")
def llama(make_ckpt) -> str:
    return str(make_ckpt("llama"))


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 60) for _ in range(5)] * (2 + i % 3) for i in range(n)]


@pytest.mark.model
@pytest.mark.parametrize("batch", [1, 4, 10])
@pytest.mark.parametrize(
    "setup", [{}, {"max_num_batched_tokens": 16}, {"num_kv_blocks": 6, "block_size": 8, "max_model_len": 48}]
)
def test_greedy_and_seeded_outputs_equal_no_speculation(llama, batch, setup, steady_step_costs):
    prompts = repetitive_prompts(batch)
    runs = {}
    for spec in (None, NGRAM):
        with LLM(llama, dtype="float32", show_progress=False, speculative_config=spec, **setup) as llm:
            greedy = llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=20, logprobs=1), use_tqdm=False
            )
            seeded = llm.generate(
                prompts, SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=20), use_tqdm=False
            )
            runs[spec] = (greedy, seeded, llm.stats())
    (g0, s0, _), (g1, s1, stats) = runs[None], runs[NGRAM]
    assert [o.outputs[0].token_ids for o in g1] == [o.outputs[0].token_ids for o in g0]
    assert [o.outputs[0].token_ids for o in s1] == [o.outputs[0].token_ids for o in s0]
    for a, b in zip(g0, g1):
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tid, lp in pa.items():
                assert abs(lp.logprob - pb[tid].logprob) < 1e-4
    assert stats.spec_num_proposed > 0 and stats.spec_num_accepted > 0
    assert stats.num_blocks_in_use == 0


BUNDLED = ASSETS
DRAFT = json.dumps(
    {"method": "draft_model", "model": str(BUNDLED / "default_draft"), "num_speculative_tokens": 3}
)


@pytest.mark.model
@pytest.mark.parametrize(
    "setup", [{}, {"max_num_batched_tokens": 16}, {"num_kv_blocks": 10, "block_size": 8, "max_model_len": 64}]
)
def test_draft_model_outputs_equal_no_speculation(setup, steady_step_costs):
    """The bundled matched pair: greedy and seeded tokens equal the target alone (chunked prefill and
    preemption included), and the draft's proposals are accepted often."""
    prompts = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):"] * 2
    runs = {}
    for spec in (None, DRAFT):
        with LLM(
            str(BUNDLED / "default_model"), show_progress=False, speculative_config=spec, **setup
        ) as llm:
            greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
            seeded = llm.generate(
                prompts, SamplingParams(temperature=0.9, seed=11, max_tokens=16, ignore_eos=True)
            )
            runs[spec] = ([o.outputs[0].token_ids for o in greedy], [o.outputs[0].token_ids for o in seeded])
            stats = llm.stats()
    assert runs[DRAFT] == runs[None]
    assert stats.spec_acceptance_rate > 0.2 and stats.num_blocks_in_use == 0


@pytest.mark.model
def test_draft_config_is_checked(make_ckpt):
    other = make_ckpt("llama", vocab=300)
    bad = {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="vocabulary"):
        EngineConfig.create(
            str(BUNDLED / "default_model"), max_model_len=512, speculative_config=json.dumps(bad)
        )
    with pytest.raises(ConfigError, match="needs"):
        SpeculativeConfig.parse('{"method": "draft_model"}')


@pytest.mark.model
def test_stops_inside_an_accepted_run(llama):
    prompt = repetitive_prompts(1)[0]
    with LLM(llama, dtype="float32", show_progress=False) as plain:
        ref = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[
            0
        ].outputs[0]
    ids, text = ref.token_ids, ref.text
    stop_id = ids[9]
    first = ids.index(stop_id)
    cut = text[len(text) // 2 : len(text) // 2 + 2]
    with LLM(llama, dtype="float32", show_progress=False, speculative_config=NGRAM) as llm:
        by_id = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]))
        assert by_id[0].outputs[0].token_ids == ids[: first + 1]
        by_text = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=[cut]))[0].outputs[
            0
        ]
        assert by_text.text == text[: text.index(cut)]
        with LLM(llama, dtype="float32", show_progress=False) as plain:
            ref_stop = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=[cut]))[
                0
            ].outputs[0]
        assert by_text.token_ids == ref_stop.token_ids  # no token past the stop string
        short = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
        assert short.token_ids == ids[:3]


@pytest.mark.model
def test_unseeded_sampling_keeps_the_target_distribution(llama):
    """Two-sample chi-square over a 4-token vocabulary (allowed_token_ids): the tokens at each of the
    first positions are distributed alike with and without speculation."""
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]
    allowed = [7, 8, 9, 10]
    params = SamplingParams(temperature=1.5, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed)
    counts = {}
    for spec in (None, NGRAM_FIXED):  # a fixed k: 600 requests at once would make proposals not pay
        with LLM(llama, dtype="float32", show_progress=False, speculative_config=spec, seed=3) as llm:
            outs = llm.generate([prompt] * 600, params, use_tqdm=False)
            counts[spec] = [Counter(o.outputs[0].token_ids[pos] for o in outs) for pos in range(6)]
            if spec:
                assert llm.stats().spec_num_accepted > 100
    for pos in range(1, 6):
        a, b = counts[None][pos], counts[NGRAM_FIXED][pos]
        chi2 = 0.0
        for t in allowed:
            total = a[t] + b[t]
            if total:
                expect = total / 2  # equal sample sizes
                chi2 += (a[t] - expect) ** 2 / expect + (b[t] - expect) ** 2 / expect
        assert chi2 < 16.27, (pos, a, b)  # df = 3, p = 0.001


@pytest.mark.e2e
def test_served_with_speculation(llama):
    """Over HTTP (core and worker processes): the same greedy text as the offline engine without
    speculation, and the acceptance counters in /metrics."""
    import httpx

    from tests.server_util import metric, start_server, stop_server

    prompts = repetitive_prompts(3, seed=5)
    with LLM(llama, dtype="float32", show_progress=False) as plain:
        ref = [
            o.outputs[0].text for o in plain.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
        ]
    proc, url = start_server(llama, "--speculative-config", NGRAM_FIXED)  # counters from tokens alone
    try:
        for prompt, expect in zip(prompts, ref):
            body = {"model": "llama", "prompt": prompt, "max_tokens": 16, "temperature": 0}
            assert (
                httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
                == expect
            )
        # engine stats reach /metrics every second: a scrape may still show an earlier request's counts
        deadline = time.monotonic() + 30  # a wait, not a bound: a loaded host may take longer
        while metric(url, "ember_spec_decode_num_accepted_tokens_total") == 0:
            assert time.monotonic() < deadline, "no accepted draft tokens reached /metrics"
            time.sleep(0.2)
        assert metric(url, "ember_spec_decode_num_draft_tokens_total") > 0
        assert 0 < metric(url, "ember_spec_decode_acceptance_rate") <= 1
    finally:
        stop_server(proc)
