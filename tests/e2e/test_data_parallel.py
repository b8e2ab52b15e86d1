"""Data parallelism: several engine cores behind one frontend (`--data-parallel-size`).

Unit tests of the router (least loaded, prefix, dead cores) and the stats merge; end to end, real
`ember serve -dp 2` processes: greedy outputs equal a single engine's, 256 concurrent streams spread over
both cores (the split is printed), prefix routing keeps a prompt family on one core, and a SIGKILLed
core or worker of one core fails only that core's requests while /health names it and the other
core serves on.
Also `ember core -dp 2` with the SDK's `EngineClient([...])`, and `LLM(data_parallel_size=2)`.
Run: pytest tests/e2e/test_data_parallel.py
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from coreproc import LLM, SamplingParams
from coreproc.base.errors import EmberError, EngineDeadError
from coreproc.base.protocol import EngineInfo, SchedulerStats
from coreproc.client.dp_client import DPEngineClient
from coreproc.client.dp_engine import DPEngine
from coreproc.client.dp_router import DPRouter, merge_stats
from coreproc.client.sdk import EngineClient
from coreproc.startup.launcher import dp_listen_addresses
from tests.hf_ref import PROMPT_TEXTS
from tests.proc_util import children, cmdline, gone
from tests.server_util import eventually, metric, start_server, stop_server, wait_idle

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)


# ---------------------------------------------------------------------------------------------- unit


@pytest.mark.unit
def test_least_loaded_spreads_work_and_skips_dead_cores() -> None:
    router = DPRouter([100, 100, 100])
    picks = []
    for _ in range(9):
        rank = router.pick()
        router.sent(rank)
        picks.append(rank)
    assert sorted(picks.count(r) for r in range(3)) == [3, 3, 3]
    router.done(1, 3)  # core 1 finished its work: it is now the least loaded
    assert router.pick() == 1
    router.observe(1, 50, 0.9)  # ... but its own stats say another frontend keeps it busy
    assert router.pick() != 1
    router.mark_dead(0)
    router.mark_dead(2)
    assert {router.pick() for _ in range(4)} == {1}
    router.mark_dead(1)
    with pytest.raises(ValueError, match="no data-parallel engine is alive"):
        router.pick()


class _QuietCore:
    """In place of a core's `AsyncEngineClient`: its next `misses` stats calls go unanswered."""

    def __init__(self, misses: int) -> None:
        self.misses, self.dead = misses, None
        self.info_cache = EngineInfo(
            model="m", max_model_len=64, vocab_size=8, num_kv_blocks=16, block_size=4,
            tensor_parallel_size=1, version="0", max_num_seqs=4,
        )  # fmt: skip

    async def stats(self, timeout: float | None) -> SchedulerStats:
        if self.misses:
            self.misses -= 1
            raise EngineDeadError("the call timed out")
        return SchedulerStats()

    def declare_dead(self, reason: str) -> None:
        self.dead = reason


@pytest.mark.unit
def test_a_core_is_given_up_after_two_unanswered_stats_calls_not_one() -> None:
    """One miss may be the frontend's own pause (a stop, swapping) outliving the call's timer."""
    paused, stopped = _QuietCore(misses=1), _QuietCore(misses=10**6)
    client = DPEngineClient([paused, stopped])  # type: ignore[list-item]
    client.unresponsive_after = 0.0  # time is not what this test is about

    async def poll() -> dict:
        return await client.stats_by_rank(timeout=1.0)

    first = asyncio.run(poll())
    assert paused.dead is None and stopped.dead is None and isinstance(first[0], str)
    second = asyncio.run(poll())
    assert isinstance(second[0], SchedulerStats) and paused.dead is None  # it answered: forgiven
    assert stopped.dead is not None and "has not answered" in stopped.dead
    assert client.dead_ranks() == {1: stopped.dead}


