"""Slow and silent clients against a live `ember serve`: they cannot hold its sockets or stall others.

A slowloris client (a request's headers a byte at a time) and a connection that never sends anything
are closed after `--request-read-timeout`; ten thousand idle connections at once leave the server
answering others at once, and are closed after the same timeout. (A client that never reads its
stream, oversize bodies and deeply nested JSON are in tests/coreproc/base/test_request_limits.py.)
Run: pytest -q -m reliability tests/e2e/test_hostile_clients.py
"""

from __future__ import annotations

import resource
import socket
import time

import httpx
import pytest

from tests.server_util import start_server, stop_server

pytestmark = pytest.mark.reliability

READ_TIMEOUT = 2.0
# Bounds on waits leave a loaded or slow host room, yet stay far below what each failure would take: a
# slow client that kept its socket sends its header for 16 s, a blocked server answers no one.
SLACK = 8.0
SERVED_WITHIN = 10.0  # a 4-token completion beside the hostile clients (a fraction of a second here)


@pytest.fixture(scope="module")
def server(make_ckpt):
    proc, url = start_server(str(make_ckpt("llama")), "--request-read-timeout", str(READ_TIMEOUT))
    yield url
    stop_server(proc)


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def closed_by_server(sock: socket.socket, within: float) -> float | None:
    """Seconds until the server closed `sock` (EOF or reset), or None if it stayed open `within`."""
    start = time.monotonic()
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except OSError:
        pass  # reset: closed too
    return time.monotonic() - start


def complete(url: str) -> float:
    start = time.monotonic()
    body = {"model": "llama", "prompt": "def f(x):", "max_tokens": 4}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    return time.monotonic() - start


def test_slowloris_headers_are_cut_off_while_others_are_served(server) -> None:
    slow = connect(server)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: ember\r\n")
    started = time.monotonic()
    header = b"X-Slow: " + b"a" * 64
    closed = False
    for byte in header:  # one byte every 0.25 s: a whole request never arrives
        try:
            slow.sendall(bytes([byte]))
        except OSError:
            closed = True
            break
        if time.monotonic() - started < READ_TIMEOUT:
            assert complete(server) < SERVED_WITHIN  # others are served meanwhile
        time.sleep(0.25)
    waited = time.monotonic() - started
    assert closed or closed_by_server(slow, SLACK) is not None, "the slow client still holds its socket"
    assert waited < READ_TIMEOUT + SLACK
    slow.close()


def test_a_connection_that_sends_nothing_is_closed(server) -> None:
    silent = connect(server)
    took = closed_by_server(silent, READ_TIMEOUT + SLACK)
    assert took is not None and took >= READ_TIMEOUT - 0.5
    silent.close()


def test_ten_thousand_idle_connections_do_not_lock_others_out(server) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 10_000
    if soft < want + 200 <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want + 200, hard))
    count = min(want, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 200)
    idle = []
    try:
        for _ in range(count):
            idle.append(connect(server))
        opened = time.monotonic()
        latency = complete(server)
        health = httpx.get(f"{server}/health", timeout=10)
        print(f"{count} idle connections open: a completion took {latency * 1000:.0f} ms")
        assert health.status_code == 200 and latency < SERVED_WITHIN
        time.sleep(max(0.0, READ_TIMEOUT + 1.5 - (time.monotonic() - opened)))
        sample = idle[:: max(1, count // 50)]
        assert all(closed_by_server(s, SLACK) is not None for s in sample), "idle connections still held"
        assert complete(server) < SERVED_WITHIN
    finally:
        for s in idle:
            s.close()
