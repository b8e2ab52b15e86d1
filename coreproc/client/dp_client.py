"""A client of several data-parallel engine cores that looks like one: `DPEngineClient`.

Runs in the HTTP frontend (always, with one core or several) and in SDK users' processes. It holds one
`AsyncEngineClient` per core and sends each submission to the core a `DPRouter` picks (least loaded,
or holding the longest cached prefix); outputs stream back from that core alone, aborts follow their
request. A core that dies fails only its own streams (`EngineDeadError` from its client) and is routed
around, and so does one that answers no stats call for 10 s (stopped or wedged: the core answers
them even during long steps); the client as a whole is dead only when every core is. Utility calls
fan out: the prefix-cache reset and LoRA loads go to every live core, `stats()` merges theirs,
`stats_by_rank()` keeps them apart.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Hashable
from typing import TYPE_CHECKING, Any

from coreproc.base.errors import EngineDeadError
from coreproc.base.protocol import (
    EngineInfo,
    EngineOutput,
    EngineRequest,
    SamplingParams,
    SchedulerStats,
    make_request,
)
from coreproc.client.dp_router import DPRouter, Routing, merge_stats

if TYPE_CHECKING:
    from coreproc.client.async_client import AsyncEngineClient


UNRESPONSIVE_AFTER_S = 10.0


class DPEngineClient:
    """asyncio client of D engine cores. Use `await coreproc.client.sdk.connect_engines(addresses)`."""

    def __init__(self, clients: list[AsyncEngineClient], routing: Routing | None = None) -> None:
        assert clients, "a data-parallel client needs at least one core"
        self.clients = clients
        infos = [c.info_cache for c in clients]
        assert all(i is not None for i in infos), "clients come from AsyncEngineClient.connect"
        first = infos[0]
        assert first is not None
        self.info_cache: EngineInfo = first
        chosen = routing or first.dp_routing
        self.router = DPRouter(
            [i.num_kv_blocks for i in infos if i is not None],
            "prefix" if chosen == "prefix" else "least-loaded",
            first.block_size,
            slack=max(8, first.max_num_seqs // 2),
        )
        self._where: dict[str, int] = {}  # request id -> the core running it
        self._dead: dict[int, str] = {}
        # rank -> (when the first of its unanswered stats calls was made, how many in a row)
        self._silent_since: dict[int, tuple[float, int]] = {}
        # a core that answers no stats call for this long is given up (its streams fail); the core
        # answers them even during long steps, so only a stopped or wedged process stays silent
        self.unresponsive_after = UNRESPONSIVE_AFTER_S

    @property
    def size(self) -> int:
        return len(self.clients)

    def dead_ranks(self) -> dict[int, str]:
        """The cores that are gone, with why."""
        for rank, client in enumerate(self.clients):
            if client.dead is not None and rank not in self._dead:
                self._dead[rank] = client.dead
                self.router.mark_dead(rank)
        return dict(self._dead)

    @property
    def dead(self) -> str | None:
        """Why the engine is unusable: every core is gone (None while one still serves)."""
        dead = self.dead_ranks()
        if len(dead) < self.size:
            return None
        if self.size == 1:
            return dead[0]
        return "; ".join(f"engine core {r}: {why}" for r, why in sorted(dead.items()))

    # ------------------------------------------------------------------ generation

    def _route(self, requests: list[EngineRequest]) -> tuple[int, list[int]]:
        if self.size == 1:
            return 0, []
        first = requests[0]
        hashes: list[int] = []
        if self.router.routing == "prefix":
            extra: Hashable = (
                first.cache_salt,
                first.lora.name if first.lora else None,
                tuple((m.content_hash, m.offset) for m in first.mm_refs),
            )
            hashes = self.router.prefix_hashes(first.prompt_token_ids, extra)
        self.dead_ranks()
        try:
            return self.router.pick(hashes), hashes
        except ValueError:
            raise EngineDeadError(self.dead or "no engine core is alive") from None

    async def generate_many(
        self,
        requests: list[EngineRequest],
        *,
        admitted: asyncio.Future | None = None,
        max_buffered_tokens: int | None = None,
    ) -> AsyncIterator[EngineOutput]:
        """Like `AsyncEngineClient.generate_many`, on the core the router picks (all of a submission's
        sequences together, so their shared prompt is computed once)."""
        rank, hashes = self._route(requests)
        rids = [r.request_id for r in requests]
        self.router.sent(rank, hashes, len(requests))
        for rid in rids:
            self._where[rid] = rank
        outputs = self.clients[rank].generate_many(
            requests, admitted=admitted, max_buffered_tokens=max_buffered_tokens
        )
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()
            for rid in rids:
                self._where.pop(rid, None)
            self.router.done(rank, len(requests))

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams | None = None, **kw: Any
    ) -> AsyncIterator[EngineOutput]:
        """One request (see `AsyncEngineClient.generate`), on the core the router picks."""
        admitted = kw.pop("admitted", None)
        async for out in self.generate_many(
            [make_request(prompt_token_ids, params, **kw)], admitted=admitted
        ):
            yield out

    async def abort(self, request_id: str) -> None:
        rank = self._where.get(request_id)
        if rank is not None and self.clients[rank].dead is None:
            await self.clients[rank].abort(request_id)

    # ------------------------------------------------------------------ utility calls

    def _live(self) -> list[AsyncEngineClient]:
        live = [c for c in self.clients if c.dead is None]
        if not live:
            raise EngineDeadError(self.dead or "no engine core is alive")
        return live

    async def info(self, timeout: float | None = 30.0) -> EngineInfo:
        return await self._live()[0].info(timeout)

    async def stats_by_rank(self, timeout: float | None = 30.0) -> dict[int, SchedulerStats | str]:
        """Each core's stats, or why it is gone; the router learns their loads."""

        async def one(rank: int) -> SchedulerStats | str:
            client = self.clients[rank]
            if client.dead is not None:
                return client.dead
            asked = time.monotonic()
            try:
                stats = await client.stats(timeout)
            except EngineDeadError as e:
                if client.dead is None:  # no answer in time: a stopped or wedged core process
                    since, misses = self._silent_since.get(rank, (asked, 0))
                    self._silent_since[rank] = (since, misses + 1)
                    # not on one miss alone: our own pause (SIGSTOP, swapping, a stalled VM) can
                    # outlive a call's timer though the core answered at once
                    if misses >= 1 and time.monotonic() - since >= self.unresponsive_after:
                        client.declare_dead(
                            f"the engine core has not answered for {time.monotonic() - since:.0f}s"
                        )
                return client.dead or str(e)
            self._silent_since.pop(rank, None)
            self.router.observe(rank, stats.num_waiting + stats.num_running, stats.kv_usage)
            return stats

        results = await asyncio.gather(*(one(r) for r in range(self.size)))
        self.dead_ranks()
        return dict(enumerate(results))

    async def stats(self, timeout: float | None = 30.0) -> SchedulerStats:
        """The live cores' stats merged (counts summed, ratios averaged)."""
        by_rank = await self.stats_by_rank(timeout)
        live = [s for s in by_rank.values() if isinstance(s, SchedulerStats)]
        if not live:
            raise EngineDeadError(self.dead or "no engine core is alive")
        return merge_stats(live)

    async def reset_prefix_cache(self) -> int:
        dropped = await asyncio.gather(*(c.reset_prefix_cache() for c in self._live()))
        self.router.forget_prefixes()
        return sum(dropped)

    async def load_lora(self, name: str, path: str, timeout: float | None = 60.0) -> dict[str, Any]:
        """Load on every live core (all or none answer the same: they read the same folder)."""
        results = await asyncio.gather(*(c.load_lora(name, path, timeout) for c in self._live()))
        return results[0]

    async def unload_lora(self, name: str) -> dict[str, Any]:
        results = await asyncio.gather(*(c.unload_lora(name) for c in self._live()))
        return results[0]

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients), return_exceptions=True)

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def describe(self) -> dict[str, Any]:
        """Per core: requests routed there so far and in flight now (for logs and tests)."""
        return {
            "routed": [e.routed for e in self.router.engines],
            "in_flight": [e.in_flight for e in self.router.engines],
            "dead": self.dead_ranks(),
            "routing": self.router.routing,
        }
