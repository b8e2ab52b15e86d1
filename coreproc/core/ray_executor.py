"""The `ray` executor backend: one Ray actor per rank, placed on a Ray cluster by a placement group.

Runs in the scheduler process (`ember-core`, or the caller's under the offline `LLM`), as a Ray
driver: it joins the running cluster (`RAY_ADDRESS`, or the one `ray start` made on this host; a
fresh local one otherwise), or uses Ray as the caller already set it up (inside a Ray job). Each
rank is a `workers.ray_worker.RayWorker` actor in one bundle of a placement group
(`--placement-strategy PACK|SPREAD`); the ranks form their process group at the rank-0 actor's node
IP and a port free there. Actors get and answer protocol frames (`StepRequest` -> `StepResult`,
`WorkerReady`, `WorkerFailed`); an actor or node that dies becomes a `WorkerError` naming the rank
and node. `poll` waits on the oldest step's futures in short slices, returning early when the
core's client socket has input.
Ray is imported only when this backend is built.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from coreproc.base.config import EngineConfig
from coreproc.base.errors import ConfigError, EmberError, WorkerError
from coreproc.base.ipc import Codec
from coreproc.base.parallel_config import RAY_MISSING
from coreproc.base.protocol import (
    FROM_WORKER,
    RunnerOutput,
    SchedulerOutput,
    StepRequest,
    StepResult,
    WorkerFailed,
    WorkerReady,
)

log = logging.getLogger("ember.executor")

POLL_S = 0.01  # how long one wait on the actors' futures blocks before the client socket is looked at
PLACEMENT_TIMEOUT_S = 120.0


def import_ray() -> Any:
    """The ray module, or a one-line ConfigError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(RAY_MISSING) from None
    return ray


