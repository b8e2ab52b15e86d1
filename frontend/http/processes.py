"""Several HTTP frontend processes on one port: `ember serve --api-server-count N`.

Runs in the `ember serve` process (the parent: API server 0) and in the N - 1 children it starts once
the engine cores are ready. Every process binds the same port with SO_REUSEPORT, so the kernel spreads
connections among them, and each holds its own `DPEngineClient` to every core (tokenizing, chat
templates, detokenizing and streaming run in parallel). A child is the same `ember serve` command line
plus a hidden `--api-server-child` JSON ({"index", "addresses", "parent"}); it exits when the parent
does. Metrics use prometheus-client's multiprocess mode (a private directory named by
PROMETHEUS_MULTIPROC_DIR, set before prometheus_client is imported): request series add up over the
processes, and only API server 0 mirrors the cores' own stats.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from coreproc.base.errors import EmberError

CHILD_FLAG = "--api-server-child"
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"


def use_shared_metrics() -> Path:
    """A private directory for the processes' metrics (call before prometheus_client is imported)."""
    path = Path(tempfile.mkdtemp(prefix="ember-metrics-"))
    os.environ[METRICS_ENV] = str(path)
    return path


def remove_shared_metrics(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.environ.pop(METRICS_ENV, None)


def start_children(argv: list[str], count: int, port: int, addresses: list[str]) -> list[subprocess.Popen]:
    """Start API servers 1..count-1 on `port` and wait until each says it listens; EmberError if one
    exits first or takes over two minutes."""
    children: list[subprocess.Popen] = []
    try:
        for index in range(1, count):
            spec = json.dumps({"index": index, "addresses": addresses, "parent": os.getpid()})
            cmd = [sys.executable, "-m", "frontend.cli", *argv, "--port", str(port), CHILD_FLAG, spec]
            children.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
        for index, child in enumerate(children, start=1):
            _wait_listening(child, index, deadline=time.monotonic() + 120)
    except BaseException:
        stop_children(children, grace=0)
        raise
    return children


def _wait_listening(child: subprocess.Popen, index: int, deadline: float) -> None:
    assert child.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([child.stdout], [], [], 0.5)
        if ready:
            line = child.stdout.readline()
            if "listening" in line:
                return
            if not line and child.poll() is not None:
                break
        elif child.poll() is not None:
            break
    raise EmberError(f"API server {index} did not start (exit code {child.poll()})")


def stop_children(children: list[subprocess.Popen], grace: float = 30.0) -> None:
    """SIGTERM (they drain like the parent), then SIGKILL what is left."""
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    for child in children:
        try:
            child.wait(grace + 5.0)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(5.0)


def exit_with_parent(parent_pid: int) -> None:
    """A child API server ends (SIGTERM to itself: uvicorn drains) when the parent process is gone."""
    pidfd = os.pidfd_open(parent_pid)

    def watch() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="ember-parent-watch", daemon=True).start()
