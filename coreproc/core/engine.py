"""EngineCore: the scheduler loop around an executor, as a short named sequence per step.

Runs in the scheduler process (or in-process under the offline `LLM` and batch mode). Takes
`EngineRequest`s and aborts, produces `EngineOutput`s. One of three step functions is chosen when the
engine is built, and `step()` (blocking) and `advance()` (never waits on the workers) both run it:
- sync: schedule -> submit -> wait -> update;
- overlapped (`async_scheduling`): step N+1 is scheduled while the workers run step N (tokens being
  sampled are held as placeholders) and submitted as soon as N is taken in, hiding the scheduler's
  work behind the model's;
- pipelined (P pipeline stages): up to P micro-batches of disjoint requests in flight, so every stage
  has work while the others run theirs.
The core process's loop (coreproc.core.server) calls `advance()` and, while a step is in flight,
waits on the executor's `poll` and its client socket together: requests and aborts reach the
scheduler between calls, never from inside one.
The KV block count comes from the workers' `WorkerReady` messages, never from the config.
Never stuck: steps that schedule nothing while work is queued fail that work, and `check_stall()`
(the watchdog, called from the core loop and by `stats()`) reports work held with no step completed
for `stall_timeout` seconds, logging the scheduler state once per stall.
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
        self,
        config: EngineConfig,
        executor: Executor | None = None,
        show_progress: bool = True,
        overlapped: bool = False,
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
        self.scheduler = Scheduler(config, num_blocks, self.executor.ready[0].kv_layout)
        self._idle_steps = 0
        self._in_flight: SchedulerOutput | None = None  # the submitted step (sync and overlapped)
        self._upcoming: SchedulerOutput | None = None  # overlapped: the next step, planned meanwhile
        self.depth = config.parallel.pipeline_parallel_size  # micro-batches in flight at most
        self._batches: deque[SchedulerOutput] = deque()  # pipeline micro-batches in flight, oldest first
        self.max_steps_in_flight = 0
        self.last_step_end = time.monotonic()
        self._stall_reported = False
        if self.depth > 1:
            self._advance = self._advance_pipelined
        else:
            self._advance = self._advance_overlapped if overlapped else self._advance_sync

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
        return self.scheduler.has_unfinished_requests() or self.in_flight()

    def in_flight(self) -> bool:
        """A step is submitted and not yet taken in."""
        return self._in_flight is not None or bool(self._batches)

    def step(self) -> list[EngineOutput]:
        """Run one engine step, waiting for the workers; the outputs of every request that made
        progress (pipelined: [] while it fills the pipeline)."""
        return self._advance(True)

    def advance(self) -> list[EngineOutput]:
        """Do what the engine can without waiting for the workers: schedule and submit, and take in
        a step they have finished; [] when the step in flight is not done yet."""
        return self._advance(False)

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

    def _done(self, block: bool) -> bool:
        """Whether the oldest submitted step can be taken in now (blocking: always, by waiting)."""
        return block or self.executor.poll(0)

    def _advance_sync(self, block: bool) -> list[EngineOutput]:
        if self._in_flight is None:
            self._in_flight = self.launch()
            if self._in_flight is None:
                return []
        if not self._done(block):
            return []
        running, self._in_flight = self._in_flight, None
        return self._finish(running)

    def _advance_overlapped(self, block: bool) -> list[EngineOutput]:
        if self._in_flight is None:
            self._in_flight = self.launch()
            if self._in_flight is None:
                return []
        if self._upcoming is None and self.scheduler.has_unfinished_requests():
            self._upcoming = self.scheduler.schedule()  # planned while the workers run the step in flight
        if not self._done(block):
            return []
        running, self._in_flight = self._in_flight, None
        upcoming, self._upcoming = self._upcoming, None
        outputs = self._finish(running)
        if upcoming is not None and (upcoming.total_num_scheduled_tokens or upcoming.finished_req_ids):
            self.executor.submit(upcoming)
            self._in_flight = upcoming
        return outputs

    def _advance_pipelined(self, block: bool) -> list[EngineOutput]:
        """Submit micro-batches of requests not already in flight while fewer than `depth` are; then
        take in the oldest once it is done."""
        while len(self._batches) < self.depth and self.scheduler.has_unfinished_requests():
            batch = self.scheduler.schedule()
            # an empty step goes out only with ids the workers must forget, or to count as idle
            if not (batch.total_num_scheduled_tokens or batch.finished_req_ids or not self._batches):
                break
            self.executor.submit(batch)
            self._batches.append(batch)
            self.max_steps_in_flight = max(self.max_steps_in_flight, len(self._batches))
            if not batch.total_num_scheduled_tokens:
                break
            if block and len(self._batches) < self.depth:
                return []  # a blocking caller fills the pipeline one call at a time
        if not self._batches or not self._done(block):
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
