"""Fuzzing a preload daemon's Unix socket with hypothesis.

One `ember preload` daemon on a tiny checkpoint; stray peers of the same user connect to its socket and
send noise, headers cut short, a good header over a garbage body, msgpack of the wrong shape, requests
of unknown kinds or with broken fingerprints, length prefixes past the limit, and file descriptors
(SCM_RIGHTS) alongside any of these. The daemon must answer an error or hang up, keep no descriptor a
peer sent, keep serving, and not let a stalled peer hold up an engine. At the end an engine still maps
its weights from it. CI runs EMBER_FUZZ_WIRE_EXAMPLES=200 cases; a long run:
`EMBER_FUZZ_WIRE_EXAMPLES=5000 pytest -q -s -m reliability tests/e2e/test_fuzz_preload.py`.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from coreproc.base.channel import MAX_BODY
from coreproc.base.config import EngineConfig
from coreproc.base.protocol import CacheRequest
from tests.server_util import eventually
from tests.wire_fuzz import FUZZ, Tally, values
from tests.workers.test_preload import _children, _cmd, engine, source, start_preload, stop
from workers.weight_cache.client import cache_socket, request

pytestmark = pytest.mark.reliability

ENC = msgspec.msgpack.Encoder()


@pytest.fixture(scope="module")
def preload(make_ckpt, tmp_path_factory):
    """(model, socket dir, socket path, daemon pid, its open descriptors) of one running daemon."""
    model = str(make_ckpt("llama"))
    sockdir = tmp_path_factory.mktemp("fuzzsock")
    sockdir.chmod(0o700)
    proc = start_preload(model, sockdir)
    for pipe in (proc.stdout, proc.stderr):  # the daemon logs a line per bad request: keep reading
        threading.Thread(target=pipe.read, daemon=True).start()
    try:
        config = EngineConfig.create(model, dtype="float32", socket_dir=str(sockdir))
        path = cache_socket(config, torch.device("cpu"), 0)
        pid = next(p for p in _children(proc.pid) if "ember-preload-target" in _cmd(p))
        assert ping_ok(path)
        yield model, sockdir, path, pid, open_fds(pid)
    finally:
        stop(proc)


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    for line in Tally.summary():
        print(line)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def head(n: int) -> bytes:
    return struct.pack(">Q", n)


def ping_ok(path: Path) -> bool:
    reply, fds = request(path, CacheRequest(kind="ping"), timeout=10)
    for fd in fds:
        os.close(fd)
    return reply.status == "ready"


def framed(body: bytes) -> bytes:
    return head(len(body)) + body


fingerprints = st.dictionaries(
    st.sampled_from(["checkpoint", "tp_size", "dtype", "role", "device", "x"]), values, max_size=4
)
request_maps = st.fixed_dictionaries(
    {"kind": st.sampled_from(["ping", "state", "evict", "", "PING"]) | values},
    optional={"fingerprint": st.none() | fingerprints | values},
)
payloads = st.one_of(
    st.binary(max_size=64),  # noise
    st.binary(min_size=1, max_size=7),  # a header cut short
    st.binary(max_size=64).map(framed),  # a good header, a garbage body
    values.map(ENC.encode).map(framed),  # msgpack of the wrong shape
    request_maps.map(ENC.encode).map(framed),  # unknown kinds, broken fingerprints
    st.tuples(st.integers(1, 2**64 - 1), st.binary(max_size=32)).map(lambda t: head(t[0]) + t[1]),
    st.tuples(st.integers(MAX_BODY + 1, 2**64 - 1), st.binary(max_size=8)).map(lambda t: head(t[0]) + t[1]),
)
# descriptors a peer may pass along: a file, both ends of a pipe, a socket pair, a memfd
FD_KINDS = st.lists(st.sampled_from(["file", "pipe", "socketpair", "memfd"]), max_size=10)  # past MAX_FDS


def make_fds(kinds: list[str], tmp: Path) -> list[int]:
    fds: list[int] = []
    for kind in kinds:
        if kind == "file":
            fds.append(os.open(tmp, os.O_RDONLY))
        elif kind == "pipe":
            fds.extend(os.pipe())
        elif kind == "socketpair":
            fds.extend(s.detach() for s in socket.socketpair())
        else:
            fds.append(os.memfd_create("fuzz"))
    return fds


def send_raw(path: Path, data: bytes, fds: list[int]) -> None:
    """One stray peer: `data` (descriptors on its first byte), then its half closed; reads any answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(str(path))
        try:
            if fds:
                socket.send_fds(conn, [data[:1] or b"\0"], fds)
                data = data[1:]
            conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)
            while conn.recv(1 << 16):
                pass
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon hung up first: allowed


@given(data=payloads, kinds=FD_KINDS)
@FUZZ
def test_daemon_answers_or_hangs_up_and_keeps_serving(preload, data, kinds):
    _, _, path, pid, _ = preload
    Tally.add("preload socket")
    fds = make_fds(kinds, Path(__file__))
    try:
        send_raw(path, data, fds)
    finally:
        for fd in fds:
            os.close(fd)
    assert Path(f"/proc/{pid}").exists(), f"the daemon died after {data!r}"


def test_descriptors_sent_with_requests_are_closed(preload):
    """The daemon kept every descriptor a peer sent (also with a request that did not decode): a peer
    could fill its descriptor table."""
    _, _, path, pid, _ = preload
    assert ping_ok(path)
    before = open_fds(pid)
    for data in [framed(ENC.encode({"kind": "ping"})), framed(b"\xc1garbage"), head(MAX_BODY + 1), b"\1\2"]:
        for _ in range(25):
            fds = make_fds(["pipe", "memfd"], Path(__file__))
            try:
                send_raw(path, data, fds)
            finally:
                for fd in fds:
                    os.close(fd)
    assert ping_ok(path)
    # each connection's thread closes what it was sent as it ends, on its own clock
    fds = eventually(lambda: open_fds(pid), lambda n: n <= before + 2)
    assert fds <= before + 2, f"{fds - before} descriptors leaked"


def test_a_stalled_peer_does_not_hold_up_an_engine(preload):
    """The daemon served one connection at a time: a peer that sent half a header (or nothing) held
    every engine's request for the 30 s read timeout."""
    _, _, path, _, _ = preload
    stalled = []
    try:
        for partial in [b"", b"\0\0\0", head(100) + b"\x81"]:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(str(path))
            conn.sendall(partial)
            stalled.append(conn)
        start = time.monotonic()
        assert ping_ok(path)
        # served on a thread of its own, the ping is answered at once; held behind the stalled peers it
        # would wait out the daemon's 30 s read timeout (the bound leaves a loaded host room)
        assert time.monotonic() - start < 10, "a stalled peer delayed the engine's request"
    finally:
        for conn in stalled:
            conn.close()


def test_an_engine_still_maps_its_weights_after_the_fuzzing(preload):
    model, sockdir, path, pid, fds_at_start = preload
    with engine(model, sockdir) as llm:
        assert source(llm) == ("ipc_cache", "")
        assert llm.generate(["hello"], use_tqdm=False)[0].outputs[0].token_ids
    assert open_fds(pid) <= fds_at_start + 2, "the daemon holds descriptors from the fuzzing"
