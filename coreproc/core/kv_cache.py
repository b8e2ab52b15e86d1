"""Paged KV block bookkeeping and prefix caching, on the scheduler side (no tensors here).

Runs in the scheduler process. `BlockPool` holds reference-counted blocks, a free queue that is also
the LRU eviction order, and a map from block hash to cached block. `KVCacheManager` gives requests
blocks (`allocate_slots`), finds prefix-cache hits (`get_computed_blocks`) and frees them. A block's
hash chains (parent hash, the block's token ids, source-tagged extra keys) through sha256 over a
canonical msgpack encoding, seeded per launch (or by `prefix_hash_seed`). Every extra key names its
source — ("cache_salt", salt) on the first block, ("lora", name, identity) and ("mm", hash, offset) on
the blocks they touch — so equal values from different sources never produce equal keys.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Iterable

import msgspec

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


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """All KV blocks of one engine. Free blocks sit in LRU order; cached free blocks stay hittable."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}

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

    def register(self, block: Block, block_hash: bytes) -> None:
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
    """Blocks per request, with optional prefix caching."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool, hash_seed: int | None = None
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        seed = os.urandom(32) if hash_seed is None else hash_seed.to_bytes(32, "little", signed=False)
        self.root_hash = hashlib.sha256(b"ember-prefix-cache" + seed).digest()
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[Block]] = {}
        self.num_registered: dict[str, int] = {}
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of which found in the cache

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.num_blocks

    def num_blocks_in_use(self) -> int:
        return self.num_blocks - self.pool.num_free

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

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of full blocks; never covers the last token (its logits are needed)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[Block] = []
        for h in hashes[:max_blocks]:
            block = self.pool.cached.get(h)
            if block is None:
                break
            hit.append(block)
        if request.num_preemptions == 0:
            self.queries += request.num_tokens
            self.hits += len(hit) * self.block_size
        return hit, len(hit) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: list[Block] | None = None
    ) -> list[int] | None:
        """Blocks for `num_new_tokens` more tokens; returns the ids added, or None if they do not fit."""
        computed = computed or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        need = -(-total // self.block_size) - len(blocks) - len(computed)
        idle_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if need > self.pool.num_free - idle_hits:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        self.pool.touch(computed)
        added = computed + self.pool.take(max(need, 0))
        blocks.extend(added)
        if self.enable_caching:
            registered = self.num_registered.get(request.request_id, 0) + len(computed)
            full = min(total, request.num_tokens) // self.block_size
            hashes = self._update_hashes(request)
            for i in range(registered, full):
                self.pool.register(blocks[i], hashes[i])
            self.num_registered[request.request_id] = max(registered, full)
        return [b.block_id for b in added]

    def free(self, request: Request) -> None:
        """Release all of a request's blocks; tail blocks become the first to be evicted."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_registered.pop(request.request_id, None)
        self.pool.release(reversed(blocks))

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request.request_id, [])]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_cache()
