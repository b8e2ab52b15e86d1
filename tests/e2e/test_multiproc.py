"""The multiprocess engine: ember-core + worker processes over ZeroMQ, reached through the SDK.

Real processes and sockets throughout: streaming through the SDK equals the offline `LLM`, TP=2 equals
TP=1 on every architecture, aborts free KV blocks, and the faults (a worker or the core killed,
SIGTERM) end in errors or clean exits, never hangs or orphans. Run: `pytest -q tests/e2e/test_multiproc.py`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coreproc import LLM, SamplingParams
from coreproc.base.config import EngineConfig
from coreproc.base.protocol import SchedulerStats, UtilityCall
from coreproc.client.sdk import AsyncEngineClient, EngineClient, EngineDeadError, EngineRequestError
from coreproc.startup.launcher import CoreProcess, EngineRefused
from tests.hf_ref import PROMPT_TEXTS
from tests.proc_util import children, cmdline, gone

pytestmark = pytest.mark.e2e

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
LONG = SamplingParams(temperature=0.0, max_tokens=800, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(make_ckpt) -> Path:
    return make_ckpt("llama")


@pytest.fixture(scope="module")
def prompts(llama) -> list[list[int]]:
    from coreproc.base.tokenizer import load_tokenizer

    tok = load_tokenizer(str(llama))
    return [tok(t).input_ids for t in PROMPT_TEXTS]


@pytest.fixture(scope="module")
def core(llama):
    with CoreProcess(EngineConfig.create(str(llama), dtype="float32", max_num_batched_tokens=64)) as proc:
        yield proc


def test_process_names_and_info(core):
    assert "ember-core" in cmdline(core.pid)
    workers = children(core.pid)
    assert any("ember-worker-0" in cmdline(p) for p in workers)
    with EngineClient(core.address) as client:
        info = client.info()
        assert info.tensor_parallel_size == 1 and info.max_model_len > 0 and info.eos_token_ids
        stats = client.stats()
        assert isinstance(stats, SchedulerStats) and stats.num_kv_blocks == info.num_kv_blocks
        assert not stats.has_work and stats.stalled is None


def test_unknown_utility_method_is_refused(core):
    async def run() -> None:
        client = await AsyncEngineClient.connect(core.address)
        try:
            with pytest.raises(ValueError, match="unknown utility method 'shutdown'"):
                await client.call("shutdown")  # type: ignore[arg-type]
            assert await client.call("ping") is True
            # a client that skips the SDK's check gets an answer from the core, not silence
            answer = asyncio.get_running_loop().create_future()
            client.calls[999] = answer
            await client._send(UtilityCall(999, "shutdown"))  # type: ignore[arg-type]
            with pytest.raises(EngineRequestError, match="unknown utility method 'shutdown'; the core"):
                await asyncio.wait_for(answer, 10)
        finally:
            await client.aclose()

    asyncio.run(run())


def test_sdk_streaming_equals_offline(core, llama, prompts):
    with LLM(str(llama), dtype="float32", show_progress=False) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    async def run() -> list[list[int]]:
        client = await AsyncEngineClient.connect(core.address)
        try:

            async def one(p: list[int]) -> list[int]:
                tokens, chunks = [], 0
                async for out in client.generate(p, GREEDY):
                    tokens += out.new_token_ids
                    chunks += 1
                assert chunks >= 2, "outputs must stream, not arrive at once"
                assert out.finish_reason == "length"
                return tokens

            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.aclose()

    assert asyncio.run(run()) == ref


def test_abort_and_disconnect_free_blocks(core, prompts):
    with EngineClient(core.address) as client:
        stream = client.generate(prompts[2], LONG)
        next(stream)
        assert client.stats().num_blocks_in_use > 0
        stream.close()  # leaving the stream aborts the request
        deadline = time.monotonic() + 30
        while client.stats().num_blocks_in_use and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.stats().num_blocks_in_use == 0
    # a client that disconnects without aborting: its requests are dropped when it is gone
    with EngineClient(core.address) as client:
        stream = client.generate(prompts[3], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        next(stream)
    with EngineClient(core.address) as client:
        deadline = time.monotonic() + 30
        while client.stats().num_blocks_in_use and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.stats().num_blocks_in_use == 0


def test_crashed_client_requests_are_aborted(llama, prompts):
    """A client killed mid-stream stops sending heartbeats; the core aborts its requests."""
    config = EngineConfig.create(str(llama), dtype="float32")
    with CoreProcess(config, client_timeout=1.5) as proc:
        script = (
            "import sys; from coreproc.client.sdk import EngineClient; from coreproc import SamplingParams\n"
            f"c = EngineClient({proc.address!r})\n"
            f"s = c.generate({prompts[2]!r}, SamplingParams(max_tokens=900, ignore_eos=True))\n"
            "next(s); print('streaming', flush=True); sys.stdin.read()\n"
        )
        child = subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert child.stdout.readline().strip() == "streaming"
        with EngineClient(proc.address) as watcher:
            assert watcher.stats().num_running == 1
            child.kill()
            child.wait()
            # the core drops a silent client's requests after the 1.5 s client timeout: a wait, not a bound
            deadline = time.monotonic() + 40
            while watcher.stats().num_blocks_in_use and time.monotonic() < deadline:
                time.sleep(0.1)
            stats = watcher.stats()
            assert stats.num_blocks_in_use == 0 and stats.num_running == 0


def test_bad_request_is_refused_with_a_reason(core):
    with EngineClient(core.address) as client:
        with pytest.raises(EngineRequestError, match="prompt"):
            list(client.generate([], GREEDY))
        with pytest.raises(EngineRequestError, match="temperature"):
            list(client.generate([5, 6], SamplingParams(temperature=-1.0)))
        assert client.stats().num_running == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_tensor_parallel_equals_single_device(make_ckpt, arch):
    path = str(make_ckpt(arch))
    with LLM(path, dtype="float32", show_progress=False) as one:
        ref = [o.outputs[0].token_ids for o in one.generate(PROMPT_TEXTS, GREEDY, use_tqdm=False)]
    with LLM(path, dtype="float32", tensor_parallel_size=2, show_progress=False) as two:
        got = [o.outputs[0].token_ids for o in two.generate(PROMPT_TEXTS, GREEDY, use_tqdm=False)]
    assert got == ref


@pytest.mark.parametrize("tp", [1, 2])
def test_killed_worker_fails_requests_and_leaves_no_process(llama, prompts, tp):
    check_killed_worker(EngineConfig.create(str(llama), dtype="float32", tensor_parallel_size=tp), prompts)


def check_killed_worker(
    config: EngineConfig, prompts: list[list[int]], victim_rank: int | None = None
) -> None:
    """Kill one worker (default: the last) while requests stream: they fail within seconds, the core
    exits 1 and no worker is left."""
    world = config.parallel.world_size
    proc = CoreProcess(config)
    try:
        workers = children(proc.pid)
        assert len([w for w in workers if "ember-worker" in cmdline(w)]) == world
        client = EngineClient(proc.address)
        streams = [client.generate(p, LONG) for p in prompts[:3]]
        for s in streams:
            next(s)
        rank = world - 1 if victim_rank is None else victim_rank
        victim = next(w for w in workers if f"ember-worker-{rank}" in cmdline(w))
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        for s in streams:
            with pytest.raises(EngineDeadError, match="engine dead"):
                for _ in s:
                    pass
        assert time.monotonic() - killed_at < 15.0  # at once here; without the check, never
        assert proc.proc.wait(20) == 1
        assert gone(workers)
        client.close()
    finally:
        proc.stop(grace=0)


def test_killed_core_fails_clients_and_workers_exit(llama, prompts):
    proc = CoreProcess(EngineConfig.create(str(llama), dtype="float32"))
    try:
        workers = children(proc.pid)
        client = EngineClient(proc.address)
        stream = client.generate(prompts[1], LONG)
        next(stream)
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            client.stats()
        assert gone(workers), "workers must exit when their core disappears"
        client.close()
    finally:
        proc.stop(grace=0)


def test_sigterm_finishes_in_flight_work_and_exits_clean(llama, prompts):
    proc = CoreProcess(EngineConfig.create(str(llama), dtype="float32"), shutdown_timeout=60)
    runtime_dir = proc.runtime_dir
    workers = children(proc.pid)
    client = EngineClient(proc.address)
    stream = client.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    first = next(stream)
    proc.proc.send_signal(signal.SIGTERM)
    rest = list(stream)
    tokens = first.new_token_ids + [t for o in rest for t in o.new_token_ids]
    assert len(tokens) == 60 and rest[-1].finish_reason == "length"
    assert proc.proc.wait(30) == 0
    assert gone(workers)
    sockets = [p for p in runtime_dir.glob("*") if p.is_socket()] if runtime_dir.exists() else []
    proc.stop()
    assert not runtime_dir.exists()
    assert sockets == [] or all(not p.exists() for p in sockets)
    client.close()


def test_sigterm_grace_period_aborts_what_is_left(llama, prompts):
    proc = CoreProcess(EngineConfig.create(str(llama), dtype="float32"), shutdown_timeout=0.5)
    client = EngineClient(proc.address)
    stream = client.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True))
    next(stream)
    proc.proc.send_signal(signal.SIGTERM)
    last = list(stream)[-1]
    assert last.finish_reason == "abort"
    assert proc.proc.wait(30) == 0
    client.close()
    proc.stop()


def test_curve_keys_required_off_loopback_and_enforced(llama, prompts, tmp_path):
    keys = tmp_path / "keys"
    out = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "keygen", str(keys)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    config = EngineConfig.create(str(llama), dtype="float32")
    with pytest.raises(EngineRefused, match="curve-keys"):
        CoreProcess(config, listen="tcp://0.0.0.0:0")
    with CoreProcess(config, listen="tcp://127.0.0.1:0", curve_keys=keys) as proc:
        assert proc.address.startswith("tcp://127.0.0.1:")
        with pytest.raises(EngineDeadError):
            EngineClient(proc.address, timeout=3)  # no keys: nothing gets through
        with pytest.raises(EngineDeadError):
            other = tmp_path / "other"
            subprocess.run(
                [sys.executable, "-m", "frontend.cli", "keygen", str(other)], check=True, timeout=60
            )
            EngineClient(
                proc.address,
                timeout=3,
                server_key=keys / "server.key",
                client_key=other / "client.key_secret",
            )
        with EngineClient(
            proc.address, server_key=keys / "server.key", client_key=keys / "client.key_secret"
        ) as ok:
            tokens = [t for o in ok.generate(prompts[0], GREEDY) for t in o.new_token_ids]
            assert len(tokens) == 12
            stats = ok.stats()
            assert stats.num_steps > 0 and stats.worker_busy_seconds > 0  # timed in the worker


def test_ember_core_cli_serves_and_stops_on_sigterm(llama, prompts):
    """`ember core MODEL --listen tcp://127.0.0.1:0` prints its address, serves, exits 0 on SIGTERM."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "frontend.cli",
            "core",
            str(llama),
            "--dtype",
            "float32",
            "--listen",
            "tcp://127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("ember core: listening on tcp://127.0.0.1:"), line
        address = line.rsplit(" ", 1)[1]
        with EngineClient(address) as client:
            tokens = [t for o in client.generate(prompts[4], GREEDY) for t in o.new_token_ids]
            assert len(tokens) == 12
        workers = children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert gone(workers)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_boot_pauses_collection_and_freezes_the_heap() -> None:
    """`boot.paused()` turns the collector off for its block and restores its previous state (on, or
    off when a boot entry point turned it off first) without freezing; `boot.settle()` freezes what is
    alive and turns collection on."""
    import gc

    from coreproc.base import boot

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with boot.paused():
            assert not gc.isenabled()
            kept = [[i] for i in range(1000)]
        assert gc.isenabled() and gc.get_freeze_count() == frozen
        gc.disable()
        with boot.paused():
            pass
        assert not gc.isenabled()
        boot.settle()
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(kept)
    finally:
        gc.unfreeze()
        gc.enable()


def test_boot_rejects_an_unknown_role() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "coreproc.base.boot", "nope"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "usage: python -m coreproc.base.boot core|worker" in proc.stderr


def test_a_dropped_in_process_engine_is_collected() -> None:
    """`LLM()` pauses the collector while it builds but freezes nothing: the model (whose module tree has
    reference cycles) is freed once the engine is closed and dropped."""
    import gc
    import weakref

    llm = LLM(show_progress=False)
    # a module in a cycle: its weight's loader is a bound method of the module
    embed = llm.engine.executor.worker.runner.model.model.embed_tokens
    assert embed.weight.weight_loader.__self__ is embed
    model = weakref.ref(embed)
    del embed
    assert gc.isenabled() and model() is not None
    llm.close()
    del llm
    gc.collect()
    assert model() is None
