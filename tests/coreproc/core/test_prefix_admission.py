"""Prefix caching with source-tagged keys, the admission controls and the stall watchdog.

Unit tests on the scheduler and block manager (no model): keys from different sources never collide,
tenants with different salts never share a block, `max_num_active_seqs`, the fair share of long
prefills, queue limits, resetting the cache under load and the watchdog. Model tests: greedy outputs
with prefix hits (and evictions under KV pressure) equal Hugging Face and the engine without caching.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time

import httpx
import pytest

from coreproc.base.config import ConfigError
from coreproc.base.errors import InvalidParam, QueueFull
from coreproc.base.lora import LoRAConfig
from coreproc.base.protocol import (
    EngineRequest,
    LoRARef,
    MultiModalRef,
    SamplingParams,
    SchedulerOutput,
)
from coreproc.core.engine import EngineCore
from coreproc.core.kv_cache import KVCacheManager
from coreproc.core.request import Request
from coreproc.core.scheduler import Scheduler
from tests.hf_ref import check_logprobs_close, check_outputs_equal, hf_greedy
from tests.sched_util import StuckExecutor, fake_runner_output, make_config
from tests.server_util import metric, start_server, stop_server

PROMPT = list(range(2, 20))  # 18 tokens: 4 full blocks of 4


def request(rid: str, prompt=PROMPT, max_tokens: int = 1, **kw) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        **kw,
    )


def step(sched: Scheduler, rng: random.Random | None = None) -> SchedulerOutput:
    """One scheduled step with its (fake) result applied."""
    out = sched.schedule()
    sched.update_from_output(out, fake_runner_output(sched, out, rng or random.Random(0)))
    return out


def run_to_end(sched: Scheduler, seed: int = 0) -> None:
    rng = random.Random(seed)
    while sched.has_unfinished_requests():
        step(sched, rng)


def block_hashes(kv: KVCacheManager, **kw) -> list[bytes]:
    return kv._update_hashes(Request(request("x", **kw), 0))


@pytest.mark.unit
def test_keys_from_different_sources_never_collide():
    kv = KVCacheManager(40, 4, True, hash_seed=7)
    variants = {
        "plain": {},
        "salt x": dict(cache_salt="x"),
        "lora x": dict(lora=LoRARef("x", "x")),
        "lora x at /a": dict(lora=LoRARef("x", "/a")),
        "lora x at /b": dict(lora=LoRARef("x", "/b")),
        "mm x": dict(mm_refs=[MultiModalRef("x", 0, 4)]),
        "mm x shifted": dict(mm_refs=[MultiModalRef("x", 1, 4)]),
    }
    first = {name: block_hashes(kv, **kw)[0] for name, kw in variants.items()}
    assert len(set(first.values())) == len(variants), "two sources produced the same block key"
    for kw in variants.values():  # the same source and value: the same key (hits are possible)
        assert block_hashes(kv, **kw) == block_hashes(kv, **kw)
    # an image in tokens 4..7 changes block 1 (and, by chaining, the rest) but not block 0
    image = block_hashes(kv, mm_refs=[MultiModalRef("img", 4, 4)])
    plain = block_hashes(kv)
    assert image[0] == plain[0] and image[1] != plain[1] and image[3] != plain[3]
    # the hash seed: fixed seeds reproduce, the default differs per launch
    assert block_hashes(KVCacheManager(40, 4, True, hash_seed=7)) == plain
    assert block_hashes(KVCacheManager(40, 4, True)) != plain


@pytest.mark.unit
def test_tenants_with_different_salts_never_share_blocks():
    sched = Scheduler(make_config(budget=64), num_kv_blocks=40)
    sched.add_request(request("t1-a", cache_salt="t1", max_tokens=4))
    sched.add_request(request("t2-a", cache_salt="t2", max_tokens=4))
    step(sched)
    a, b = (set(sched.kv.block_ids(sched.requests[r])[0]) for r in ("t1-a", "t2-a"))
    assert not a & b, "two tenants share KV blocks"
    run_to_end(sched)
    for rid, salt, hit in (("t2-b", "t2", 16), ("t1-b", "t1", 16), ("none", None, 0), ("t3", "t3", 0)):
        sched.add_request(request(rid, cache_salt=salt))
        assert step(sched).new_requests[0].num_computed_tokens == hit, rid
        run_to_end(sched)
    assert sched.kv.num_blocks_in_use() == 0


@pytest.mark.unit
def test_adapter_and_multimodal_requests_are_refused_with_the_parameter():
    sched = Scheduler(make_config(), num_kv_blocks=40)
    with pytest.raises(InvalidParam) as err:
        sched.add_request(request("l", lora=LoRARef("x", "/adapters/x")))
    assert err.value.param == "lora" and "--enable-lora" in str(err.value)
    serving = Scheduler(
        dataclasses.replace(make_config(), lora=LoRAConfig(enable_lora=True)), num_kv_blocks=40
    )
    with pytest.raises(InvalidParam) as err:
        serving.add_request(request("l", lora=LoRARef("x", "")))
    assert err.value.param == "lora" and "no LoRA adapter named 'x'" in str(err.value)
    with pytest.raises(InvalidParam):
        sched.add_request(request("m", mm_refs=[MultiModalRef("h", 0, 4)]))
    assert not sched.requests


@pytest.mark.unit
def test_max_num_active_seqs_caps_running_requests():
    sched = Scheduler(make_config(budget=64, max_num_seqs=8, max_num_active_seqs=2), num_kv_blocks=60)
    for i in range(6):
        sched.add_request(request(f"r{i}", prompt=[3 + i] * 6, max_tokens=3))
    rng, seen = random.Random(0), 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert len(sched.running) <= 2 and len(out.num_scheduled_tokens) <= 2
        seen = max(seen, len(sched.running))
        sched.update_from_output(out, fake_runner_output(sched, out, rng))
    assert seen == 2
    with pytest.raises(ConfigError, match="max_num_active_seqs"):
        make_config(max_num_seqs=4, max_num_active_seqs=5)


@pytest.mark.unit
@pytest.mark.parametrize("threshold", [0, 16])
def test_long_prefill_shares_the_budget_only_when_others_wait(threshold):
    sched = Scheduler(make_config(budget=64, long_prefill_token_threshold=threshold), num_kv_blocks=60)
    sched.add_request(request("long", prompt=[5] * 60))
    for i in range(3):
        sched.add_request(request(f"short{i}", prompt=[6 + i] * 8))
    got = sched.schedule().num_scheduled_tokens
    if threshold:  # floor(64 / 4 prefills) = 16 for the long one; the short ones are never cut
        assert got == {"long": 16, "short0": 8, "short1": 8, "short2": 8}
    else:  # the long prompt takes what it can and the short ones wait or get chunked
        assert got == {"long": 60, "short0": 4}
    lone = Scheduler(make_config(budget=64, long_prefill_token_threshold=16), num_kv_blocks=60)
    lone.add_request(request("long", prompt=[5] * 60))
    assert lone.schedule().num_scheduled_tokens == {"long": 60}, "a lone prefill must not be chunked"


@pytest.mark.unit
def test_queue_limits_refuse_new_work_but_an_empty_queue_takes_one():
    sched = Scheduler(make_config(max_num_queued_requests=2), num_kv_blocks=40)
    sched.add_request(request("a"))
    sched.add_request(request("b"))
    with pytest.raises(QueueFull, match="2 requests waiting"):
        sched.add_request(request("c"))
    assert set(sched.requests) == {"a", "b"}
    tokens = Scheduler(make_config(max_num_queued_tokens=20, max_model_len=64), num_kv_blocks=40)
    tokens.add_request(request("big", prompt=[3] * 30))  # alone in the queue: accepted
    with pytest.raises(QueueFull, match="30 prompt tokens waiting"):
        tokens.add_request(request("small", prompt=[3] * 5))
    step(tokens)  # "big" starts running: the queue is empty again
    tokens.add_request(request("small", prompt=[3] * 5))
    # the sequences of one API request are admitted together or refused together
    grouped = Scheduler(make_config(max_num_queued_requests=3), num_kv_blocks=40)
    grouped.add_requests([request(f"g{i}") for i in range(2)])
    with pytest.raises(QueueFull):  # 2 waiting + 2 > 3: none of them joins
        grouped.add_requests([request("h0"), request("h1")])
    assert set(grouped.requests) == {"g0", "g1"}
    grouped.add_requests([request("h0")])
    with pytest.raises(InvalidParam, match="can never be admitted"):  # more than the queue takes: 400
        Scheduler(make_config(max_num_queued_requests=3), num_kv_blocks=40).add_requests(
            [request(f"x{i}") for i in range(4)]
        )
    with pytest.raises(InvalidParam, match="prompt token ids"):  # one bad sequence refuses them all
        grouped.add_requests([request("ok"), request("bad", prompt=[10**6])])
    assert "ok" not in grouped.requests


@pytest.mark.unit
def test_reset_prefix_cache_under_load():
    sched = Scheduler(make_config(budget=64), num_kv_blocks=40)
    sched.add_request(request("a", max_tokens=6))
    step(sched)  # "a" runs and its full blocks are registered
    assert sched.kv.reset_prefix_cache() == 4
    sched.add_request(request("b"))
    assert step(sched).new_requests[0].num_computed_tokens == 0, "a reset cache must not hit"
    run_to_end(sched)
    assert sched.kv.num_blocks_in_use() == 0
    sched.add_request(request("c"))  # blocks registered after the reset are hittable
    assert step(sched).new_requests[0].num_computed_tokens == 16


@pytest.mark.unit
def test_watchdog_reports_a_stall_once_with_the_scheduler_state(caplog):
    engine = EngineCore(make_config(stall_timeout=5.0), StuckExecutor())
    engine.last_step_end -= 1000  # an engine idle for a long time is not stalled when work arrives
    engine.add_request(request("a"))
    assert engine.check_stall() is None and engine.stats().stalled is None
    engine.last_step_end -= 10
    with caplog.at_level(logging.ERROR, logger="ember.core"):
        for _ in range(3):
            reason = engine.stats().stalled
    assert "has not completed a step for 10s" in reason
    (record,) = [r for r in caplog.records if "scheduler state" in r.getMessage()]
    assert '"num_waiting": 1' in record.getMessage() and '"free_blocks": 40' in record.getMessage()
    engine.abort_requests(["a"])
    assert engine.check_stall() is None


# ---------------------------------------------------------------------------- against the model


def shared_prefix_prompts(n: int, prefix_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 200) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 200) for _ in range(3 + i)] for i in range(n)]


@pytest.mark.model
def test_outputs_with_prefix_hits_and_evictions_equal_hf(make_ckpt):
    from coreproc import LLM

    path = str(make_ckpt("llama"))
    prompts = shared_prefix_prompts(6, 37)
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=0)
    ref = [hf_greedy(path, p, 8) for p in prompts]
    setups = {
        "no cache": dict(enable_prefix_caching=False),
        "cache": dict(),
        "cache under pressure": dict(num_kv_blocks=12, max_model_len=64, max_num_batched_tokens=32),
    }
    for name, kw in setups.items():
        llm = LLM(path, dtype="float32", block_size=8, show_progress=False, **kw)
        for _ in range(2):  # the second round finds the first round's blocks (unless evicted)
            outs = llm.generate(prompts, params, use_tqdm=False)
            check_outputs_equal([o.outputs[0].token_ids for o in outs], [r[0] for r in ref])
            lps = [[next(iter(p.values())).logprob for p in o.outputs[0].logprobs] for o in outs]
            check_logprobs_close(lps, [r[1] for r in ref])
        stats = llm.stats()
        assert (stats.prefix_cache_hits > 0) == (name != "no cache"), (name, stats)
        if name == "cache":
            assert sum(o.num_cached_tokens for o in outs) >= 6 * 32
            full_hits = stats.prefix_cache_hits
        if name == "cache under pressure":  # blocks were evicted and requests preempted
            assert stats.num_preemptions > 0 and stats.prefix_cache_hits < full_hits
        assert stats.num_blocks_in_use == 0
        llm.close()


@pytest.mark.e2e
def test_http_cache_salt_reset_and_hit_rate(make_ckpt):
    """Over HTTP: salts isolate tenants, usage reports cached tokens, POST /reset_prefix_cache (behind
    the API key) forgets the cache, and /metrics shows the hit rate."""
    proc, url = start_server(str(make_ckpt("llama")), "--api-key", "k")
    auth = {"Authorization": "Bearer k"}
    prompt = list(range(10, 90))  # 80 tokens: a hit covers at most (80 - 1) // 16 = 4 blocks

    def cached(salt: str | None) -> tuple[int, str]:
        body = {"model": "llama", "prompt": prompt, "max_tokens": 3, "temperature": 0, "cache_salt": salt}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        return out["usage"]["prompt_tokens_details"]["cached_tokens"], out["choices"][0]["text"]

    try:
        runs = [cached(s) for s in ("A", "A", "B", None, "B")]
        assert [n for n, _ in runs] == [0, 64, 0, 0, 64]
        assert len({text for _, text in runs}) == 1, "a cache hit changed the output"
        assert httpx.post(f"{url}/reset_prefix_cache").status_code == 401
        reset = httpx.post(f"{url}/reset_prefix_cache", headers=auth)
        assert reset.status_code == 200 and reset.json()["dropped_blocks"] >= 10
        assert cached("A")[0] == 0
        deadline = time.monotonic() + 30  # stats reach /metrics every second (a wait, not a bound)
        while metric(url, "ember_prefix_cache_hit_rate") == 0:
            assert time.monotonic() < deadline, "no hit rate in /metrics"
            time.sleep(0.2)
        assert 0 < metric(url, "ember_prefix_cache_hit_rate") < 1
    finally:
        stop_server(proc)
