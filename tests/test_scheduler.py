"""Property tests of the scheduler and KV block manager (pure CPU, no model).

Hypothesis draws arrivals, prompt and output lengths, priorities, shared prefixes and aborts; a step
loop plays the workers' part by sampling a token for every request whose computed tokens caught up.
Every step must respect the token budget and seat limit, keep block accounting exact, and every run
must finish with zero blocks in use. Run: `pytest -q tests/test_scheduler.py`.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coreproc.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from coreproc.protocol import EngineRequest, InvalidParam, RunnerOutput, SamplingParams, TokenLogprobs
from coreproc.request import RequestStatus
from coreproc.scheduler import Scheduler

pytestmark = pytest.mark.unit

EOS = 1
VOCAB = 50


def make_config(**kw) -> EngineConfig:
    model = ModelConfig(
        model="none",
        architecture="LlamaForCausalLM",
        dtype="float32",
        max_model_len=kw.pop("max_model_len", 128),
        vocab_size=VOCAB,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        hidden_size=8,
        tokenizer="none",
    )
    cache = CacheConfig(block_size=kw.pop("block_size", 4), enable_prefix_caching=kw.pop("prefix", True))
    sched = SchedulerConfig(
        max_num_seqs=kw.pop("max_num_seqs", 8),
        max_num_batched_tokens=kw.pop("budget", 32),
        policy=kw.pop("policy", "fcfs"),
    )
    return EngineConfig(model=model, cache=cache, scheduler=sched)


def fake_runner_output(sched: Scheduler, out, rng: random.Random) -> RunnerOutput:
    """What workers would return for a step just scheduled: a token for each request whose chunk
    reached the end of its tokens (the scheduler then holds a placeholder for it)."""
    ids, tokens, lps = [], [], []
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        ids.append(rid)
        pending = req.num_output_placeholders
        if pending and req.num_computed_tokens == req.num_tokens + pending - 1:
            t = EOS if rng.random() < 0.05 else rng.randrange(2, VOCAB)
            tokens.append([t])
            lps.append([TokenLogprobs([t], [-1.0], 1)])
        else:
            tokens.append([])
            lps.append([])
    return RunnerOutput(req_ids=ids, sampled_token_ids=tokens, logprobs=lps)


def check_invariants(sched: Scheduler, out) -> None:
    cfg = sched.config
    assert out.total_num_scheduled_tokens <= cfg.scheduler.max_num_batched_tokens
    assert len(sched.running) <= cfg.scheduler.max_num_seqs
    kv = sched.kv
    refs: dict[int, int] = {}
    for rid, blocks in kv.req_blocks.items():
        req = sched.requests[rid]
        assert req.status == RequestStatus.RUNNING, f"{req} holds blocks while not running"
        assert len(blocks) * kv.block_size >= req.num_computed_tokens
        for b in blocks:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
    for block in kv.pool.blocks:
        assert block.ref_cnt == refs.get(block.block_id, 0), f"{block} refcount drifted"
        assert (block.ref_cnt == 0) == (block.block_id in kv.pool.free)
    for req in sched.requests.values():
        assert req.num_computed_tokens <= req.num_tokens + req.num_output_placeholders
        if req.status != RequestStatus.RUNNING:
            assert req.request_id not in kv.req_blocks


request_strategy = st.tuples(
    st.integers(0, 6),  # arrival step
    st.integers(1, 40),  # prompt length
    st.integers(1, 40),  # max tokens
    st.integers(0, 3),  # priority
    st.sampled_from([None, 0, 1]),  # shared prefix family (prefix-cache hits)
    st.one_of(st.none(), st.integers(0, 40)),  # abort at step
)


def run_workload(reqs, budget, num_blocks, max_num_seqs, policy, prefix, seed, overlap=False) -> Scheduler:
    """Drive a scheduler through a workload, checking invariants after every call.

    With `overlap`, step N+1 is scheduled before step N's output is applied (as the multiprocess
    core does while workers run step N)."""
    rng = random.Random(seed)
    cfg = make_config(
        budget=budget, max_num_seqs=max_num_seqs, policy=policy, prefix=prefix, max_model_len=64
    )
    sched = Scheduler(cfg, num_blocks)
    family = {
        0: [rng.randrange(2, VOCAB) for _ in range(24)],
        1: [rng.randrange(2, VOCAB) for _ in range(24)],
    }
    pending = sorted(enumerate(reqs), key=lambda x: x[1][0])
    finished: set[str] = set()
    aborted: set[str] = set()
    in_flight = None
    step = 0
    while pending or sched.has_unfinished_requests() or in_flight:
        while pending and pending[0][1][0] <= step:
            i, (_, plen, max_tokens, prio, fam, _) = pending.pop(0)
            prompt = [rng.randrange(2, VOCAB) for _ in range(plen)]
            if fam is not None:
                prompt = (family[fam] + prompt)[:plen]
            sched.add_request(
                EngineRequest(
                    request_id=f"r{i}",
                    prompt_token_ids=prompt,
                    sampling_params=SamplingParams(max_tokens=max_tokens),
                    eos_token_ids=[EOS],
                    priority=prio,
                    arrival_time=float(step),
                )
            )
        for i, r in enumerate(reqs):
            if r[5] == step and f"r{i}" in sched.requests:
                for o in sched.abort_requests([f"r{i}"]):
                    assert o.finish_reason == "abort"
                    aborted.add(o.request_id)
        out = sched.schedule()
        check_invariants(sched, out)
        result = fake_runner_output(sched, out, rng)
        applied = (out, result)
        if overlap:
            applied, in_flight = in_flight, ((out, result) if out.total_num_scheduled_tokens else None)
        if applied is not None:
            out, result = applied
            for o in sched.update_from_output(out, result):
                if o.finished:
                    finished.add(o.request_id)
            check_invariants(sched, out)
        step += 1
        assert step < 5000, "scheduler made no progress"
    if overlap and in_flight:
        sched.update_from_output(*in_flight)
    assert finished | aborted == {f"r{i}" for i in range(len(reqs))}
    assert sched.kv.num_blocks_in_use() == 0
    assert not sched.requests
    return sched


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request_strategy, min_size=1, max_size=14),
    budget=st.integers(8, 64),
    num_blocks=st.integers(16, 40),
    max_num_seqs=st.integers(1, 8),
    policy=st.sampled_from(["fcfs", "priority"]),
    prefix=st.booleans(),
    seed=st.integers(0, 1000),
    overlap=st.booleans(),
)
def test_random_workloads_always_finish(
    reqs, budget, num_blocks, max_num_seqs, policy, prefix, seed, overlap
):
    run_workload(reqs, budget, num_blocks, max_num_seqs, policy, prefix, seed, overlap)


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
        )
        for _ in range(40)
    ]
    sched = run_workload(reqs, 48, 18, 8, policy, prefix, seed=1, overlap=overlap)
    assert sched.num_preemptions >= 10
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
    assert sched.num_preemptions >= 1
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
    from coreproc.engine import EngineCore
    from coreproc.protocol import SchedulerOutput, WorkerReady

    class NullExecutor:
        ready = [
            WorkerReady(
                rank=0, num_kv_blocks=40, kv_bytes_per_block=1, weight_bytes=0, load_seconds=0, device="cpu"
            )
        ]

        def submit(self, out: SchedulerOutput) -> None:
            pass

        def wait(self) -> RunnerOutput:
            return RunnerOutput()

        def check_alive(self) -> None:
            pass

        def shutdown(self) -> None:
            pass

    engine = EngineCore(make_config(), NullExecutor())
    engine.scheduler.schedule = lambda: SchedulerOutput()  # a scheduler that never admits anything
    engine.add_request(
        EngineRequest(request_id="a", prompt_token_ids=[3, 4], sampling_params=SamplingParams())
    )
    outputs = []
    for _ in range(10):
        outputs += engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "error")]
    assert not engine.has_unfinished_requests()
