"""Live `ember serve` processes for end-to-end tests: start on a free port, stop, read /metrics."""

from __future__ import annotations

import re
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

T = TypeVar("T")


def start_server(
    model: str,
    *extra: str,
    name: str = "llama",
    verify: ssl.SSLContext | bool = True,
    stderr: int | None = None,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """`ember serve MODEL` on a free port; returns the process and its base URL (http:// or https://)
    once ready. `verify`: a context that trusts the certificate of a server with TLS; `stderr`:
    `subprocess.PIPE` to read the server's log (a short run: nothing drains it meanwhile); `env`: the
    server's environment (default: this one)."""
    cmd = [sys.executable, "-m", "frontend.cli", "serve", model, "--port", "0", "--dtype", "float32"]
    cmd += ["--served-model-name", name, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    lines = []
    while not (lines and "listening on" in lines[-1]) and proc.poll() is None:
        lines.append(proc.stdout.readline())
    match = re.search(r"https?://[\d.]+:\d+", lines[-1] if lines else "")
    assert match, f"no address in {lines!r}"
    assert "weights float32" in "".join(lines), "the start-up line reports weight memory by dtype"
    url = match.group(0)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2, verify=verify).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("server not ready")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def metric(url: str, name: str, label: str = "") -> float:
    """Sum of a metric's samples (optionally only those whose labels contain `label`)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and label in line
    ]
    assert values, f"{name} not in /metrics"
    return sum(values)


def eventually(read: Callable[[], T], done: Callable[[T], bool], timeout: float = 30.0) -> T:
    """Poll `read()` until `done` holds for its value, and return that value; past `timeout` return
    the last one (the caller's assertion then says what was wrong). For state that other processes
    publish on their own clock (engine stats reach /metrics every second): a fixed sleep before
    reading is a bet on how loaded the host is."""
    deadline = time.monotonic() + timeout
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.1)
        value = read()
    return value


def wait_idle(url: str, timeout: float = 30.0) -> None:
    """Until the engine reports no KV blocks in use and nothing running (stats refresh every second)."""

    def usage() -> tuple[float, float]:
        return metric(url, "ember_kv_cache_usage_ratio"), metric(url, "ember_num_requests_running")

    assert eventually(usage, lambda now: now == (0, 0), timeout) == (0, 0), "KV blocks still in use"