@pytest.mark.unit
def test_prefix_routing_follows_the_longest_held_prefix_within_slack() -> None:
    router = DPRouter([100, 100], "prefix", block_size=4, slack=3)
    a = router.prefix_hashes(list(range(12)))
    assert len(a) == 3 and router.prefix_hashes(list(range(13))) == a  # full blocks only
    b = router.prefix_hashes([7] * 12)
    router.sent(0, a)
    router.sent(1, b)
    assert router.pick(router.prefix_hashes([*range(8), 99, 98, 97, 96])) == 0  # two blocks of `a`
    assert router.pick(b) == 1
    assert router.prefix_hashes(list(range(12)), extra=("salt", None, ())) != a  # tagged: never shared
    router.sent(0, a, count=4)  # core 0 is now 4 requests busier than core 1: more than the slack
    assert router.pick(a) == 1
    router.forget_prefixes()
    router.done(0, 5)
    assert router.matched_blocks(0, a) == 0


@pytest.mark.unit
def test_prefix_memory_is_bounded_by_the_cores_block_count() -> None:
    router = DPRouter([2, 100], "prefix", block_size=2)
    hashes = router.prefix_hashes(list(range(10)))
    router.sent(0, hashes)
    assert len(router.engines[0].blocks) == 2 and router.matched_blocks(0, hashes) == 0  # oldest gone


@pytest.mark.unit
def test_merged_stats_sum_counts_and_recompute_ratios() -> None:
    a = SchedulerStats(num_running=2, kv_usage=0.5, prefix_cache_queries=100, prefix_cache_hits=50)
    b = SchedulerStats(num_running=3, kv_usage=0.1, prefix_cache_queries=300, prefix_cache_hits=50)
    b.spec_accepted_per_position, b.stalled = [1, 2], "stuck"
    m = merge_stats([a, b])
    assert m.num_running == 5 and m.kv_usage == pytest.approx(0.3)
    assert m.prefix_cache_hit_rate == pytest.approx(0.25) and m.spec_accepted_per_position == [1, 2]
    assert m.stalled == "engine core 1: stuck"
    a.expert_load, b.expert_load = {0: [4, 0], 2: [1, 1]}, {0: [0, 2]}  # engines' experts' loads: summed
    m = merge_stats([a, b])
    assert m.expert_load == {0: [4, 2], 2: [1, 1]}
    assert m.expert_layer_imbalance == {0: pytest.approx(4 / 3), 2: 1.0}
    assert m.expert_imbalance == pytest.approx((4 / 3 + 1) / 2)


@pytest.mark.unit
def test_listen_addresses_per_rank() -> None:
    assert dp_listen_addresses(None, 2) == [None, None]
    assert dp_listen_addresses("tcp://127.0.0.1:7000", 3) == [
        f"tcp://127.0.0.1:{p}" for p in (7000, 7001, 7002)
    ]
    assert dp_listen_addresses("ipc:///a,ipc:///b", 2) == ["ipc:///a", "ipc:///b"]
    with pytest.raises(EmberError, match="--listen needs 2 comma-separated addresses"):
        dp_listen_addresses("ipc:///a", 2)


# ----------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def llama(make_ckpt) -> Path:
    return make_ckpt("llama")


