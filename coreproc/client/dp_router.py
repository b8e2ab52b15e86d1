"""Picks the data-parallel engine a request goes to: the least loaded, or the one holding its prefix.

Runs wherever requests fan out to several engine cores: the HTTP frontend's and the SDK's
`DPEngineClient`, and the offline `DPEngine`. Torch-free and socket-free: callers report what each
engine holds (`observe`: waiting + running requests and KV usage from its stats), what they sent and
what finished (`sent`, `done`). Load is the larger of the requests this router has in flight there
and the engine's own count (which also sees other frontends' requests), plus its KV usage as a
tie-breaker. With `prefix` routing the router keeps, per engine, an LRU of the chained hashes of the
full prompt blocks it sent there (bounded by that engine's block count: an estimate of its prefix
cache), and a request goes to the engine holding its longest prefix unless that engine is more than
`slack` requests busier than the least loaded one.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from coreproc.base.protocol import SchedulerStats
from coreproc.core.expert_load import layer_imbalance, mean_imbalance, merge_loads

Routing = Literal["least-loaded", "prefix"]


@dataclass
class _Engine:
    """What the router knows of one engine."""

    capacity: int  # its KV block count: how many prompt blocks it can hold
    in_flight: int = 0  # requests this router sent there that have not finished
    reported: int = 0  # waiting + running, from its last stats
    kv_usage: float = 0.0
    alive: bool = True
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)  # prefix hashes, LRU order
    routed: int = 0  # requests sent there, ever

    @property
    def load(self) -> float:
        return max(self.in_flight, self.reported) + self.kv_usage


class DPRouter:
    """Routing state for `size` engines (see the module doc)."""

    def __init__(
        self,
        capacities: Sequence[int],
        routing: Routing = "least-loaded",
        block_size: int = 16,
        slack: int = 8,
    ) -> None:
        assert capacities, "a router needs at least one engine"
        self.engines = [_Engine(max(1, c)) for c in capacities]
        self.routing = routing
        self.block_size = block_size
        self.slack = slack
        self._turn = itertools.count()  # rotates ties so equal engines share the work

    @property
    def size(self) -> int:
        return len(self.engines)

    def alive(self) -> list[int]:
        return [r for r, e in enumerate(self.engines) if e.alive]

    def prefix_hashes(self, token_ids: Sequence[int], extra: Hashable = None) -> list[int]:
        """Chained hashes of the prompt's full blocks; `extra` (cache salt, adapter, images) seeds the
        chain, so prompts that cannot share KV blocks never share a hash."""
        hashes, parent = [], hash(("ember-dp", extra))
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = hash((parent, tuple(token_ids[start : start + bs])))
            hashes.append(parent)
        return hashes

    def matched_blocks(self, rank: int, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` the router believes engine `rank` holds."""
        held = self.engines[rank].blocks
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def pick(self, hashes: Sequence[int] = ()) -> int:
        """The engine for a request whose prompt blocks hash to `hashes`; ValueError if none is alive."""
        live = self.alive()
        if not live:
            raise ValueError("no data-parallel engine is alive")
        turn = next(self._turn)
        order = live[turn % len(live) :] + live[: turn % len(live)]
        least = min(order, key=lambda r: self.engines[r].load)
        if self.routing != "prefix" or not hashes:
            return least
        best = max(order, key=lambda r: self.matched_blocks(r, hashes))
        if self.matched_blocks(best, hashes) == 0:
            return least
        if self.engines[best].load - self.engines[least].load > self.slack:
            return least  # holding the prefix is not worth a queue that much longer
        return best

    def sent(self, rank: int, hashes: Sequence[int] = (), count: int = 1) -> None:
        """`count` requests went to `rank`; after them it holds the blocks `hashes`."""
        engine = self.engines[rank]
        engine.in_flight += count
        engine.routed += count
        if self.routing == "prefix":
            for h in hashes:
                engine.blocks[h] = None
                engine.blocks.move_to_end(h)
            while len(engine.blocks) > engine.capacity:
                engine.blocks.popitem(last=False)

    def done(self, rank: int, count: int = 1) -> None:
        """`count` requests sent to `rank` finished (or failed)."""
        engine = self.engines[rank]
        engine.in_flight = max(0, engine.in_flight - count)

    def observe(self, rank: int, waiting_and_running: int, kv_usage: float) -> None:
        """The engine's own view, from its stats."""
        engine = self.engines[rank]
        engine.reported, engine.kv_usage = waiting_and_running, kv_usage

    def mark_dead(self, rank: int) -> None:
        """Route nothing more to `rank` (its core died)."""
        engine = self.engines[rank]
        engine.alive = False
        engine.blocks.clear()

    def forget_prefixes(self) -> None:
        """Every engine's prefix cache was reset."""
        for engine in self.engines:
            engine.blocks.clear()


# stats that are shares (0 to 1) or means: averaged over engines, not summed
_AVERAGED = {"kv_usage", "spec_mean_accepted_length"}


def merge_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """Several engines' stats as one: counts and seconds summed, ratios averaged, per-position lists
    summed by position, the experts' loads summed and their imbalance taken of the sum, `stalled` the
    first engine's reason (with its rank), `has_work` if any has."""
    assert stats, "nothing to merge"
    merged: dict[str, object] = {}
    for name in SchedulerStats.__struct_fields__:
        values = [getattr(s, name) for s in stats]
        if name == "stalled":
            merged[name] = next((f"engine core {r}: {v}" for r, v in enumerate(values) if v), None)
        elif name == "has_work":
            merged[name] = any(values)
        elif name == "seconds_since_step":
            merged[name] = min(values)
        elif name == "expert_load":
            merged[name] = merge_loads(values)
        elif name in ("expert_imbalance", "expert_layer_imbalance"):
            continue  # of the merged load, below
        elif name in _AVERAGED:
            merged[name] = sum(values) / len(values)
        elif isinstance(values[0], list):
            width = max(len(v) for v in values)
            merged[name] = [sum(v[i] for v in values if i < len(v)) for i in range(width)]
        else:
            merged[name] = sum(values)
    out = msgspec.convert(merged, SchedulerStats)
    out.prefix_cache_hit_rate = out.prefix_cache_hits / max(1, out.prefix_cache_queries)
    out.spec_acceptance_rate = out.spec_num_accepted / max(1, out.spec_num_proposed)
    out.expert_layer_imbalance = layer_imbalance(out.expert_load)
    out.expert_imbalance = mean_imbalance(out.expert_load)
    return out
