"""Paged KV block bookkeeping and prefix caching, on the scheduler side (no tensors here).

Runs in the scheduler process. `BlockPool` holds reference-counted blocks, a free queue that is also
the LRU eviction order, and a map from (group, block hash) to cached block. `KVCacheManager` gives
requests blocks (`allocate_slots`), finds prefix-cache hits (`get_computed_blocks`) and frees them,
one block list per KV group of the model's layers (coreproc/base/kv_layout.py). A sliding-window
group releases, before each allocation, the blocks no query of its request can see any more, and
keeps the reserved null block in their place; a prefix hit on such a group needs only the blocks
inside the window of its first new token, and a hit counts only where every group has what it
needs. A block's hash chains (parent hash, the block's token ids, source-tagged extra keys) through
sha256 over a canonical msgpack encoding, seeded per launch (or by `prefix_hash_seed`). Every extra
key names its source — ("cache_salt", salt) on the first block, ("lora", name, identity) and ("mm",
hash, offset) on the blocks they touch — so equal values from different sources never produce equal
keys.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Iterable

import msgspec

from coreproc.base.kv_layout import KVLayout
from coreproc.core.request import Request

_encode = msgspec.msgpack.Encoder().encode


def hash_block(parent: bytes, token_ids: Iterable[int], extra_keys: tuple | None) -> bytes:
    """Content hash of one full block, chained to its parent's hash."""
    return hashlib.sha256(_encode((parent, list(token_ids), extra_keys))).digest()


def block_extra_keys(request: Request, block_index: int, block_size: int) -> tuple | None:
    """Source-tagged keys that change what a block's KV means, beyond its token ids."""
    keys: list[tuple] = []
    if block_index == 0 and request.cache_salt is not None:
        keys.append(("cache_salt", request.cache_salt))
    if request.lora is not None:
        keys.append(("lora", request.lora.name, request.lora.identity))
    start, end = block_index * block_size, (block_index + 1) * block_size
    for item in request.mm_refs:  # where each item touching this block starts, relative to it
        if item.offset < end and item.offset + item.length > start:
            keys.append(("mm", item.content_hash, item.offset - start))
    return tuple(keys) or None


