"""Property tests of the scheduler and KV block manager (pure CPU, no model).

Hypothesis draws arrivals, prompt and output lengths, priorities, shared prefixes and aborts; a step
loop plays the workers' part by sampling a token for every request whose computed tokens caught up.
Every step must respect the token budget and seat limit, keep block accounting exact, and every run
must finish with zero blocks in use. Run: `pytest -q tests/coreproc/core/test_scheduler.py`.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coreproc.base.errors import InvalidParam
from coreproc.base.protocol import EngineRequest, RunnerOutput, SamplingParams, TokenLogprobs
from coreproc.core.scheduler import Scheduler
from tests.sched_util import (
    EOS,
    MIXED,
    SLIDING,
    VOCAB,
    Controls,
    StuckExecutor,
    fake_runner_output,
    make_config,
    run_workload,
)

pytestmark = pytest.mark.unit

request_strategy = st.tuples(
    st.integers(0, 6),  # arrival step
    st.integers(1, 40),  # prompt length
    st.integers(1, 40),  # max tokens
    st.integers(0, 3),  # priority
    st.sampled_from([None, 0, 1]),  # shared prefix family (prefix-cache hits)
    st.one_of(st.none(), st.integers(0, 40)),  # abort at step
    st.sampled_from([None, None, "a", "b"]),  # tenant cache salt
)


@st.composite
def controls_strategy(draw) -> Controls:
    max_num_seqs = draw(st.integers(1, 8))
    return Controls(
        budget=draw(st.integers(8, 64)),
        num_blocks=draw(st.integers(16, 40)),
        max_num_seqs=max_num_seqs,
        max_num_active_seqs=draw(st.one_of(st.none(), st.integers(1, max_num_seqs))),
        long_prefill_token_threshold=draw(st.sampled_from([0, 4, 16])),
        max_num_queued_requests=draw(st.one_of(st.none(), st.integers(1, 6))),
        max_num_queued_tokens=draw(st.one_of(st.none(), st.integers(1, 120))),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        prefix=draw(st.booleans()),
        spec_k=draw(st.sampled_from([0, 0, 2, 4])),
        spec_method=draw(st.sampled_from(["ngram", "draft_model"])),
        layout=draw(st.sampled_from([None, None, SLIDING, MIXED])),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request_strategy, min_size=1, max_size=14),
    controls=controls_strategy(),
    seed=st.integers(0, 1000),
    overlap=st.booleans(),
)
def test_random_workloads_always_finish(reqs, controls, seed, overlap):
    """Under every combination of controls (speculation included): all requests finish, are aborted
    or are refused with a reason; budgets and seat limits hold; no deadlock; zero blocks in use."""
    run_workload(reqs, controls, seed, overlap and not controls.spec_k)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("prefix", [False, True])
def test_heavy_kv_pressure_preempts_and_finishes(policy, prefix, overlap):
    """Forty requests on a cache that holds about one: many preemptions, still all finish clean."""
    rng = random.Random(7)
    reqs = [
        (
            rng.randrange(0, 10),
            rng.randrange(10, 40),
            rng.randrange(10, 24),
            rng.randrange(0, 4),
            rng.choice([None, 0, 1]),
            rng.choice([None, None, None, rng.randrange(0, 200)]),
            None,
        )
        for _ in range(40)
    ]
    controls = Controls(budget=48, num_blocks=18, max_num_seqs=8, policy=policy, prefix=prefix)
    sched = run_workload(reqs, controls, seed=1, overlap=overlap).sched
    assert sched.counters.num_preemptions >= 10
    if prefix:
        assert sched.kv.hits > 0


def test_preemption_frees_and_resumes():
    """Two long requests on a cache that fits one: the later one is preempted, both finish."""
    sched = Scheduler(make_config(budget=64, block_size=4, max_model_len=40), num_kv_blocks=12)
    for rid in ("a", "b"):
        sched.add_request(
            EngineRequest(
                request_id=rid,
                prompt_token_ids=list(range(2, 22)),
                sampling_params=SamplingParams(max_tokens=18, ignore_eos=True),
                eos_token_ids=[EOS],
            )
        )
    rng = random.Random(0)
    done = {}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for o in sched.update_from_output(out, fake_runner_output(sched, out, rng)):
            if o.finished:
                done[o.request_id] = o.finish_reason
    assert done == {"a": "length", "b": "length"}
    assert sched.counters.num_preemptions >= 1
    assert sched.kv.num_blocks_in_use() == 0


def test_priority_policy_admits_urgent_first():
    sched = Scheduler(make_config(budget=8, max_num_seqs=1, policy="priority"), num_kv_blocks=40)
    for rid, prio in (("low", 5), ("high", 0)):
        sched.add_request(
            EngineRequest(
                request_id=rid, prompt_token_ids=[3, 4, 5], sampling_params=SamplingParams(), priority=prio
            )
        )
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["high"]


def test_prefix_cache_hit_skips_computed_blocks():
    sched = Scheduler(make_config(budget=64, block_size=4), num_kv_blocks=40)
    prompt = list(range(2, 20))  # 18 tokens: 4 full blocks
    rng = random.Random(0)
    sched.add_request(
        EngineRequest(request_id="a", prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1))
    )
    out = sched.schedule()
    sched.update_from_output(out, fake_runner_output(sched, out, rng))
    sched.add_request(
        EngineRequest(request_id="b", prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1))
    )
    out = sched.schedule()
    assert out.new_requests[0].num_computed_tokens == 16
    assert out.num_scheduled_tokens["b"] == 2
    salted = EngineRequest(
        request_id="c",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=1),
        cache_salt="tenant",
    )
    sched.update_from_output(out, fake_runner_output(sched, out, rng))
    sched.add_request(salted)
    out = sched.schedule()
    assert out.new_requests[0].num_computed_tokens == 0, "a salted request must not hit unsalted blocks"


def test_abort_frees_blocks_at_once():
    sched = Scheduler(make_config(budget=64), num_kv_blocks=40)
    sched.add_request(
        EngineRequest(request_id="a", prompt_token_ids=list(range(2, 30)), sampling_params=SamplingParams())
    )
    sched.schedule()
    assert sched.kv.num_blocks_in_use() > 0
    (o,) = sched.abort_requests(["a"])
    assert o.finish_reason == "abort"
    assert sched.kv.num_blocks_in_use() == 0
    assert sched.schedule().finished_req_ids == ["a"]


@pytest.mark.parametrize(
    "prompt, params, param",
    [
        ([], SamplingParams(), "prompt"),
        (list(range(2, 200)), SamplingParams(), "prompt"),
        ([VOCAB + 5], SamplingParams(), "prompt"),
        ([3], SamplingParams(temperature=-1), "temperature"),
        ([3], SamplingParams(top_p=0), "top_p"),
        ([3], SamplingParams(max_tokens=0), "max_tokens"),
        ([3], SamplingParams(logprobs=99), "logprobs"),
    ],
)
def test_bad_requests_are_rejected_with_the_parameter(prompt, params, param):
    sched = Scheduler(make_config(), num_kv_blocks=40)
    with pytest.raises(InvalidParam) as err:
        sched.add_request(EngineRequest(request_id="x", prompt_token_ids=prompt, sampling_params=params))
    assert err.value.param == param
    assert not sched.requests


def drive(sched: Scheduler, script: list[int]) -> list:
    """Run until done, 'sampling' tokens from `script` in order; returns the engine outputs."""
    outputs, it = [], iter(script)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        ids, toks = [], []
        for rid in out.num_scheduled_tokens:
            req = sched.requests[rid]
            ids.append(rid)
            toks.append([next(it)] if req.num_computed_tokens == req.num_tokens else [])
        lps = [[TokenLogprobs(t, [-0.5], 1)] if t else [] for t in toks]
        outputs += sched.update_from_output(
            out, RunnerOutput(req_ids=ids, sampled_token_ids=toks, logprobs=lps)
        )
    return outputs


@pytest.mark.parametrize(
    "params, script, expect_tokens, reason, stop_reason",
    [
        (SamplingParams(max_tokens=10), [5, 6, EOS, 7], [5, 6, EOS], "stop", None),
        (SamplingParams(max_tokens=4, ignore_eos=True), [5, EOS, 6, 7, 8], [5, EOS, 6, 7], "length", None),
        (SamplingParams(max_tokens=10, min_tokens=3), [EOS, 6, EOS, 9], [EOS, 6, EOS], "stop", None),
        (SamplingParams(max_tokens=10, stop_token_ids=[9]), [5, 9, 6], [5, 9], "stop", 9),
        (SamplingParams(max_tokens=None), [5] * 20, [5] * 6, "length", None),  # max_model_len 16, prompt 10
    ],
)
def test_stop_conditions(params, script, expect_tokens, reason, stop_reason):
    sched = Scheduler(make_config(max_model_len=16), num_kv_blocks=40)
    sched.add_request(
        EngineRequest(
            request_id="a", prompt_token_ids=list(range(2, 12)), sampling_params=params, eos_token_ids=[EOS]
        )
    )
    outs = drive(sched, script)
    assert [t for o in outs for t in o.new_token_ids] == expect_tokens
    assert outs[-1].finish_reason == reason and outs[-1].stop_reason == stop_reason
    assert sched.kv.num_blocks_in_use() == 0


def test_engine_fails_requests_instead_of_spinning():
    """If scheduling ever stops making progress, queued requests fail with an error (no hang)."""
    from coreproc.base.protocol import SchedulerOutput
    from coreproc.core.engine import EngineCore

    engine = EngineCore(make_config(), StuckExecutor())
    engine.scheduler.schedule = lambda: SchedulerOutput()  # a scheduler that never admits anything
    engine.add_request(
        EngineRequest(request_id="a", prompt_token_ids=[3, 4], sampling_params=SamplingParams())
    )
    outputs = []
    for _ in range(10):
        outputs += engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "error")]
    assert not engine.has_unfinished_requests()
