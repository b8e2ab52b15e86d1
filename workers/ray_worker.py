"""One rank (pipeline stage x tensor-parallel rank) as a Ray actor: the `ray` backend's worker.

Runs in a Ray actor process on whichever node of the cluster its placement-group bundle landed on.
The core's `RayExecutor` (coreproc/core/ray_executor.py) makes it an actor with `ray.remote` and calls it
with the engine config as JSON and every message as the two frames (kind, msgpack body) of a
protocol struct, never a pickled Ember object: `start` joins the process group (gloo on CPU, NCCL on
CUDA) at the rank-0 actor's address, loads this rank's shard and answers `WorkerReady`; `execute`
takes a `StepRequest` and answers `StepResult` (the last stage's TP rank 0 carries the tokens). Any
failure is answered as `WorkerFailed`. This module imports ray only to learn its node's address.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import traceback
from typing import TYPE_CHECKING

import msgspec

from coreproc.base.config import EngineConfig
from coreproc.base.errors import EmberError
from coreproc.base.ipc import Codec
from coreproc.base.protocol import TO_WORKER, RunnerOutput, StepRequest, StepResult, WorkerFailed

if TYPE_CHECKING:
    from workers.worker import Worker

log = logging.getLogger("ember.worker")

Frames = list[bytes]  # [kind, body] as made by coreproc.base.ipc.Codec


class RayWorker:
    """A rank's Worker behind frame-in, frame-out calls; `num_threads` is its bundle's CPU count."""

    def __init__(self, config_json: bytes, rank: int, num_threads: int) -> None:
        logging.basicConfig(
            level=os.environ.get("EMBER_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s"
        )
        self.config = msgspec.json.decode(config_json, type=EngineConfig)
        self.rank = rank
        self.num_threads = num_threads
        self.codec = Codec(TO_WORKER)
        self.worker: Worker | None = None  # once started (torch is imported only in the actor)

    def address(self) -> tuple[str, int]:
        """This node's IP and a port free on it now: where rank 0 hosts the process-group rendezvous."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def start(self, init_method: str, show_progress: bool) -> Frames:
        """Join the group at `init_method`, load this rank's shard: WorkerReady (or WorkerFailed)."""
        try:
            import torch

            from workers.worker import Worker
            from workers.worker_proc import init_distributed

            torch.set_num_threads(self.num_threads)
            tp, pp = init_distributed(self.config, self.rank, init_method)
            parallel = dataclasses.replace(self.config.parallel, rank=self.rank)
            self.worker = Worker(dataclasses.replace(self.config, parallel=parallel), tp, pp)
            return self.codec.encode(self.worker.load(show_progress))
        except Exception as e:
            return self._failed(e)

    def execute(self, frames: Frames) -> Frames:
        """Run one StepRequest: StepResult (empty output on ranks other than 0), or WorkerFailed."""
        try:
            msg = self.codec.decode(frames)
            assert isinstance(msg, StepRequest), f"expected a StepRequest, got {type(msg).__name__}"
            assert self.worker is not None, "execute() before start()"
            output = self.worker.execute_model(msg.scheduler_output)
            answer = output if self.worker.returns_tokens else RunnerOutput()
            return self.codec.encode(StepResult(msg.step_id, self.rank, answer))
        except Exception as e:
            return self._failed(e)

    def ping(self) -> int:
        """A liveness probe the core sends while the engine is idle."""
        return self.rank

    def _failed(self, e: Exception) -> Frames:
        user = isinstance(e, EmberError)  # the core reports it in the user's words, once
        if not user:
            log.error("rank %d failed:\n%s", self.rank, traceback.format_exc())
        error = str(e) if user else f"{type(e).__name__}: {e}"
        return self.codec.encode(WorkerFailed(self.rank, error, user))
