"""Pipeline micro-batches: which requests are in a step still in flight, and how many one step takes.

Runs in the scheduler process, inside `Scheduler`. With P pipeline stages the engine keeps up to P steps
(micro-batches) in flight (the engine's pipelined steps). The scheduler neither schedules nor preempts a
request whose step is still in flight, so micro-batches are disjoint and need no placeholder tokens, and
one step takes at most 1/P of the active requests, so that P micro-batches can fill the stages. The stages
before the last sample nothing: the tokens a request got since it last ran travel to them in its
`CachedRequestData.new_token_ids`. With one stage nothing here applies (`depth` 1).
"""

from __future__ import annotations

from coreproc.base.protocol import SchedulerOutput
from coreproc.core.request import Request


class MicroBatches:
    """The scheduler's view of the steps in flight under pipeline parallelism."""

    def __init__(self, depth: int) -> None:
        self.depth = depth  # steps in flight at most: the pipeline stages
        self.in_flight: set[str] = set()  # requests of submitted steps whose output is not yet taken
        self._told: dict[str, int] = {}  # per request: output tokens the early stages know

    def busy(self, req: Request) -> bool:
        """Whether `req` is in a step still in flight (it must not be scheduled or preempted)."""
        return req.request_id in self.in_flight

    def step_seqs(self, num_active: int) -> int:
        """Most requests one step may take out of `num_active` running or waiting ones."""
        return num_active if self.depth == 1 else -(-num_active // self.depth)

    def started(self, out: SchedulerOutput) -> None:
        if self.depth > 1:
            self.in_flight.update(out.num_scheduled_tokens)

    def done(self, out: SchedulerOutput) -> None:
        self.in_flight.difference_update(out.num_scheduled_tokens)

    def sent_in_full(self, req: Request) -> None:
        """`req` went to the workers as a new request, its output tokens included."""
        if self.depth > 1:
            self._told[req.request_id] = len(req.output_token_ids)

    def new_tokens(self, req: Request) -> list[int]:
        """The output tokens the early stages have not seen; from now on they have."""
        if self.depth == 1:
            return []
        told = self._told.get(req.request_id, 0)
        self._told[req.request_id] = len(req.output_token_ids)
        return req.output_token_ids[told:]

    def forget(self, req: Request) -> None:
        self._told.pop(req.request_id, None)
