"""Fuzzing the wire codecs with hypothesis: garbage on the core's client socket and the workers' socket.

Every socket's `Codec` either decodes a message of its direction or raises `ProtocolError`, whatever
the frames. A live `ember-core` takes noise, wrong kinds, truncated and bit-flipped messages, wrong
frame counts, oversized frames and submissions with NaN, infinite, negative, 64-bit and out-of-vocab
values from a raw DEALER; after every case it must still answer a ping (twice, so an engine step ran in
between), and afterwards serve an SDK client the same greedy tokens as before with no KV block in use.
Garbage a worker receives (or sends) fails the engine loudly (`WorkerFailed`, `WorkerError`): those
sockets are private to one launch. CI runs EMBER_FUZZ_WIRE_EXAMPLES=200 cases per socket; a long run:
`EMBER_FUZZ_WIRE_EXAMPLES=5000 pytest -q -s -m reliability tests/e2e/test_fuzz_wire.py`.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import given

from coreproc.base.config import EngineConfig
from coreproc.base.errors import WorkerError
from coreproc.base.ipc import Codec, ProtocolError
from coreproc.base.protocol import (
    FROM_WORKER,
    KIND_OF,
    TO_CLIENT,
    TO_CORE,
    TO_WORKER,
    AbortRequests,
    EngineOutput,
    OutputBatch,
    RunnerOutput,
    SamplingParams,
    SchedulerOutput,
    Shutdown,
    StepRequest,
    StepResult,
    SubmitRequests,
    UtilityCall,
    UtilityResult,
    WorkerFailed,
    WorkerHello,
    WorkerReady,
    make_request,
)
from coreproc.client.sdk import EngineClient
from coreproc.core.executor import MultiprocExecutor
from coreproc.startup.launcher import CoreProcess
from coreproc.startup.spawn import spawn_worker
from tests.wire_fuzz import ENC, FUZZ, Tally, core_messages, garbage

pytestmark = pytest.mark.reliability

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
REPLY_TIMEOUT_S = 15.0
SAMPLES = [
    SubmitRequests([]),
    AbortRequests(["a", "b"]),
    UtilityCall(7, "stats"),
    UtilityCall(8, "load_lora", {"lora_name": "x", "lora_path": "/nonexistent"}),
    OutputBatch([EngineOutput("r", [1, 2])]),
    UtilityResult(1, {"a": 1}),
    StepRequest(3, SchedulerOutput()),
    Shutdown("bye"),
    StepResult(1, 0, RunnerOutput()),
    WorkerFailed(0, "boom"),
    WorkerHello(rank=1, node_rank=1, config=b"{}"),
]


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    for line in Tally.summary():
        print(line)


@given(frames=garbage(SAMPLES))
@FUZZ
def test_every_codec_decodes_its_direction_or_refuses(frames):
    Tally.add("codecs (4 directions)")
    for allowed in (TO_CORE, TO_CLIENT, TO_WORKER, FROM_WORKER):
        try:
            msg = Codec(allowed).decode(frames)
        except ProtocolError:
            continue
        assert isinstance(msg, allowed)


# ----------------------------------------------------------------------------- the core's client socket


@pytest.fixture(scope="module")
def core(make_ckpt):
    config = EngineConfig.create(
        str(make_ckpt("llama")), dtype="float32", max_model_len=128, max_num_batched_tokens=64
    )
    with CoreProcess(config, client_timeout=5.0) as proc:
        yield proc


class RawClient:
    """A DEALER that sends whatever frames it is given and checks every reply is well-formed."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.codec = Codec(TO_CLIENT)
        self.calls = itertools.count(1_000_000)
        self.admitted: set[str] = set()

    def ping(self) -> None:
        """Round trip through the core's loop; every message that comes back on the way must decode."""
        call_id = next(self.calls)
        self.sock.send_multipart(self.codec.encode(UtilityCall(call_id, "ping")))
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            msg = self.codec.decode(self.sock.recv_multipart())
            if isinstance(msg, OutputBatch):
                for out in msg.outputs:
                    (self.admitted.discard if out.finished else self.admitted.add)(out.request_id)
            elif isinstance(msg, UtilityResult) and msg.call_id == call_id:
                assert msg.result is True, msg
                return
        raise AssertionError("the core did not answer a ping")

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture(scope="module")
def raw(core):
    client = RawClient(core.address)
    yield client
    client.close()


@pytest.fixture(scope="module")
def reference(core) -> list[int]:
    with EngineClient(core.address) as client:
        return list(itertools.chain.from_iterable(o.new_token_ids for o in client.generate(PROMPT, GREEDY)))


def send_and_check(core: CoreProcess, raw: RawClient, frames: list[bytes], socket: str) -> None:
    Tally.add(socket)
    raw.sock.send_multipart(frames)
    still_serving(core, raw, frames)


def still_serving(core: CoreProcess, raw: RawClient, frames: list[bytes]) -> None:
    try:
        raw.ping()
        raw.ping()  # the core has stepped the engine since taking the frames
    except AssertionError:
        code = core.proc.poll()
        raise AssertionError(f"the core stopped answering (exit code {code}) after {frames!r}") from None


