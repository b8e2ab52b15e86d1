"""What the scheduler reports: counters its steps add up, the "stats" answer and a stall report.

Runs in the scheduler process (coreproc). `StepCounters` sums the figures of every step (the workers'
`RunnerOutput` timings, preemptions, encoder-cache use; the experts' load is coreproc.core.expert_load's);
`scheduler_stats` joins them with the live
queue and KV figures into a `SchedulerStats`; `describe` is the short state a stall report logs. Both
read a scheduler through `Scheduling` (what they need of it), so this module does not import the
scheduler that imports it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from coreproc.base.protocol import RunnerOutput, SchedulerStats
from coreproc.core.expert_load import ExpertLoad
from coreproc.core.kv_cache import KVCacheManager
from coreproc.core.mm_store import MediaStore
from coreproc.core.request import Request
from coreproc.core.speculation import SpecControl
from coreproc.core.waiting import WaitingQueue


@dataclass
class StepCounters:
    """Totals since the engine started; the names are `SchedulerStats` fields."""

    num_steps: int = 0
    num_preemptions: int = 0
    worker_busy_seconds: float = 0.0  # summed RunnerOutput.execute_seconds, of which:
    structured_seconds: float = 0.0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0
    draft_seconds: float = 0.0
    schedule_seconds: float = 0.0  # the scheduler's own time
    encoder_cache_hits: int = 0
    encoder_cache_misses: int = 0

    def add_runner_output(self, out: RunnerOutput) -> None:
        self.worker_busy_seconds += out.execute_seconds
        self.structured_seconds += out.structured_seconds
        self.forward_seconds += out.forward_seconds
        self.sample_seconds += out.sample_seconds
        self.draft_seconds += out.draft_seconds
        self.encoder_cache_hits += out.encoder_hits
        self.encoder_cache_misses += out.encoder_misses


class Scheduling(Protocol):
    """What the stats read of a scheduler (coreproc.core.scheduler.Scheduler has it all): its queues, its
    KV cache, its media store, its counters, its experts' load and its speculation control."""

    kv: KVCacheManager
    running: list[Request]
    waiting: WaitingQueue
    requests: dict[str, Request]
    media: MediaStore
    counters: StepCounters
    expert_load: ExpertLoad
    speculation: SpecControl | None
    token_budget: int


def scheduler_stats(sched: Scheduling) -> SchedulerStats:
    """The scheduler's part of the "stats" answer (the engine adds its progress: `has_work`, ...)."""
    kv = sched.kv
    return SchedulerStats(
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        num_requests=len(sched.requests),
        num_queued_tokens=sched.waiting.num_tokens,
        kv_usage=kv.usage,
        num_kv_blocks=kv.num_blocks,
        num_blocks_in_use=kv.num_blocks_in_use(),
        prefix_cache_queries=kv.queries,
        prefix_cache_hits=kv.hits,
        prefix_cache_hit_rate=kv.hit_rate,
        mm_cache_hits=sched.media.hits,
        mm_cache_misses=sched.media.misses,
        expert_load=sched.expert_load.load,
        expert_imbalance=sched.expert_load.imbalance,
        expert_layer_imbalance=sched.expert_load.layer_imbalance(),
        **dataclasses.asdict(sched.counters),
        **(sched.speculation.stats.as_dict() if sched.speculation is not None else {}),  # spec_* fields
    )


def describe(sched: Scheduling, limit: int = 8) -> dict:
    """The scheduler's state for a stall report: counts, free blocks and the first requests."""

    def brief(req: Request) -> str:
        blocks = sum(sched.kv.held_blocks(req))
        return f"{req.request_id}:{req.status.name}:{req.num_computed_tokens}/{req.num_tokens}:b{blocks}"

    return {
        "running": [brief(r) for r in sched.running[:limit]],
        "waiting": [brief(r) for r in list(sched.waiting)[:limit]],
        "num_running": len(sched.running),
        "num_waiting": len(sched.waiting),
        "free_blocks": sched.kv.pool.num_free,
        "token_budget": sched.token_budget,
        "steps": sched.counters.num_steps,
    }