class RayExecutor:
    """Every rank runs every step as an actor call; the last stage's TP rank 0 answers the tokens."""

    def __init__(self, config: EngineConfig, ready_timeout: float = 600.0) -> None:
        self.ray = ray = import_ray()
        self.size = config.parallel.world_size
        self.token_rank = self.size - config.parallel.tensor_parallel_size  # the last stage's TP rank 0
        self.depth = config.parallel.pipeline_parallel_size  # steps in flight at most
        self.codec = Codec(FROM_WORKER)
        self.actors: list[Any] = []
        self.pg: Any = None
        self.nodes: list[str] = []  # per rank: "IP (node id)"
        self._owns_ray = not ray.is_initialized()
        self._pending: deque[tuple[int, list[Any]]] = deque()  # steps in flight, oldest first
        self._pings: dict[int, Any] = {}  # rank -> outstanding liveness probe
        self._step = 0
        try:
            if self._owns_ray:  # RAY_ADDRESS, else this host's running cluster, else a new local one
                ray.init()
            bundle = self.bundle(config)
            self.place(config, bundle)
            self.ready = self.start(config, int(bundle["CPU"]), ready_timeout)
        except BaseException:
            self.shutdown()
            raise

    def bundle(self, config: EngineConfig) -> dict[str, float]:
        """One rank's resources. CUDA: a GPU. CPU: its share of a node's cores (PACK: the largest
        node's cores among all ranks; SPREAD: the smallest node's among the ranks each node gets)."""
        if config.device.resolved_type == "cuda":
            return {"CPU": 1.0, "GPU": 1.0}
        cpus = [n["Resources"].get("CPU", 0) for n in self.ray.nodes() if n["Alive"]]
        cpus = [c for c in cpus if c > 0] or [1]
        if config.parallel.placement_strategy == "PACK":
            share = max(cpus) // self.size
        else:
            share = min(cpus) // math.ceil(self.size / len(cpus))
        return {"CPU": float(max(1, int(share)))}

    def place(self, config: EngineConfig, bundle: dict[str, float]) -> None:
        """Reserve one bundle per rank and learn which node each landed on."""
        from ray.util.placement_group import placement_group, placement_group_table

        strategy = config.parallel.placement_strategy
        self.pg = placement_group([bundle] * self.size, strategy=strategy)
        ready, _ = self.ray.wait([self.pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise ConfigError(
                f"the Ray cluster could not place {self.size} workers of {bundle} ({strategy}) "
                f"in {PLACEMENT_TIMEOUT_S:.0f}s; it has {self.ray.available_resources()} free"
            )
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in self.ray.nodes()}
        node_ids = placement_group_table(self.pg)["bundles_to_node_id"]
        self.nodes = [f"{ips.get(node_ids[r], '?')} (node {node_ids[r][:8]})" for r in range(self.size)]

    def start(self, config: EngineConfig, threads: int, timeout: float) -> list[WorkerReady]:
        """One actor per bundle; all join the group at rank 0's address and load their shards."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from workers.ray_worker import RayWorker

        gpus = 1 if config.device.resolved_type == "cuda" else 0
        actor_class = self.ray.remote(RayWorker)
        config_json = msgspec.json.encode(config)
        for rank in range(self.size):
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
            options = {"num_cpus": threads, "num_gpus": gpus, "scheduling_strategy": strategy}
            self.actors.append(actor_class.options(**options).remote(config_json, rank, threads))
        ip, port = self._get(0, self.actors[0].address.remote())
        init_method = f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"
        log.info("ray: %d workers on %s; process group at %s", self.size, ", ".join(self.nodes), init_method)
        starts = [a.start.remote(init_method, False) for a in self.actors]
        ready = self._gather(starts, time.monotonic() + timeout)
        assert all(isinstance(m, WorkerReady) for m in ready), "a worker answered start() out of turn"
        return ready

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Start a step on every rank; an actor runs its calls in order, so a pipeline stage takes its
        next step as soon as it has handed the previous one on."""
        assert len(self._pending) < self.depth, f"submit() with {self.depth} steps in flight"
        self._step += 1
        frames = self.codec.encode(StepRequest(self._step, scheduler_output))
        self._pending.append((self._step, [a.execute.remote(frames) for a in self.actors]))

    def poll(self, timeout_ms: int, wake: zmq.Socket | None = None) -> bool:
        """True once every rank has answered the oldest step (an answer may be a failure, which
        `wait` raises); False after `timeout_ms`, or as soon as `wake` has input."""
        assert self._pending, "poll() without submit()"
        refs = self._pending[0][1]
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            left = max(0.0, deadline - time.monotonic())
            done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=min(POLL_S, left))
            if len(done) == len(refs):
                return True
            if (wake is not None and wake.poll(0)) or time.monotonic() >= deadline:
                return False

    def wait(self) -> RunnerOutput:
        """The oldest step's output, once every rank has answered it."""
        assert self._pending, "wait() without submit()"
        step, refs = self._pending.popleft()
        results = self._gather(refs, None)
        assert all(isinstance(m, StepResult) and m.step_id == step for m in results), "answer of another step"
        return results[self.token_rank].output

    def check_alive(self) -> None:
        """Probe every actor without blocking; a probe that failed raises WorkerError."""
        if not self._pings:
            self._pings = {rank: a.ping.remote() for rank, a in enumerate(self.actors)}
            return
        done, _ = self.ray.wait(list(self._pings.values()), num_returns=len(self._pings), timeout=0)
        for rank, ref in list(self._pings.items()):
            if ref in done:
                del self._pings[rank]
                self._get(rank, ref)

    def _gather(self, refs: list[Any], deadline: float | None) -> list[Any]:
        """Each rank's decoded answer, in rank order; the first failure raises."""
        pending = dict(zip(refs, range(len(refs))))
        answers: dict[int, Any] = {}
        while pending:
            done, _ = self.ray.wait(list(pending), num_returns=len(pending), timeout=POLL_S)
            for ref in done:
                rank = pending.pop(ref)
                answers[rank] = self._decode(rank, self._get(rank, ref))
            if deadline is not None and time.monotonic() > deadline and pending:
                raise WorkerError(f"workers not ready in time ({len(answers)}/{len(refs)} ready)")
        return [answers[r] for r in range(len(refs))]

    def _get(self, rank: int, ref: Any) -> Any:
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayError as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            cause = next((line for line in lines if "because" in line), lines[0] if lines else "")
            raise WorkerError(
                f"worker {rank} on {self.nodes[rank]} died ({type(e).__name__}): {cause}"
            ) from None

    def _decode(self, rank: int, frames: list[bytes]) -> Any:
        msg = self.codec.decode(frames)
        if isinstance(msg, WorkerFailed):
            if msg.user_error:  # the worker refused what it was given: say so, in the user's words
                raise EmberError(f"worker {msg.rank}: {msg.error}")
            raise WorkerError(f"worker {msg.rank} on {self.nodes[rank]} failed: {msg.error}")
        return msg

    def shutdown(self) -> None:
        """Kill the actors, free their bundles, and leave Ray as it was found; never blocks long."""
        ray = self.ray
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:  # already gone with its node
                log.debug("ray.kill: %s", e)
        self.actors = []
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception as e:
                log.debug("remove_placement_group: %s", e)
            self.pg = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False
