"""The core's store of images by content hash, and the client's mirror of it.

Runs in the scheduler process (`MediaStore`) and in clients (`MediaShadow`: the SDK, the HTTP frontend).
An image is sent once with its pixels; while the core still holds it, a client sends later requests
with the same image as its hash alone. Fresh data always wins: a request that carries pixels replaces
whatever the store held under that hash (a stale entry can never stand in for a new payload). A
hash-only item the store no longer holds refuses the request with `MultiModalCacheMiss` (the
"mm_cache_miss" refusal): the client forgets those hashes and sends again with the pixels. Both sides
run the same byte-bounded LRU, so with one client they evict alike and misses are rare.
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from coreproc.base.errors import InvalidParam
from coreproc.base.protocol import EngineRequest, MultiModalRef, PixelData


class MultiModalCacheMiss(InvalidParam):
    """Items sent by hash that the core no longer holds; retry with their data (not the user's fault)."""

    def __init__(self, hashes: list[str]) -> None:
        super().__init__(
            f"the engine no longer holds image(s) {', '.join(h[:16] for h in hashes)}; send their data again",
            "messages",
        )
        self.hashes = hashes


class _ByteLRU:
    """Hash -> value, least recently used first, bounded by the values' byte sizes."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.items: OrderedDict[str, tuple[int, object]] = OrderedDict()
        self.bytes = 0

    def put(self, key: str, size: int, value: object = None) -> None:
        self.pop(key)
        if size > self.capacity:
            return
        self.items[key] = (size, value)
        self.bytes += size
        while self.bytes > self.capacity:
            _, (old, _) = self.items.popitem(last=False)
            self.bytes -= old

    def get(self, key: str) -> object | None:
        item = self.items.get(key)
        if item is None:
            return None
        self.items.move_to_end(key)
        return item[1]

    def __contains__(self, key: str) -> bool:
        return key in self.items

    def pop(self, key: str) -> None:
        item = self.items.pop(key, None)
        if item is not None:
            self.bytes -= item[0]


class MediaStore:
    """The scheduler's images by content hash (LRU within `capacity_bytes`); counts hits and misses."""

    def __init__(self, capacity_bytes: int) -> None:
        self._lru = _ByteLRU(capacity_bytes)
        self.hits = 0  # hash-only items found
        self.misses = 0  # hash-only items not found (their requests refused as "mm_cache_miss")

    def resolve(self, requests: list[EngineRequest]) -> list[list[MultiModalRef]]:
        """Each request's items with their pixels, in order; items with data are stored (replacing any
        entry under their hash), hash-only ones looked up (earlier items of the same submission
        count). Raises MultiModalCacheMiss naming every hash not found, storing nothing then."""
        fresh: dict[str, PixelData] = {}
        resolved: list[list[MultiModalRef]] = []
        missing: list[str] = []
        for er in requests:
            items = []
            for ref in er.mm_refs:
                data = ref.data
                if data is not None:
                    fresh[ref.content_hash] = data
                else:
                    found = fresh.get(ref.content_hash) or self._lru.get(ref.content_hash)
                    if not isinstance(found, PixelData):
                        missing.append(ref.content_hash)
                        continue
                    data = found
                items.append(MultiModalRef(ref.content_hash, ref.offset, ref.length, data))
            resolved.append(items)
        if missing:
            self.misses += len(missing)
            raise MultiModalCacheMiss(sorted(set(missing)))
        self.hits += sum(1 for er in requests for ref in er.mm_refs if ref.data is None)
        for er in requests:
            for ref in er.mm_refs:  # the same operations, in the same order, as `MediaShadow.prepare`
                if ref.data is not None:
                    self._lru.put(ref.content_hash, ref.data.nbytes, ref.data)
                else:
                    self._lru.get(ref.content_hash)
        return resolved


class MediaShadow:
    """A client's picture of one core's `MediaStore`: sizes only, no pixels."""

    def __init__(self, capacity_bytes: int) -> None:
        self._lru = _ByteLRU(capacity_bytes)

    def prepare(self, requests: list[EngineRequest]) -> list[EngineRequest]:
        """The requests as they should travel: an item the core should still hold goes as its hash."""
        out = []
        for er in requests:
            refs = []
            for ref in er.mm_refs:
                if ref.data is not None and ref.content_hash in self._lru:
                    self._lru.get(ref.content_hash)
                    ref = MultiModalRef(ref.content_hash, ref.offset, ref.length)
                elif ref.data is not None:
                    self._lru.put(ref.content_hash, ref.data.nbytes)
                else:
                    self._lru.get(ref.content_hash)
                refs.append(ref)
            out.append(_with_refs(er, refs) if er.mm_refs else er)
        return out

    def forget(self, requests: list[EngineRequest]) -> None:
        """After a miss: these hashes are no longer assumed held."""
        for er in requests:
            for ref in er.mm_refs:
                self._lru.pop(ref.content_hash)


def _with_refs(er: EngineRequest, refs: list[MultiModalRef]) -> EngineRequest:
    return msgspec.structs.replace(er, mm_refs=refs)