@pytest.fixture(scope="module")
def single(llama) -> list:
    """A single engine's greedy completions of PROMPT_TEXTS."""
    with LLM(str(llama), dtype="float32", show_progress=False) as llm:
        return [o.outputs[0] for o in llm.generate(PROMPT_TEXTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(single) -> list[str]:
    return [o.text for o in single]


@pytest.fixture(scope="module")
def dp_server(llama):
    proc, url = start_server(str(llama), "--data-parallel-size", "2")
    yield proc, url
    stop_server(proc)


def complete(url: str, prompt: str | list[int], **kw: object) -> dict:
    body = {"model": "llama", "prompt": prompt, "temperature": 0.0, "max_tokens": 12, "min_tokens": 12, **kw}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def routed(url: str) -> list[float]:
    return [metric(url, "ember_engine_requests_routed_total", f'engine="{r}"') for r in (0, 1)]


@pytest.mark.e2e
def test_dp2_greedy_outputs_equal_a_single_engine(dp_server, reference) -> None:
    _, url = dp_server
    before = routed(url)
    got = [complete(url, p)["choices"][0]["text"] for p in PROMPT_TEXTS]
    assert got == reference
    # the frontend mirrors routing counts every second: wait for all of these (a later test reads
    # the counts as its baseline)
    total = sum(before) + len(PROMPT_TEXTS)
    after = eventually(lambda: routed(url), lambda now: sum(now) == total)
    assert sum(after) == total and all(a > b for a, b in zip(after, before)), (before, after)


async def _streams(url: str, n: int, max_tokens: int) -> list[tuple[str | None, int]]:
    """`n` concurrent streaming completions: (finish reason, tokens received) each."""
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:

        async def one(k: int) -> tuple[str | None, int]:
            body = {
                "model": "llama",
                "prompt": f"request {k}: " + PROMPT_TEXTS[k % len(PROMPT_TEXTS)],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
            reason, count = None, 0
            async with http.stream("POST", "/v1/completions", json=body) as reply:
                assert reply.status_code == 200, await reply.aread()
                async for line in reply.aiter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        count += 1 if choice["text"] else 0
                        reason = choice["finish_reason"] or reason
            return reason, count

        return await asyncio.gather(*(one(k) for k in range(n)))


@pytest.mark.e2e
def test_256_streams_spread_over_both_cores(dp_server) -> None:
    _, url = dp_server
    before = routed(url)
    results = asyncio.run(_streams(url, 256, 16))
    assert all(reason == "length" for reason, _ in results)
    split = eventually(lambda: [a - b for a, b in zip(routed(url), before)], lambda now: sum(now) == 256)
    print(f"256 streams: core 0 took {split[0]:.0f}, core 1 took {split[1]:.0f}")
    assert sum(split) == 256 and min(split) >= 96, split
    wait_idle(url)  # every core freed every KV block


@pytest.mark.e2e
def test_prefix_routing_keeps_a_prompt_family_on_one_core(llama) -> None:
    proc, url = start_server(str(llama), "-dp", "2", "--dp-routing", "prefix", "--block-size", "16")
    try:
        families = [[100 + f] * 64 for f in range(4)]  # four shared 64-token (4-block) prefixes
        for repeat in range(4):
            for f, prefix in enumerate(families):
                complete(url, [*prefix, 7, repeat, f], max_tokens=2, min_tokens=2)
        hits = eventually(lambda: metric(url, "ember_prefix_cache_hits_total"), lambda h: h == 4 * 3 * 64)
        assert hits == 4 * 3 * 64, "every repeat found its family's four blocks on the core it went to"
        assert min(routed(url)) > 0, "the families were spread over both cores"
    finally:
        stop_server(proc)


@pytest.mark.e2e
@pytest.mark.parametrize("kill", ["worker", "core"])
def test_killing_one_core_or_its_worker_fails_only_its_requests(llama, kill) -> None:
    proc, url = start_server(str(llama), "--data-parallel-size", "2")
    try:
        cores = {c: cmdline(c) for c in children(proc.pid) if "ember-core" in cmdline(c)}
        core1 = next(c for c, cmd in cores.items() if "ember-core-dp1" in cmd)
        worker1 = next(w for w in children(core1) if "ember-worker" in cmdline(w))
        victim = worker1 if kill == "worker" else core1

        async def run() -> tuple[list, float]:
            task = asyncio.ensure_future(_fail_or_finish(url, 16))
            deadline = time.monotonic() + 60
            while metric(url, "ember_num_requests_running", 'engine="1"') == 0:
                assert time.monotonic() < deadline, "core 1 never ran anything"
                await asyncio.sleep(0.1)
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            results = await task
            return results, killed_at

        results, killed_at = asyncio.run(run())
        failed = [r for r in results if r[0] == "error"]
        finished = [r for r in results if r[0] == "length"]
        assert failed and finished and len(failed) + len(finished) == 16, results
        assert all("engine" in message for _, message, _ in failed)
        to_error = max(at for _, _, at in failed) - killed_at
        print(f"core 1's {kill} killed: {len(failed)} failed in {to_error:.2f} s, {len(finished)} finished")
        assert to_error < 5.0, "errors reach the clients within 5 s"
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and "engine core 1 dead" in health.json()["reason"]
        texts = [complete(url, p)["choices"][0]["text"] for p in PROMPT_TEXTS[:4]]  # core 0 serves on
        assert all(texts)
        assert gone([core1, worker1], timeout=20)
    finally:
        stop_server(proc)


async def _fail_or_finish(url: str, n: int) -> list[tuple[str, str, float]]:
    """`n` long concurrent streams: ("length" | "error", error message, when it ended) each."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:

        async def one(k: int) -> tuple[str, str, float]:
            body = {"model": "llama", "prompt": PROMPT_TEXTS[k % 4], "max_tokens": 600, "ignore_eos": True}
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
                async for line in reply.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        return "error", event["error"]["message"], time.monotonic()
                    if event["choices"][0]["finish_reason"]:
                        return event["choices"][0]["finish_reason"], "", time.monotonic()
            return "cut", "", time.monotonic()

        return await asyncio.gather(*(one(k) for k in range(n)))


@pytest.mark.e2e
def test_api_servers_share_the_port_and_the_cores(llama, reference) -> None:
    proc, url = start_server(str(llama), "-dp", "2", "--api-server-count", "2")
    try:
        child = next(c for c in children(proc.pid) if "ember-api-server-1" in cmdline(c))
        texts = [complete(url, PROMPT_TEXTS[k % len(PROMPT_TEXTS)])["choices"][0]["text"] for k in range(32)]
        assert texts == [reference[k % len(reference)] for k in range(32)]  # a new connection each
        served = [metric(url, "ember_api_server_requests_total", f'api_server="{i}"') for i in (0, 1)]
        assert sum(served) == 32 and min(served) > 0, served  # the kernel spread them
        now = eventually(lambda: routed(url), lambda r: sum(r) == 32)
        assert sum(now) == 32 and min(now) > 0  # both servers' routing, added up
        assert metric(url, "ember_requests_total", 'finished_reason="length"') == 32
    finally:
        stop_server(proc)
    assert gone([child])


@pytest.mark.e2e
def test_api_server_count_below_one_is_one_line(llama) -> None:
    cmd = [sys.executable, "-m", "frontend.cli", "serve", str(llama), "--api-server-count", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--api-server-count must be at least 1" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.e2e
def test_sdk_client_routes_over_a_core_group(llama, single) -> None:
    cmd = [sys.executable, "-m", "frontend.cli", "core", str(llama), "--dtype", "float32", "-dp", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline() for _ in range(2)]
        addresses = [re.search(r"listening on (\S+)", line).group(1) for line in lines]
        assert [f"rank {r}" in line for r, line in enumerate(lines)] == [True, True]
        tokens = []
        with EngineClient(addresses) as client:
            from coreproc.base.tokenizer import load_tokenizer

            tok = load_tokenizer(str(llama))
            for text in PROMPT_TEXTS:
                outs = list(client.generate(tok(text).input_ids, GREEDY))
                tokens.append([t for o in outs for t in o.new_token_ids])
            assert client.stats().num_kv_blocks == 2 * client.info().num_kv_blocks
        assert tokens == [o.token_ids for o in single]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


@pytest.mark.e2e
@pytest.mark.parametrize("overlap", [True, False], ids=["async", "sync"])
def test_offline_llm_with_two_engines(llama, single, overlap) -> None:
    """Both cores take work and the tokens are a single engine's, with each core keeping its own step
    in flight (async scheduling) or all cores launched before any is waited for."""
    with LLM(
        str(llama), dtype="float32", data_parallel_size=2, async_scheduling=overlap, show_progress=False
    ) as llm:
        outs = llm.generate(PROMPT_TEXTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.token_ids for o in single]
        assert isinstance(llm.engine, DPEngine)
        assert all(e.routed > 0 and e.in_flight == 0 for e in llm.engine.router.engines)
        assert llm.stats().num_kv_blocks == sum(c.scheduler.kv.num_blocks for c in llm.engine.cores)


@pytest.mark.e2e
def test_pipeline_stages_in_each_data_parallel_engine(llama, single) -> None:
    """-dp 2 x -pp 2: two engines of two stages each (four workers), a single engine's tokens."""
    with LLM(
        str(llama), dtype="float32", data_parallel_size=2, pipeline_parallel_size=2, show_progress=False
    ) as llm:
        outs = llm.generate(PROMPT_TEXTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.token_ids for o in single]
        assert all(len(core.executor.procs) == 2 for core in llm.engine.cores)
