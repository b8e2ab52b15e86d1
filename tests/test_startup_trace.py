"""The start-up trace (coreproc/startup/trace.py) and the breakdown `ember bench restart --trace` prints.

Off without $EMBER_STARTUP_TRACE; with it, a phase is recorded even when it raises, and a live
`ember serve` writes the phases of each of its processes (frontend, core, worker), nested as they
run: the worker's weights load while the core waits for its ready, which is inside the frontend's
wait for the cores. Only the order and nesting are asserted, never a duration.
Run: `pytest -q tests/test_startup_trace.py`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from server_util import start_server, stop_server

from coreproc.startup import trace
from frontend.bench import restart_trace


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
        ("ember serve", "tokenizer"),
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