BlockKey = tuple[int, bytes]  # (KV group, block hash): each group's blocks hold its own layers


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockKey | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """All KV blocks of one engine. Free blocks sit in LRU order; cached free blocks stay hittable."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockKey, Block] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, n: int) -> list[Block]:
        """n fresh blocks from the LRU end, evicting their cached contents."""
        assert n <= len(self.free), f"asked for {n} blocks, {len(self.free)} free"
        out = []
        for _ in range(n):
            _, block = self.free.popitem(last=False)
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cache hits (removing idle ones from the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop references; blocks reaching zero join the free queue in the order given."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"{block} released too often"
            if block.ref_cnt == 0:
                self.free[block.block_id] = block

    def register(self, block: Block, block_hash: BlockKey) -> None:
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def reset_cache(self) -> int:
        """Forget every cached hash (blocks in use keep their contents but can no longer be hit);
        returns how many cached blocks were dropped."""
        dropped = len(self.cached)
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return dropped


class KVCacheManager:
    """Blocks per request and KV group, with optional prefix caching (see the module's doc)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        hash_seed: int | None = None,
        layout: KVLayout | None = None,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.windows = (layout or KVLayout.full(0)).windows
        seed = os.urandom(32) if hash_seed is None else hash_seed.to_bytes(32, "little", signed=False)
        self.root_hash = hashlib.sha256(b"ember-prefix-cache" + seed).digest()
        self.pool = BlockPool(num_blocks)
        # block 0 stands in a sliding group's table where it holds nothing; never written or freed
        self.null = self.pool.take(1)[0] if any(w is not None for w in self.windows) else None
        self.num_reserved = 0 if self.null is None else 1
        self.req_blocks: dict[str, list[list[Block]]] = {}  # per request, one list per group
        self.num_skipped: dict[str, list[int]] = {}  # per request and group: leading blocks released
        self.num_registered: dict[str, int] = {}
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of which found in the cache

    @property
    def usage(self) -> float:
        return self.num_blocks_in_use() / (self.num_blocks - self.num_reserved)

    def num_blocks_in_use(self) -> int:
        return self.num_blocks - self.num_reserved - self.pool.num_free

    def _update_hashes(self, request: Request) -> list[bytes]:
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else self.root_hash
            keys = block_extra_keys(request, i, bs)
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs], keys))
        return hashes

    def _skipped(self, group: int, first: int) -> int:
        """Leading blocks of `group` that no query from position `first` on can see."""
        window = self.windows[group]
        return 0 if window is None else max(0, first - window + 1) // self.block_size

    def _sliding_hit(self, group: int, hashes: list[bytes], bound: int) -> int:
        """The longest hit of at most `bound` blocks whose last blocks, as many as the window of the
        first new token reaches into, are all cached for `group` (or every block from the start)."""
        window = self.windows[group]
        assert window is not None
        need = -(-(window - 1) // self.block_size)
        if need == 0:
            return bound
        run = 0
        for i in range(bound - 1, -1, -1):
            if (group, hashes[i]) in self.pool.cached:
                run += 1
                if run == need:
                    return i + need
            else:
                run = 0
        return run

    def get_computed_blocks(self, request: Request) -> tuple[list[list[Block]], int]:
        """Longest cached prefix of full blocks that every group can resume from (a full group holds
        all its blocks, a sliding one those inside the window), per group; never covers the last
        token (its logits are needed)."""
        groups = range(len(self.windows))
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [[] for _ in groups], 0
        hashes = self._update_hashes(request)
        hit = (request.num_tokens - 1) // self.block_size
        cached = self.pool.cached
        for g in groups:
            if self.windows[g] is None:
                hit = next((i for i in range(hit) if (g, hashes[i]) not in cached), hit)
        sliding = [g for g in groups if self.windows[g] is not None]
        while True:  # a shorter hit for one sliding group may leave another without its window
            shortest = min((self._sliding_hit(g, hashes, hit) for g in sliding), default=hit)
            if shortest == hit:
                break
            hit = shortest
        blocks = []
        for g in groups:
            skip = self._skipped(g, hit * self.block_size)
            blocks.append([self.null] * skip + [cached[(g, hashes[i])] for i in range(skip, hit)])
        if request.num_preemptions == 0:
            self.queries += request.num_tokens
            self.hits += hit * self.block_size
        return blocks, hit * self.block_size  # type: ignore[return-value]  # null only where sliding

    def _release_out_of_window(self, request: Request, first: int) -> None:
        """Give back the blocks of the request's sliding groups that no query from `first` on sees."""
        groups, skipped = self.req_blocks[request.request_id], self.num_skipped[request.request_id]
        for g, blocks in enumerate(groups):
            n = min(self._skipped(g, first), len(blocks))
            if n > skipped[g]:
                self.pool.release(b for b in blocks[skipped[g] : n] if b is not self.null)
                blocks[skipped[g] : n] = [self.null] * (n - skipped[g])  # type: ignore[list-item]
                skipped[g] = n

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: list[list[Block]] | None = None
    ) -> list[list[int]] | None:
        """Blocks for `num_new_tokens` more tokens in every group (sliding groups first giving back
        what fell out of their window); returns the ids added per group, or None if they do not fit."""
        rid, bs, count = request.request_id, self.block_size, len(self.windows)
        hit = computed or [[] for _ in range(count)]
        first = request.num_computed_tokens + len(hit[0]) * bs
        want = -(-(first + num_new_tokens) // bs)
        groups = self.req_blocks.get(rid)
        if groups is not None and self.null is not None:
            self._release_out_of_window(request, first)
        held = [len(hit[g]) + (len(groups[g]) if groups else 0) for g in range(count)]
        nulls = [max(0, min(want, self._skipped(g, first)) - held[g]) for g in range(count)]
        fresh = [max(0, want - held[g] - nulls[g]) for g in range(count)]
        idle_hits = sum(1 for blocks in hit for b in blocks if b is not self.null and b.ref_cnt == 0)
        if sum(fresh) > self.pool.num_free - idle_hits:
            return None
        if groups is None:
            groups = self.req_blocks[rid] = [[] for _ in range(count)]
            self.num_skipped[rid] = [0] * count
        self.pool.touch(b for blocks in hit for b in blocks if b is not self.null)
        added = []
        for g in range(count):
            filler = [] if self.null is None else [self.null] * nulls[g]
            new = hit[g] + filler + self.pool.take(fresh[g])
            groups[g].extend(new)
            added.append([b.block_id for b in new])
        if self.enable_caching:
            self._register(request, groups, len(hit[0]), first + num_new_tokens)
        return added

    def _register(self, request: Request, groups: list[list[Block]], num_hit: int, total: int) -> None:
        """Make the request's newly full blocks hittable, in every group."""
        rid = request.request_id
        registered = self.num_registered.get(rid, 0) + num_hit
        full = min(total, request.num_tokens) // self.block_size
        hashes = self._update_hashes(request)
        for g, blocks in enumerate(groups):
            for i in range(registered, full):
                if blocks[i] is not self.null:
                    self.pool.register(blocks[i], (g, hashes[i]))
        self.num_registered[rid] = max(registered, full)

    def free(self, request: Request) -> None:
        """Release all of a request's blocks; tail blocks become the first to be evicted."""
        groups = self.req_blocks.pop(request.request_id, [])
        self.num_registered.pop(request.request_id, None)
        self.num_skipped.pop(request.request_id, None)
        for blocks in groups:
            self.pool.release(b for b in reversed(blocks) if b is not self.null)

    def block_ids(self, request: Request) -> list[list[int]]:
        """The request's block table per group (the null block where a sliding group gave one back)."""
        return [[b.block_id for b in blocks] for blocks in self.req_blocks.get(request.request_id, [])]

    def held_blocks(self, request: Request) -> list[int]:
        """Blocks the request holds per group (the null block not counted)."""
        groups = self.req_blocks.get(request.request_id, [])
        return [sum(1 for b in blocks if b is not self.null) for blocks in groups]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_cache()
