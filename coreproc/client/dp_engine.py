"""Several engine cores driven from one thread: data parallelism for the offline `LLM` and batch mode.

Runs in the caller's process. `DPEngine` has the calls of `EngineCore` that `LLM` and `ember batch`
use (add and abort requests, `step`, stats, shutdown) over D `EngineCore`s, each with its own worker
processes (so their steps run at the same time) and KV cache. A submission goes to the core a
`DPRouter` picks (least loaded by requests in flight, or holding its longest prefix). A step
launches every core's next step before waiting for any; with async scheduling or pipeline stages each
core keeps its own steps in flight instead. `make_engine(config)` builds one core or a `DPEngine`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from coreproc.base.config import EngineConfig
from coreproc.base.ipc import make_runtime_dir, remove_runtime_dir
from coreproc.base.protocol import EngineOutput, EngineRequest, SchedulerOutput, SchedulerStats
from coreproc.client.dp_router import DPRouter, merge_stats
from coreproc.core.engine import EngineCore
from coreproc.core.executor import make_executor
from coreproc.core.scheduler import Scheduler


class DPEngine:
    """D engine cores behind one `EngineCore`-like interface; not thread-safe."""

    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        self.config = config
        self._overlap = config.scheduler.async_scheduling or config.parallel.pipeline_parallel_size > 1
        self.cores: list[EngineCore] = []
        self._dirs: list[Path] = []
        try:
            for rank in range(config.parallel.data_parallel_size):
                parallel = dataclasses.replace(config.parallel, data_parallel_rank=rank)
                cfg = dataclasses.replace(config, parallel=parallel)
                self._dirs.append(make_runtime_dir())
                executor = make_executor(cfg, self._dirs[-1], show_progress and rank == 0)
                overlapped = config.scheduler.async_scheduling
                self.cores.append(EngineCore(cfg, executor, overlapped=overlapped))
        except BaseException:
            self.shutdown()
            raise
        self.router = DPRouter(
            [c.scheduler.kv.num_blocks for c in self.cores],
            config.parallel.dp_routing,
            config.cache.block_size,
            slack=max(8, config.scheduler.max_num_seqs // 2),
        )
        self._where: dict[str, int] = {}  # request id -> its core

    @property
    def scheduler(self) -> Scheduler:
        """The first core's scheduler (for what every core shares: adapters loaded at start, limits)."""
        return self.cores[0].scheduler

    def add_request(self, request: EngineRequest) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[EngineRequest]) -> None:
        """The sequences of one API request, together, on one core (InvalidParam, QueueFull)."""
        first = requests[0]
        hashes: list[int] = []
        if self.router.routing == "prefix":
            extra = (first.cache_salt, first.lora.name if first.lora else None)
            hashes = self.router.prefix_hashes(first.prompt_token_ids, (*extra, len(first.mm_refs)))
        rank = self.router.pick(hashes)
        self.cores[rank].add_requests(requests)  # raises before anything is recorded
        self.router.sent(rank, hashes, len(requests))
        for r in requests:
            self._where[r.request_id] = rank

    def abort_requests(self, request_ids: list[str]) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        for rank, core in enumerate(self.cores):
            mine = [rid for rid in request_ids if self._where.get(rid) == rank]
            if mine:
                outputs += core.abort_requests(mine)
        return self._retire(outputs, request_ids)

    def has_unfinished_requests(self) -> bool:
        return any(c.has_unfinished_requests() for c in self.cores)

    def step(self) -> list[EngineOutput]:
        """One step of every core with work, run at the same time."""
        outputs: list[EngineOutput] = []
        if self._overlap:
            for core in self.cores:
                if core.has_unfinished_requests():
                    outputs += core.step()  # its own steps in flight: overlapped or pipelined
        else:
            launched: list[tuple[EngineCore, SchedulerOutput]] = []
            for core in self.cores:
                step = core.launch()
                if step is not None:
                    launched.append((core, step))
            for core, step in launched:
                outputs += core.finish(step)
        return self._retire(outputs)

    def _retire(self, outputs: list[EngineOutput], aborted: Sequence[str] = ()) -> list[EngineOutput]:
        """Forget the requests that ended (finished, failed or aborted) and free their routing slots."""
        ended = [o.request_id for o in outputs if o.finished] + list(aborted)
        for rid in ended:
            rank = self._where.pop(rid, None)
            if rank is not None:
                self.router.done(rank)
        return outputs

    def stats(self) -> SchedulerStats:
        return merge_stats([c.stats() for c in self.cores])

    def reset_prefix_cache(self) -> int:
        self.router.forget_prefixes()
        return sum(c.reset_prefix_cache() for c in self.cores)

    def shutdown(self) -> None:
        try:
            for core in self.cores:
                core.shutdown()
        finally:
            for d in self._dirs:
                remove_runtime_dir(d)
            self._dirs = []


def make_engine(config: EngineConfig, show_progress: bool = True) -> EngineCore | DPEngine:
    """The engine of the offline APIs: one core, or a `DPEngine` with `data_parallel_size` > 1."""
    if config.parallel.data_parallel_size > 1:
        return DPEngine(config, show_progress)
    return EngineCore(config, show_progress=show_progress)
