"""Executors fan one scheduler step out to the workers and gather what they return.

Runs in the scheduler process. Every executor has the same calls: `submit(step)` starts a step,
`poll(timeout_ms, wake)` says whether the oldest submitted step is done (waiting at most `timeout_ms`,
and no longer once the `wake` socket, the core's clients', has input) and `wait()` returns that
step's `RunnerOutput`, so the core can schedule step N+1 while step N runs and answer its clients
meanwhile from its own loop. `InprocExecutor` holds one worker in this process (the offline engine, tests).
`MultiprocExecutor` spawns one worker process per rank (pipeline stage x tensor-parallel rank), talks
to them over a ZeroMQ ROUTER socket in the launch's private runtime directory, keeps up to one step
per pipeline stage in flight, and notices a dead worker within a poll interval. With `--nnodes N` it
starts only the head's ranks; the other nodes' ranks (`ember worker --headless`) reach it through
`coreproc.core.node_link.NodeLink` (TCP, CurveZMQ, heartbeats), and a lost node is a dead worker.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import time
from collections import deque
from pathlib import Path
from typing import Protocol

import msgspec
import zmq

from coreproc.base import trace
from coreproc.base.config import EngineConfig
from coreproc.base.errors import ConfigError, EmberError, WorkerError
from coreproc.base.ipc import Codec, ProtocolError, bind, ipc_endpoint
from coreproc.base.protocol import (
    FROM_WORKER,
    RunnerOutput,
    SchedulerOutput,
    Shutdown,
    StepRequest,
    StepResult,
    WorkerFailed,
    WorkerReady,
)
from coreproc.core.node_link import NodeLink
from coreproc.startup.spawn import spawn_worker

log = logging.getLogger("ember.executor")

POLL_MS = 100
LOST_PEER_WAIT_MS = 500  # how long a worker's failure waits for the news of a lost node


class Executor(Protocol):
    ready: list[WorkerReady]

    def submit(self, scheduler_output: SchedulerOutput) -> None: ...

    def poll(self, timeout_ms: int, wake: zmq.Socket | None = None) -> bool: ...

    def wait(self) -> RunnerOutput: ...

    def check_alive(self) -> None: ...

    def shutdown(self) -> None: ...


class InprocExecutor:
    """One worker in the calling process; `submit` runs the step at once."""

    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        from workers.worker import Worker

        worker = Worker(config)
        self.ready = [worker.load(show_progress)]
        self.worker: Worker | None = worker  # None once shut down (its memory freed)
        self._result: RunnerOutput | None = None

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        assert self.worker is not None, "submit() after shutdown()"
        self._result = self.worker.execute_model(scheduler_output)

    def poll(self, timeout_ms: int, wake: zmq.Socket | None = None) -> bool:
        return True  # `submit` ran the step

    def wait(self) -> RunnerOutput:
        result, self._result = self._result, None
        assert result is not None, "wait() without submit()"
        return result

    def check_alive(self) -> None:
        pass

    def shutdown(self) -> None:
        self.worker = None


class MultiprocExecutor:
    """One process per rank; every rank runs every step, the last stage's TP rank 0 returns the tokens."""

    def __init__(self, config: EngineConfig, runtime_dir: Path, ready_timeout: float = 600.0) -> None:
        par = config.parallel
        if par.node_rank != 0:
            raise ConfigError(
                f"node rank {par.node_rank} runs `ember worker --headless`; the engine runs on node rank 0"
            )
        self.size = par.world_size
        self.depth = par.pipeline_parallel_size  # steps in flight at most
        self.output_rank = (par.pipeline_parallel_size - 1) * par.tensor_parallel_size
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        endpoint = ipc_endpoint(runtime_dir, "workers")
        bind(self.sock, endpoint)
        self.codec = Codec(FROM_WORKER)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self.link: NodeLink | None = None  # the other nodes' ranks, with --nnodes > 1
        self._sock_of: dict[bytes, zmq.Socket] = {}  # identity -> the socket that reaches it
        self._local: dict[bytes, int] = {}  # identity -> rank, of the workers of this host
        self.identities = [f"w{rank}".encode() for rank in range(self.size)]
        self.procs: list = []  # subprocess.Popen or zygote_link.ForkedProcess
        self._step = 0
        self._pending: deque[int] = deque()  # step ids submitted and not yet waited for, oldest first
        self._done: dict[int, set[int]] = {}  # step id -> ranks that answered it
        self._outputs: dict[int, RunnerOutput] = {}  # step id -> the output rank's answer
        config_json = msgspec.json.encode(config)
        self._sock_of = {identity: self.sock for identity in self.identities}
        try:
            if par.nnodes > 1:
                self.link = NodeLink(self.ctx, config)
                self._poller.register(self.link.sock, zmq.POLLIN)
                self._poller.register(self.link.monitor, zmq.POLLIN)
                self._sock_of |= {self.identities[r]: self.link.sock for r in self.link.remote}
                log.info(
                    "waiting for %d ranks of other nodes on %s", len(self.link.remote), self.link.endpoint
                )
            with trace.phase("start workers"):
                for rank in par.node_ranks(0):
                    self._local[self.identities[rank]] = rank
                    argv = ["--rank", str(rank), "--endpoint", endpoint, "--runtime-dir", str(runtime_dir)]
                    argv += ["--parent-pid", str(os.getpid())]
                    self.procs.append(spawn_worker(config, argv, config_json))
            with trace.phase("wait for the workers' ready"):
                self.ready = self._wait_ready(ready_timeout)
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self, timeout: float) -> list[WorkerReady]:
        ready: dict[int, WorkerReady] = {}
        deadline = time.monotonic() + timeout
        while len(ready) < self.size:
            if time.monotonic() > deadline:
                raise WorkerError(f"workers not ready after {timeout:.0f}s ({len(ready)}/{self.size} ready)")
            msg = self._recv(POLL_MS)
            if isinstance(msg, WorkerReady):
                ready[msg.rank] = msg
        return [ready[r] for r in range(self.size)]

    def _recv(self, timeout_ms: int, wake: zmq.Socket | None = None) -> object | None:
        """One message from any worker, or None (also when `wake` has input); raises WorkerError on a
        worker's failure or death."""
        if wake is not None:
            self._poller.register(wake, zmq.POLLIN)
        try:
            events = dict(self._poller.poll(timeout_ms))
        finally:
            if wake is not None:
                self._poller.unregister(wake)
        if self.link is not None and self.link.monitor in events:
            self.link.check()
        msg: object = None
        if self.sock in events:
            msg = self._receive_local()
        elif self.link is not None and self.link.sock in events:
            msg = self.link.receive()
        if msg is not None:
            if isinstance(msg, WorkerFailed):
                if self.link is not None and not msg.user_error:  # a lost node fails its peers' collectives:
                    self.link.check(LOST_PEER_WAIT_MS)  # name the node, not the peer's error
                if msg.user_error:  # the worker refused what it was given: say so, in the user's words
                    raise EmberError(f"worker {msg.rank}: {msg.error}")
                raise WorkerError(f"worker {msg.rank} failed: {msg.error}")
            return msg
        self.check_alive()
        return None

    def _receive_local(self) -> object | None:
        """A message from a worker of this host. The socket is in the launch's private directory: a
        frame that does not decode means a broken worker (WorkerError); one from a peer that is not
        one of our ranks is dropped."""
        identity, *frames = self.sock.recv_multipart()
        if identity not in self._local:
            log.warning("dropped a message from %r, which is not one of this engine's workers", identity)
            return None
        try:
            return self.codec.decode(frames)
        except ProtocolError as e:
            raise WorkerError(f"worker {self._local[identity]} sent a malformed message: {e}") from None

    def check_alive(self) -> None:
        if self.link is not None:
            self.link.check()
        for rank, p in enumerate(self.procs):
            code = p.poll()
            if code is not None:
                raise WorkerError(f"worker {rank} (pid {p.pid}) died with exit code {code}")

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        assert len(self._pending) < self.depth, f"submit() with {self.depth} steps in flight"
        self._step += 1
        kind, body = self.codec.encode(StepRequest(self._step, scheduler_output))
        for identity in self.identities:
            self._sock_of[identity].send_multipart([identity, kind, body], copy=False)
        self._pending.append(self._step)
        self._done[self._step] = set()

    def poll(self, timeout_ms: int, wake: zmq.Socket | None = None) -> bool:
        """Take in the workers' answers for up to `timeout_ms`: True once every rank has answered the
        oldest step, False on timeout or as soon as `wake` has input (which is left unread)."""
        assert self._pending, "poll() without submit()"
        deadline = time.monotonic() + timeout_ms / 1000
        while not self._oldest_done():
            if wake is not None and wake.poll(0):
                return False
            msg = self._recv(max(0, math.ceil((deadline - time.monotonic()) * 1000)), wake)
            if msg is None and time.monotonic() >= deadline:
                return False
            self._take(msg)
        return True

    def wait(self) -> RunnerOutput:
        """The oldest step's output, once every rank has answered it (later steps' answers that come
        first are kept for their turn)."""
        while not self.poll(POLL_MS):
            pass
        step = self._pending.popleft()
        del self._done[step]
        return self._outputs.pop(step, RunnerOutput())

    def _oldest_done(self) -> bool:
        return len(self._done[self._pending[0]]) == self.size

    def _take(self, msg: object | None) -> None:
        if isinstance(msg, StepResult) and msg.step_id in self._done:
            self._done[msg.step_id].add(msg.rank)
            if msg.rank == self.output_rank:
                self._outputs[msg.step_id] = msg.output

    def shutdown(self) -> None:
        """Ask workers to exit, then make sure they did (no orphans)."""
        kind, body = self.codec.encode(Shutdown())
        local = dict(zip(self.identities, self.procs))
        for identity, sock in self._sock_of.items():
            if identity not in local or local[identity].poll() is None:
                try:
                    sock.send_multipart([identity, kind, body], flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5.0)
        self.sock.close(0)
        if self.link is not None:
            self.link.close()
        self.ctx.term()


def make_executor(
    config: EngineConfig, runtime_dir: Path | None = None, show_progress: bool = True
) -> Executor:
    """In-process for a single device, worker processes otherwise (or when a runtime dir is given);
    Ray actors with the ray backend."""
    if config.parallel.distributed_executor_backend == "ray":
        from coreproc.core.ray_executor import RayExecutor

        return RayExecutor(config)
    if config.parallel.world_size == 1 and runtime_dir is None:
        return InprocExecutor(config, show_progress)
    if runtime_dir is None:
        raise ValueError("tensor and pipeline parallelism need worker processes and a runtime directory")
    return MultiprocExecutor(config, runtime_dir)
