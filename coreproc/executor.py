"""Executors fan one scheduler step out to the workers and gather what they return.

Runs in the scheduler process. `InprocExecutor` holds a single worker in this process (the offline
engine and tests); a multiprocess executor over ZeroMQ with the same two calls serves `ember core`.
"""

from __future__ import annotations

from typing import Protocol

from coreproc.config import EngineConfig
from coreproc.protocol import RunnerOutput, SchedulerOutput, WorkerReady


class Executor(Protocol):
    ready: list[WorkerReady]

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput: ...

    def shutdown(self) -> None: ...


class InprocExecutor:
    """One worker in the calling process; used by the offline `LLM` and by tests."""

    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        from workers.worker import Worker

        self.worker = Worker(config)
        self.ready = [self.worker.load(show_progress)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.worker = None
