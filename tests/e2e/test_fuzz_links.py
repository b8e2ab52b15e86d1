"""Fuzzing the head's workers' link (`--nnodes 2` on loopback, plain TCP) with hypothesis.

A head `ember-core` with one local rank waits for rank 1 of node 1 on the master port + 1. Before and
after that rank joins, stray peers send garbage there: noise, wrong kinds, truncated and bit-flipped
messages, hellos whose config does not decode, messages from connections that never said hello, and
raw TCP connections that send bytes (no ZMTP) and close. The head must log and drop them all: it
starts once the real rank joins and serves the offline engine's greedy tokens. CI runs
EMBER_FUZZ_WIRE_EXAMPLES=200 cases; a long run:
`EMBER_FUZZ_WIRE_EXAMPLES=5000 pytest -q -s -m reliability tests/e2e/test_fuzz_links.py`.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from coreproc import LLM
from coreproc.base.config import EngineConfig
from coreproc.base.protocol import RunnerOutput, SamplingParams, StepResult, WorkerHello, WorkerReady
from coreproc.client.sdk import EngineClient
from coreproc.startup.launcher import CoreProcess
from tests.wire_fuzz import EXAMPLES, FUZZ, Tally, garbage

pytestmark = pytest.mark.reliability

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
SAMPLES = [
    WorkerHello(rank=1, node_rank=1, config=b"{}"),
    WorkerHello(rank=1, node_rank=1, config=b'{"model": 3}'),
    WorkerReady(
        rank=1, num_kv_blocks=4, kv_bytes_per_block=1, weight_bytes=1, load_seconds=0.0, device="cpu"
    ),
    StepResult(1, 1, RunnerOutput()),
]
IDENTITIES = st.sampled_from([b"w1", b"w0", b"w9", b"", b"\xff" * 8])


def free_port_pair() -> int:
    """A port P with P + 1 free too (the head's master port and its workers' link)."""
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


@pytest.fixture(scope="module")
def head(make_ckpt):
    llama = str(make_ckpt("llama"))
    port = free_port_pair()
    nodes = dict(nnodes=2, master_addr="127.0.0.1", master_port=port, tensor_parallel_size=2)
    config = EngineConfig.create(llama, dtype="float32", max_model_len=128, **nodes)
    core = CoreProcess(config, wait=False)
    deadline = time.monotonic() + 120
    while True:  # the head listens once its executor starts
        try:
            socket.create_connection(("127.0.0.1", port + 1), timeout=1).close()
            break
        except OSError:
            if core.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            code = core.proc.poll()
            core.stop(grace=5)  # a head left running would outlive the module (and its sockets a later test)
            pytest.fail(f"the head never listened on {port + 1} (exit code {code})")
    ctx = zmq.Context()
    yield core, ctx, f"tcp://127.0.0.1:{port + 1}", llama, port
    core.stop(grace=5)
    ctx.term()


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    for line in Tally.summary():
        print(line)


def barrage(ctx: zmq.Context, endpoint: str, identity: bytes, frames: list[bytes], raw: bytes | None) -> None:
    """One stray peer: a ZeroMQ DEALER that sends `frames`, or a plain TCP connection sending `raw`."""
    if raw is not None:
        host, port = endpoint[len("tcp://") :].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            conn.sendall(raw)
        return
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 500)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(endpoint)
    sock.send_multipart(frames)
    sock.close()


stray = st.tuples(IDENTITIES, garbage(SAMPLES), st.none() | st.binary(max_size=64))


@given(peer=stray)
@FUZZ
def test_head_drops_garbage_while_waiting_for_the_node(head, peer):
    core, ctx, endpoint, _, _ = head
    Tally.add("workers' link: before the node joins")
    barrage(ctx, endpoint, *peer)
    assert core.proc.poll() is None, f"the head exited with {core.proc.returncode} after {peer!r}"


@pytest.fixture(scope="module")
def joined(head):
    core, _, _, llama, port = head
    cli = [sys.executable, "-m", "frontend.cli", "worker", "--headless", llama, "--dtype", "float32"]
    cli += ["--max-model-len", "128", "-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    worker = subprocess.Popen([*cli, "--master-port", str(port), "--node-rank", "1"])
    try:
        time.sleep(0.5)  # the last garbage cases reached the head before the rank's hello
        core.wait_ready()
        with LLM(llama, dtype="float32", max_model_len=128, show_progress=False) as llm:
            reference = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        client = EngineClient(core.address)
        yield client, reference
        client.close()
    finally:
        core.stop(grace=5)
        worker.wait(20)


def greedy(client: EngineClient) -> list[int]:
    return [t for out in client.generate(PROMPT, GREEDY) for t in out.new_token_ids]


@given(peer=stray)
@settings(FUZZ, max_examples=max(10, EXAMPLES // 4))
def test_head_drops_garbage_while_serving(head, joined, peer):
    core, ctx, endpoint, _, _ = head
    client, reference = joined
    Tally.add("workers' link: while serving")
    barrage(ctx, endpoint, *peer)
    assert greedy(client) == reference, f"after {peer!r}"


def test_a_stray_connection_from_the_nodes_host_is_not_a_lost_node(head, joined):
    """The head used to match a closed connection to ranks by peer IP: any TCP connection from the
    host of a node (a port probe, a second process) that closed looked like that node dying."""
    core, ctx, endpoint, _, _ = head
    client, reference = joined
    barrage(ctx, endpoint, b"", [], b"")
    time.sleep(0.5)
    assert greedy(client) == reference
    assert core.proc.poll() is None
