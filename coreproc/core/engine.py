"""EngineCore: the scheduler loop around an executor, as a short named sequence per step.

Runs in the scheduler process (or in-process under the offline `LLM` and batch mode). Takes
`EngineRequest`s and aborts, produces `EngineOutput`s. `step()` = schedule -> execute -> update.
`step_overlapped()` keeps one step in flight: it schedules step N+1 while the workers run step N
(tokens being sampled are held as placeholders), which hides the scheduler's work behind the model's.
With P pipeline stages both calls run `step_pipelined()`: up to P micro-batches of disjoint requests in
flight, so every stage has work while the others run theirs.
The KV block count comes from the workers' `WorkerReady` messages, never from the config.
Never stuck: steps that schedule nothing while work is queued fail that work, and `check_stall()`
(the watchdog, called from the core loop, while waiting on workers and by `stats()`) reports work held
with no step completed for `stall_timeout` seconds, logging the scheduler state once per stall.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from pathlib import Path

from coreproc.base.config import EngineConfig
from coreproc.base.ipc import make_runtime_dir, remove_runtime_dir
from coreproc.base.protocol import EngineOutput, EngineRequest, SchedulerOutput, SchedulerStats
from coreproc.core.executor import Executor, make_executor
from coreproc.core.scheduler import Scheduler

log = logging.getLogger("ember.core")

# consecutive steps that schedule nothing while work is queued before the engine declares itself stuck
MAX_IDLE_STEPS = 4


class EngineCore:
    """Scheduler + executor; not thread-safe (one caller drives the steps)."""

    def __init__(
        self, config: EngineConfig, executor: Executor | None = None, show_progress: bool = True
    ) -> None:
        self.config = config
        self._runtime_dir: Path | None = None
        if executor is None:
            if config.parallel.world_size > 1:
                self._runtime_dir = make_runtime_dir()
            try:
                executor = make_executor(config, self._runtime_dir, show_progress)
            except BaseException:
                self._remove_runtime_dir()
                raise
        self.executor = executor
        num_blocks = min(r.num_kv_blocks for r in self.executor.ready)
        self.scheduler = Scheduler(config, num_blocks)
        self._idle_steps = 0
        self._in_flight: SchedulerOutput | None = None
        self.depth = config.parallel.pipeline_parallel_size  # micro-batches in flight at most
        self._batches: deque[SchedulerOutput] = deque()  # pipeline micro-batches in flight, oldest first
        self.max_steps_in_flight = 0
        self.last_step_end = time.monotonic()
        self._stall_reported = False

    def add_request(self, request: EngineRequest) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[EngineRequest]) -> None:
        """Add the sequences of one API request, all or none (InvalidParam, QueueFull)."""
        idle = not self.has_unfinished_requests()
        self.scheduler.add_requests(requests)
        if idle:  # the stall clock starts when work arrives, not at the last step of an idle engine
            self.last_step_end = time.monotonic()

    def abort_requests(self, request_ids: list[str]) -> list[EngineOutput]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None or bool(self._batches)

    def step(self) -> list[EngineOutput]:
        """Run one engine step; returns the outputs of every request that made progress."""
        if self.depth > 1:
            return self.step_pipelined()
        if self._in_flight is not None:
            return self.step_overlapped()
        launched = self.launch()
        return [] if launched is None else self.finish(launched)

    def launch(self) -> SchedulerOutput | None:
        """The first half of a synchronous `step`: schedule and submit (None: nothing to do). Several
        engines launched before any finishes run their steps at the same time."""
        if not self.scheduler.has_unfinished_requests():
            return None
        scheduler_output = self.scheduler.schedule()
        self.executor.submit(scheduler_output)
        return scheduler_output

    def finish(self, scheduler_output: SchedulerOutput) -> list[EngineOutput]:
        """The second half of a synchronous `step`: wait for the launched step and take in its result."""
        return self._finish(scheduler_output)

    def step_overlapped(self) -> list[EngineOutput]:
        """Like `step`, but the next step is scheduled and submitted before this call returns."""
        if self.depth > 1:
            return self.step_pipelined()
        if self._in_flight is None:
            if not self.scheduler.has_unfinished_requests():
                return []
            self._in_flight = self.scheduler.schedule()
            self.executor.submit(self._in_flight)
        running, self._in_flight = self._in_flight, None
        upcoming = self.scheduler.schedule() if self.scheduler.has_unfinished_requests() else None
        outputs = self._finish(running)
        if upcoming is not None and (upcoming.total_num_scheduled_tokens or upcoming.finished_req_ids):
            self.executor.submit(upcoming)
            self._in_flight = upcoming
        return outputs

    def step_pipelined(self) -> list[EngineOutput]:
        """Pipeline parallelism: submit a micro-batch of requests not already in flight while fewer than
        `depth` are; once the queue is full or nothing more can be scheduled, finish the oldest. Returns
        [] while it is still filling the queue."""
        if len(self._batches) < self.depth and self.scheduler.has_unfinished_requests():
            batch = self.scheduler.schedule()
            # an empty step goes out only with ids the workers must forget, or to count as idle
            if batch.total_num_scheduled_tokens or batch.finished_req_ids or not self._batches:
                self.executor.submit(batch)
                self._batches.append(batch)
                self.max_steps_in_flight = max(self.max_steps_in_flight, len(self._batches))
                if batch.total_num_scheduled_tokens and len(self._batches) < self.depth:
                    return []
        if not self._batches:
            return []
        return self._finish(self._batches.popleft())

    def _finish(self, scheduler_output: SchedulerOutput) -> list[EngineOutput]:
        runner_output = self.executor.wait()
        self.last_step_end = time.monotonic()
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._idle_steps = 0 if scheduler_output.total_num_scheduled_tokens else self._idle_steps + 1
        if self._idle_steps > MAX_IDLE_STEPS and self.scheduler.has_unfinished_requests():
            # never sit "healthy but stuck": fail what is queued, loudly, rather than spin
            log.error("scheduler made no progress for %d steps; failing queued requests", self._idle_steps)
            outputs += self.scheduler.fail_all("the engine could not schedule queued requests (no progress)")
            self._idle_steps = 0
        return outputs

    def check_stall(self) -> str | None:
        """The watchdog: why the engine is stuck (work held, no step done for `stall_timeout`), or None."""
        timeout = self.config.scheduler.stall_timeout
        idle = time.monotonic() - self.last_step_end
        if not self.has_unfinished_requests() or idle <= timeout:
            self._stall_reported = False
            return None
        reason = f"the engine holds work but has not completed a step for {idle:.0f}s (limit {timeout:g}s)"
        if not self._stall_reported:
            self._stall_reported = True
            log.error("%s; scheduler state: %s", reason, json.dumps(self.scheduler.describe()))
        return reason

    def stats(self) -> SchedulerStats:
        """Scheduler counters plus progress: how long since a step finished, whether work waits, and
        the watchdog's verdict (`stalled`: a reason, or None)."""
        stats = self.scheduler.stats()
        stats.has_work = self.has_unfinished_requests()
        stats.max_steps_in_flight = max(self.max_steps_in_flight, 1 if stats.num_steps else 0)
        stats.seconds_since_step = time.monotonic() - self.last_step_end
        stats.stalled = self.check_stall()
        return stats

    def reset_prefix_cache(self) -> int:
        return self.scheduler.kv.reset_prefix_cache()

    def _remove_runtime_dir(self) -> None:
        if self._runtime_dir is not None:
            remove_runtime_dir(self._runtime_dir)
            self._runtime_dir = None

    def shutdown(self) -> None:
        try:
            self.executor.shutdown()
        finally:
            self._remove_runtime_dir()
