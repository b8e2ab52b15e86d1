"""The scheduler's waiting queue and its admission limits.

Runs in the scheduler process. Requests that are not running wait here, ordered by policy: FCFS by
arrival, priority by (priority, arrival time, arrival). A preempted request keeps its arrival order,
so in FCFS it is served before every request that never ran. New work beyond
`max_num_queued_requests` / `max_num_queued_tokens` raises `QueueFull`; an empty queue always takes
one, and the sequences of one API request (`EngineRequest.group`, `group_size`) are admitted or
refused together, at their first member.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict

from coreproc.protocol import EngineRequest, InvalidParam, QueueFull
from coreproc.request import Request

MAX_OPEN_GROUPS = 4096
MAX_GROUP_SIZE = 1024


class WaitingQueue:
    """Requests not running, ordered by policy key; preempted requests keep their place at the front."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._items: list[tuple[tuple, Request]] = []
        self.num_tokens = 0  # of the queued requests (their tokens do not change while they wait)
        self._groups: OrderedDict[str, int] = OrderedDict()  # admitted groups -> members still to come

    def _key(self, req: Request) -> tuple:
        if self.policy == "priority":
            return (req.priority, req.arrival_time, req.arrival_seq)
        return (req.arrival_seq,)

    def add(self, req: Request) -> None:
        bisect.insort(self._items, (self._key(req), req), key=lambda item: item[0])
        self.num_tokens += req.num_tokens

    def peek(self) -> Request:
        return self._items[0][1]

    def pop(self) -> Request:
        req = self._items.pop(0)[1]
        self.num_tokens -= req.num_tokens
        return req

    def remove(self, req: Request) -> None:
        self._items.remove((self._key(req), req))
        self.num_tokens -= req.num_tokens

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return (req for _, req in self._items)

    def admit(self, er: EngineRequest, max_requests: int | None, max_tokens: int | None) -> None:
        """Raise QueueFull if `er` may not join the queue now (checked once per group)."""
        if er.group is not None and er.group in self._groups:
            self._groups[er.group] -= 1
            if self._groups[er.group] <= 0:
                del self._groups[er.group]
            return
        size = er.group_size
        if not 1 <= size <= MAX_GROUP_SIZE:
            raise InvalidParam(f"group_size must be in [1, {MAX_GROUP_SIZE}]", "group_size")
        if self._items:
            if max_requests is not None and len(self) + size > max_requests:
                raise QueueFull(f"the engine's queue is full ({len(self)} requests waiting); retry later")
            if max_tokens is not None and self.num_tokens + len(er.prompt_token_ids) * size > max_tokens:
                raise QueueFull(
                    f"the engine's queue is full ({self.num_tokens} prompt tokens waiting, "
                    f"limit {max_tokens}); retry later"
                )
        if er.group is not None and size > 1:
            self._groups[er.group] = size - 1
            while len(self._groups) > MAX_OPEN_GROUPS:  # members that never came (a failed submit)
                self._groups.popitem(last=False)