@given(frames=garbage(SAMPLES))
@FUZZ
def test_core_drops_garbage_from_a_client(core, raw, reference, frames):
    send_and_check(core, raw, frames, "core client socket: garbage")


@given(frames=core_messages(vocab=512))
@FUZZ
def test_core_refuses_wild_client_messages(core, raw, reference, frames):
    send_and_check(core, raw, frames, "core client socket: wild fields")


@pytest.mark.parametrize("extra", [0, 2**20 + 1])
def test_core_survives_oversized_frames(core, raw, reference, extra):
    """At the limit a submission is refused for what it holds; beyond it ZeroMQ drops the peer."""
    limit = core_limit(core)
    body = ENC.encode([[{"request_id": "big", "prompt_token_ids": [1] * ((limit + extra) // 2)}]])
    send_and_check(core, raw, [b"\x01", body], "core client socket: oversized")


def core_limit(core: CoreProcess) -> int:
    with EngineClient(core.address) as client:
        return int(client.info().limits["max_submit_bytes"])


def test_core_serves_normally_after_the_barrage(core, raw, reference):
    raw.sock.send_multipart(raw.codec.encode(AbortRequests(sorted(raw.admitted))))
    raw.ping()
    with EngineClient(core.address) as client:
        deadline = time.monotonic() + 30
        while (stats := client.stats()).has_work and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stats.num_blocks_in_use == 0 and not stats.has_work, stats
        again = list(itertools.chain.from_iterable(o.new_token_ids for o in client.generate(PROMPT, GREEDY)))
    assert again == reference
    assert core.proc.poll() is None


# ----------------------------------------------------------------------------- the workers' socket


@pytest.fixture(scope="module")
def stranger(core):
    """A peer on the core's workers' socket that is not one of its workers (the same user can reach it)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{core.runtime_dir / 'workers'}")
    yield sock
    sock.close()
    ctx.term()


@given(frames=garbage(SAMPLES))
@FUZZ
def test_executor_drops_what_a_stranger_sends_on_the_workers_socket(core, raw, stranger, frames):
    Tally.add("executor workers' socket: stranger")
    stranger.send_multipart(frames)
    raw.sock.send_multipart(raw.codec.encode(SubmitRequests([make_request(PROMPT, GREEDY)])))
    still_serving(core, raw, frames)  # the garbage reached the executor while a step ran


def test_garbage_from_a_worker_fails_the_engine_loudly():
    """A frame from one of the core's own workers that does not decode means a broken worker: a
    WorkerError, which the core turns into EngineDead for its clients and exit code 1 (it used to die
    of an uncaught ProtocolError, telling its clients nothing); a stranger's frame is dropped."""
    executor = MultiprocExecutor.__new__(MultiprocExecutor)  # just its socket, no worker processes
    ctx = zmq.Context()
    executor.sock = ctx.socket(zmq.ROUTER)
    executor.sock.bind("inproc://workers")
    executor.codec, executor._local = Codec(FROM_WORKER), {b"w0": 0}
    peers = []
    for identity in (b"w0", b"x9"):
        peer = ctx.socket(zmq.DEALER)
        peer.setsockopt(zmq.IDENTITY, identity)
        peer.connect("inproc://workers")
        peers.append(peer)
    try:
        peers[1].send_multipart([b"\x32", b"\xc1"])
        assert executor.sock.poll(5000) and executor._receive_local() is None
        peers[0].send_multipart([b"\x32", b"\xc1"])
        assert executor.sock.poll(5000)
        with pytest.raises(WorkerError, match="worker 0 sent a malformed message"):
            executor._receive_local()
    finally:
        for sock in (*peers, executor.sock):
            sock.close(0)
        ctx.term()


def test_garbage_to_a_worker_is_reported_not_a_hang(make_ckpt, tmp_path: Path):
    """A worker takes frames only from its core, in the launch's private directory: one that does not
    decode is a broken core, and the worker answers WorkerFailed and exits 1 at once."""
    config = EngineConfig.create(str(make_ckpt("llama")), dtype="float32", max_model_len=128)
    tmp_path.chmod(0o700)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path / 'workers'}"
    sock.bind(endpoint)
    argv = [
        "--rank",
        "0",
        "--endpoint",
        endpoint,
        "--runtime-dir",
        str(tmp_path),
        "--parent-pid",
        str(os.getpid()),
    ]
    proc = spawn_worker(config, argv, msgspec.json.encode(config))
    codec = Codec(FROM_WORKER)
    try:
        assert sock.poll(120_000), "the worker never said ready"
        identity, *frames = sock.recv_multipart()
        assert isinstance(codec.decode(frames), WorkerReady)
        sock.send_multipart([identity, KIND_OF[StepRequest], b"\x92\x01"])  # a StepRequest cut short
        assert sock.poll(10_000), "the worker hung on a malformed frame"
        failed = codec.decode(sock.recv_multipart()[1:])
        assert isinstance(failed, WorkerFailed) and "ProtocolError" in failed.error, failed
        assert proc.wait(10) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()
        ctx.term()
