"""The start-up trace (coreproc/base/trace.py) and the breakdown `ember bench restart --trace` prints.

Off without $EMBER_STARTUP_TRACE; with it, a phase is recorded even when it raises, and a live
`ember serve` writes the phases of each of its processes (frontend, core, worker), nested as they
run: the worker's weights load while the core waits for its ready, which is inside the frontend's
wait for the cores. Only the order and nesting are asserted, never a duration.
Run: `pytest -q tests/coreproc/base/test_trace.py`.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coreproc.base import trace
from frontend.bench import restart_trace
from tests.server_util import eventually, start_server, stop_server


@pytest.mark.unit
def test_off_without_the_variable_and_a_failed_phase_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "trace.jsonl"
    monkeypatch.delenv(trace.ENV, raising=False)
    with trace.phase("nothing"):
        pass
    trace.started()
    assert not path.exists()
    monkeypatch.setenv(trace.ENV, str(path))
    trace.started()
    with pytest.raises(ValueError), trace.phase("fails", process="tester"):
        raise ValueError("a failed start shows where")
    first, failed = trace.read(path)
    assert first["phase"] == "interpreter and imports" and first["pid"] == os.getpid()
    assert first["start"] <= first["end"] <= time.time()
    assert (failed["phase"], failed["process"]) == ("fails", "tester")


def inside(inner: dict, outer: dict) -> bool:
    return outer["start"] <= inner["start"] and inner["end"] <= outer["end"]


@pytest.mark.e2e
def test_a_served_start_records_every_process_in_order(make_ckpt, tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    proc, _ = start_server(str(make_ckpt("llama")), env={**os.environ, trace.ENV: str(path)})
    stop_server(proc)
    lines = trace.read(path)
    by = {(r["process"], r["phase"]): r for r in lines}
    for process, phase in [
        ("ember serve", "interpreter and imports"),
        ("ember serve", "the engine config"),
        ("ember serve", "build the app"),
        ("ember-core", "interpreter and imports"),
        ("ember-worker-0", "interpreter and imports"),
        ("ember-worker-0", "allocate the KV cache"),
    ]:
        assert (process, phase) in by, f"{process}: {phase} missing from {sorted(by)}"
    cores = by[("ember serve", "start the engine cores")]
    engine = by[("ember-core", "build the engine")]
    waiting = by[("ember-core", "wait for the workers' ready")]
    weights = by[("ember-worker-0", "load weights")]
    assert inside(engine, cores) and inside(waiting, engine) and inside(weights, waiting)
    assert by[("ember serve", "build the app")]["start"] >= cores["end"]
    start = restart_trace.StartTrace(path=path, launch=lines[0]["start"])
    table = restart_trace.table("warm", start).splitlines()
    assert table[0].startswith("breakdown of the warm start: ") and len(table) == 2 + len(lines)
    assert all(r["phase"] in row for r, row in zip(lines, table[2:]))


def standbys() -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(b"ember-standby-"):
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.add(int(entry.name))
        except OSError:
            pass
    return found


def launch(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`ember ARGV` as the console script runs it."""
    cmd = [sys.executable, "-m", "frontend.launch", *argv]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.e2e
def test_a_cold_start_takes_its_core_and_worker_from_standby(make_ckpt, tmp_path: Path) -> None:
    """`ember serve` starts its core on standby before its own imports, the core its worker: both are
    taken (their imports are recorded on standby, their start after), none is left waiting."""
    path = tmp_path / "trace.jsonl"
    before = standbys()
    proc = launch("serve", str(make_ckpt("llama")), "--port", "0", env={**os.environ, trace.ENV: str(path)})
    assert proc.stdout is not None
    for line in proc.stdout:
        if re.search(r"listening on http", line):
            break
    assert eventually(lambda: standbys() - before, lambda left: not left) == set()
    proc.send_signal(2)
    assert proc.wait(60) == 0
    by = {(r["process"], r["phase"]): r for r in trace.read(path)}
    for role, process in (("core", "ember-core"), ("worker", "ember-worker-0")):
        standby = by[(f"ember-{role} (standby)", "interpreter and imports, on standby")]
        assert by[(process, "interpreter and imports")]["pid"] == standby["pid"]  # the same process


@pytest.mark.e2e
def test_a_failed_start_leaves_no_standby(make_ckpt) -> None:
    before = standbys()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        proc = launch("serve", str(make_ckpt("llama")), "--port", str(taken.getsockname()[1]))
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "cannot listen" in err
    assert eventually(lambda: standbys() - before, lambda left: not left) == set()
