"""EngineCore: the scheduler loop around an executor, as a short named sequence per step.

Runs in the scheduler process (or in-process under the offline `LLM`). Takes `EngineRequest`s and aborts,
and produces `EngineOutput`s: step = schedule -> execute on the workers -> update from their output.
The KV block count comes from the workers' `WorkerReady` messages, never from the config.
"""

from __future__ import annotations

import logging

from coreproc.config import EngineConfig
from coreproc.executor import Executor, InprocExecutor
from coreproc.protocol import EngineOutput, EngineRequest
from coreproc.scheduler import Scheduler

log = logging.getLogger("ember.core")

# consecutive steps that schedule nothing while work is queued before the engine declares itself stuck
MAX_IDLE_STEPS = 4


class EngineCore:
    """Scheduler + executor; not thread-safe (one caller drives `step`)."""

    def __init__(
        self, config: EngineConfig, executor: Executor | None = None, show_progress: bool = True
    ) -> None:
        self.config = config
        self.executor = executor or InprocExecutor(config, show_progress)
        num_blocks = min(r.num_kv_blocks for r in self.executor.ready)
        self.scheduler = Scheduler(config, num_blocks)
        self._idle_steps = 0

    def add_request(self, request: EngineRequest) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[EngineOutput]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineOutput]:
        """Run one engine step; returns the outputs of every request that made progress."""
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._idle_steps = 0 if scheduler_output.total_num_scheduled_tokens else self._idle_steps + 1
        if self._idle_steps > MAX_IDLE_STEPS:
            # never sit "healthy but stuck": fail what is queued, loudly, rather than spin
            log.error("scheduler made no progress for %d steps; failing queued requests", self._idle_steps)
            outputs += self.scheduler.fail_all("the engine could not schedule queued requests (no progress)")
            self._idle_steps = 0
        return outputs

    def stats(self) -> dict:
        return self.scheduler.stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
