"""Faults of whole processes under load, with what the clients see and how long it takes.

A stopped core (SIGSTOP: it answers nothing) is given up by the frontend after 10 s of silence: the
streams end with an error event, and with no core left `ember serve` kills it and exits 1 (for a
supervisor to restart it). A stopped frontend loses nothing: the core aborts its requests after its
client timeout, and once resumed every stream ends and the server serves on. A SIGKILLed frontend
leaves no process behind: the cores notice their launcher is gone and stop, and their workers follow;
so does one stopped or killed while the model loads (the core and workers do not load on).
SIGTERM is the normal stop, not a fault, but it is checked here as a whole: open streams finish, every
process stops in order, and the exit status is 0.
A stopped preload daemon costs a starting engine `STATE_TIMEOUT`, after which it loads from disk.
`ember batch` whose output cannot be written (a full disk, a file size limit) stops with one line,
leaves whole lines only, and a rerun once there is room completes the file without a line lost or
repeated. (Workers killed or stopped, cores killed, other nodes and Ray nodes lost are in
test_multiproc, test_server, test_data_parallel, test_multinode and test_ray; docs/RELIABILITY.md
collects the times.)
Run: pytest -q -m reliability tests/e2e/test_faults.py
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from coreproc import LLM
from frontend.cli import main
from tests.coreproc.client.test_batch import (
    REPO,
    by_id,
    comparable,
    engine_flags,
    read_records,
    resume_items,
    write_jsonl,
)
from tests.proc_util import children, cmdline, gone
from tests.server_util import metric, start_server, stop_server
from tests.workers.test_preload import engine, source, start_preload, stop, tokens
from tools import soak
from workers.weight_cache import client as preload_client

pytestmark = pytest.mark.reliability

LONG = {"model": "llama", "prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": True}


def descendants(pid: int) -> list[int]:
    out, frontier = [], [pid]
    while frontier:
        kids = [k for p in frontier for k in children(p)]
        out += kids
        frontier = kids
    return out


def test_a_stopped_core_is_given_up_and_its_streams_end(make_ckpt) -> None:
    proc, url = start_server(str(make_ckpt("llama")))
    core = next(c for c in children(proc.pid) if "ember-core" in cmdline(c))
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            os.kill(core, signal.SIGSTOP)
            stopped = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
            took = time.monotonic() - stopped
        assert any('"error"' in line and "has not answered" in line for line in rest), rest[-3:]
        print(f"core stopped: the stream ended with an error after {took:.1f} s")
        assert took < 30.0  # about 12 s (the 10 s give-up plus a stats call); never without the check
        # `ember serve` kills the core it gave up and exits 1, for a supervisor to restart it
        assert proc.wait(20) == 1
        assert gone([core], timeout=10)
    finally:
        if os.path.exists(f"/proc/{core}"):
            os.kill(core, signal.SIGCONT)
        stop_server(proc)


def test_a_stopped_frontend_resumes_and_no_stream_hangs(make_ckpt) -> None:
    # streams that outlast the stop: the core aborts them after 10 s without a heartbeat, and queues
    # thousands of outputs for the stopped frontend meanwhile
    proc, url = start_server(str(make_ckpt("llama", max_position_embeddings=8192)))
    ends: list[list[str]] = []

    def one_stream() -> None:
        body = LONG | {"max_tokens": 8000}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            ends.append([line for line in resp.iter_lines() if line.startswith("data: ")][-2:])

    clients = [threading.Thread(target=one_stream) for _ in range(4)]
    try:
        for c in clients:
            c.start()
        deadline = time.monotonic() + 30
        while metric(url, "ember_num_requests_running") < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(12)  # the fault itself: longer than the core's 10 s client timeout
        os.kill(proc.pid, signal.SIGCONT)
        resumed = time.monotonic()
        for c in clients:
            c.join(60)
        assert not any(c.is_alive() for c in clients), "a stream hung after the frontend resumed"
        took = time.monotonic() - resumed
        assert all(last[-1] == "data: [DONE]" and '"finish_reason"' in last[0] for last in ends), ends
        reasons = {json.loads(last[0][6:])["choices"][0]["finish_reason"] for last in ends}
        print(
            f"frontend stopped 12 s: every stream ended {took:.2f} s after SIGCONT, finish reasons {reasons}"
        )
        assert soak.left_over(url) == {}  # no KV block, request or stream left anywhere
        reply = httpx.post(
            f"{url}/v1/completions", json=LONG | {"stream": False, "max_tokens": 4}, timeout=30
        )
        assert reply.status_code == 200
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        stop_server(proc)


def test_a_stopped_preload_daemon_costs_a_starting_engine_only_its_timeout(
    make_ckpt, tmp_path, monkeypatch
) -> None:
    model = str(make_ckpt("llama"))
    with LLM(model, dtype="float32", show_progress=False) as llm:
        disk = tokens(llm)
    sock = tmp_path / "s"
    sock.mkdir(mode=0o700)
    daemon = start_preload(model, sock)
    pid = next(p for p in descendants(daemon.pid) if "ember-preload-target" in cmdline(p))
    monkeypatch.setattr(preload_client, "STATE_TIMEOUT", 2.0)  # 10 s by default
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with engine(model, sock) as llm:
            took = time.monotonic() - start
            where, why = source(llm)
            assert where == "disk" and "did not answer in 2 s" in why, why
            assert tokens(llm) == disk
        print(f"preload daemon stopped: the engine loaded from disk after {took:.1f} s")
        assert took < 30
    finally:
        os.kill(pid, signal.SIGCONT)
        stop(daemon)


def private_runtime(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A directory for a server's runtime directories (sockets), and the environment that puts them there."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    return run, {**os.environ, "XDG_RUNTIME_DIR": str(run)}


def test_a_killed_frontend_leaves_no_process(make_ckpt, tmp_path) -> None:
    run, env = private_runtime(tmp_path)
    proc, url = start_server(str(make_ckpt("llama")), "--api-server-count", "2", "-dp", "2", env=env)
    assert len(list(run.glob("ember-*"))) == 2, "each core's runtime directory"
    tree = descendants(proc.pid)
    assert len([p for p in tree if "ember-core" in cmdline(p)]) == 2
    with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(10)
    assert gone(tree, timeout=30), [cmdline(p) for p in tree if os.path.exists(f"/proc/{p}")]
    print(f"frontend killed: all {len(tree)} processes gone after {time.monotonic() - killed:.1f} s")
    assert not list(run.glob("ember-*")), "the cores remove the runtime directories their launcher made"
    stop_server(proc)


def titled(prefix: str) -> set[int]:
    """Processes whose title starts with `prefix` (workers forked by a preload zygote are nobody's
    descendants here)."""
    return {
        int(e.name)
        for e in Path("/proc").iterdir()
        if e.name.isdigit() and cmdline(int(e.name)).startswith(prefix)
    }


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_frontend_gone_mid_load_takes_its_core_and_workers(make_ckpt, tmp_path, sig) -> None:
    """A launcher stopped or killed while the model loads leaves nothing loading on. Here a stopped
    preload daemon holds the worker's load for 10 s (`STATE_TIMEOUT`); the core and worker must not."""
    model = str(make_ckpt("llama"))
    sock = tmp_path / "s"
    sock.mkdir(mode=0o700)
    daemon = start_preload(model, sock)
    target = next(p for p in descendants(daemon.pid) if "ember-preload-target" in cmdline(p))
    os.kill(target, signal.SIGSTOP)
    before = titled("ember-worker") | titled("ember-core")  # the preload's zygote forks both
    proc = None
    try:
        cmd = [sys.executable, "-m", "frontend.cli", "serve", model, "--port", "0", "--dtype", "float32"]
        cmd += ["--load-format", "ipc_cache", "--socket-dir", str(sock)]
        run, env = private_runtime(tmp_path)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + 60
        while not titled("ember-worker") - before:
            assert time.monotonic() < deadline and proc.poll() is None, "no worker started"
            time.sleep(0.05)
        time.sleep(1.0)  # loading: the worker waits on the stopped daemon
        tree = sorted(set(descendants(proc.pid)) | (titled("ember-worker") | titled("ember-core")) - before)
        assert any("ember-core" in cmdline(p) for p in tree), [cmdline(p) for p in tree]
        os.kill(proc.pid, sig)
        stopped = time.monotonic()
        proc.wait(10)
        assert gone(tree, timeout=5), [cmdline(p) for p in tree if os.path.exists(f"/proc/{p}")]
        took = time.monotonic() - stopped
        print(f"frontend {sig.name} mid-load: core and worker gone after {took:.2f} s")
        assert not list(run.glob("ember-*")), "the core removes the runtime directory its launcher made"
    finally:
        if proc is not None and proc.poll() is None:  # a failed check: the server must not outlive it
            proc.kill()
            proc.wait(10)
        os.kill(target, signal.SIGCONT)
        stop(daemon)


