"""Faults of whole processes under load, with what the clients see and how long it takes.

A stopped core (SIGSTOP: it answers nothing) is given up by the frontend after 10 s of silence: the
streams end with an error event, and with no core left `ember serve` kills it and exits 1 (for a
supervisor to restart it). A SIGKILLed frontend leaves no process behind:
the cores notice their launcher is gone and stop, and their workers follow. (Workers killed or
stopped, cores killed, other nodes and Ray nodes lost are in test_multiproc, test_server,
test_data_parallel, test_multinode and test_ray; docs/RELIABILITY.md collects the times.)
Run: pytest -q -m reliability tests/test_faults.py
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from server_util import start_server, stop_server
from test_multiproc import children, cmdline, gone

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
        assert took < 20.0
        # `ember serve` kills the core it gave up and exits 1, for a supervisor to restart it
        assert proc.wait(20) == 1
        assert gone([core], timeout=10)
    finally:
        if os.path.exists(f"/proc/{core}"):
            os.kill(core, signal.SIGCONT)
        stop_server(proc)


def test_a_killed_frontend_leaves_no_process(make_ckpt) -> None:
    proc, url = start_server(str(make_ckpt("llama")), "--api-server-count", "2", "-dp", "2")
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
    stop_server(proc)