def test_sigterm_drains_streams_then_stops_every_process_and_exits_0(make_ckpt, tmp_path) -> None:
    """What systemd, Kubernetes and `docker stop` send: an open stream runs to its end, then the API
    server children and the cores stop in order (no core finds its launcher gone) and the exit is 0."""
    run, env = private_runtime(tmp_path)
    proc, url = start_server(
        str(make_ckpt("llama")), "--api-server-count", "2", "-dp", "2", stderr=subprocess.PIPE, env=env
    )
    tree = descendants(proc.pid)
    with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        rest = list(lines)
    events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    assert len(events) > 100, "the stream was still running when the signal came"
    assert (
        events[-1]["choices"][0]["finish_reason"] == "length" and [x for x in rest if x][-1] == "data: [DONE]"
    )
    assert proc.wait(60) == 0
    assert gone(tree), [cmdline(p) for p in tree if os.path.exists(f"/proc/{p}")]
    log = proc.stderr.read()
    assert "launching process is gone" not in log and "ERROR" not in log, log
    assert not list(run.glob("ember-*")), "runtime directories removed"
    took = time.monotonic() - signalled
    print(f"SIGTERM: the stream finished and all {len(tree)} processes exited 0 in {took:.1f} s")


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Callable[[], None]]:
    """A tmpfs of `size` mounted at `path`; yields a function that gives it room. Needs root."""
    path.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield lambda: subprocess.run(["mount", "-o", "remount,size=4m", str(path)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("how", ["disk full", "file size limit"])
def test_batch_output_that_cannot_be_written(make_ckpt, tmp_path, capsys, how) -> None:
    items = resume_items(48)
    inp = write_jsonl(tmp_path / "in.jsonl", items)
    flags = engine_flags(str(make_ckpt("llama")), "--max-num-seqs", "4")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with contextlib.ExitStack() as stack:
        if how == "disk full":  # a 16 KiB filesystem: about twenty records fit
            make_room = stack.enter_context(small_disk(tmp_path / "disk", "16k"))
            out, reason, limit = tmp_path / "disk" / "out.jsonl", "No space left on device", None
        else:  # RLIMIT_FSIZE: writes past 12,000 bytes fail with EFBIG
            out, reason, limit = tmp_path / "out.jsonl", "File too large", 12_000
            make_room = lambda: None  # noqa: E731 (the rerun runs without the limit)

        def cap_file_size() -> None:
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        cmd = [sys.executable, "-m", "coreproc", "batch", "-i", str(inp), "-o", str(out), *flags]
        run = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, preexec_fn=cap_file_size
        )
        assert run.returncode == 1, run.stderr[-2000:]
        written = out.read_bytes()
        assert written.endswith(b"\n"), "a torn record was left in the output"
        done = len(read_records(out))  # every line is a whole record
        assert 0 < done < len(items)
        assert "Traceback" not in run.stderr
        assert run.stderr.strip().splitlines()[-1] == (
            f"ember batch: error: cannot write the output file {out}: {reason}; "
            f"{len(items) - done} requests not finished; rerun with the same -o to resume"
        )
        make_room()
        assert main(["batch", "-i", str(inp), "-o", str(out), *flags]) == 0
        assert f"{len(items) - done} done, 0 errors, {done} already in the output" in capsys.readouterr().err
        assert out.read_bytes().startswith(written)
        resumed = by_id(read_records(out))
    clean = tmp_path / "clean.jsonl"
    assert main(["batch", "-i", str(inp), "-o", str(clean), *flags]) == 0
    reference = by_id(read_records(clean))
    assert {k: comparable(v) for k, v in resumed.items()} == {k: comparable(v) for k, v in reference.items()}
