"""Image intake: a chat request's image parts -> placeholder tokens in its prompt and `MultiModalRef`s.

Runs where requests come in (the HTTP frontend, batch mode, the offline API, SDK users) and imports
no torch: fetching is `media_fetch.py`, decoding and the checkpoint's image processor run in a pool of
spawned `ember-media` processes (`media_worker.py`), whose answers come back as raw pixel bytes,
shape and dtype; `media_config.py` holds the flags and the per-request kwargs. The API (sync; the
server runs `take_async`, which fetches on threads and awaits the pool):

    intake = MediaIntake.from_model(model_dir, image_token_id, MediaConfig())  # pool starts lazily
    data = intake.load("data:image/png;base64,...")       # or http(s)://, file://; bytes pass through
    images = intake.process([data])                       # or (..., MediaKwargs({...}, image_mode))
    ids, refs = intake.expand(rendered_ids, images)       # one image token per image -> num_tokens each
    ids, refs = intake.take(rendered_ids, [ImagePart(url, "messages[0].content[0]")])  # all three
    intake.close()                                        # or `with MediaIntake.from_model(...) as ...`

`rendered_ids` come from `render_chat(..., takes_images=True)` (`chat_images` lists the parts), or
`render.render_prompts` + `render.take_images`; the refs go on `EngineRequest.mm_refs` (the SDK's
`generate(..., mm_refs=refs)`).

An image's placeholder count follows transformers' LlavaProcessor: (H / patch)(W / patch) of its
processed pixels, plus `num_additional_image_tokens`, less one for the "default" feature strategy.
Its content hash is sha256 over the canonical JSON of the effective kwargs and the encoded bytes, so
the same image under other kwargs is another item; an LRU of processed images by hash spares a
repeated image its decoding. A processed size the vision tower cannot take (`vision_config.image_size`)
is refused here, not in the engine. Every refusal is a `RequestError` (HTTP 400) naming the part.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import sys
import threading
import types
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from coreproc.base.errors import ConfigError
from coreproc.base.protocol import MultiModalRef, PixelData
from coreproc.text import media_fetch, media_worker
from coreproc.text.media_config import MediaConfig, MediaKwargs
from coreproc.text.openai_protocol import RequestError

CACHE_BYTES = 256 * 2**20  # processed pixels the intake keeps (LRU by content hash)
FETCH_THREADS = 8  # concurrent URL fetches of the async path

log = logging.getLogger("ember.media")


class ImagePart(NamedTuple):
    """An image part of a chat request: its URL and where it is (`messages[0].content[1]`)."""

    url: str
    where: str


class ProcessedImage(msgspec.Struct, frozen=True):
    """One image ready for the engine: its hash, its placeholder count and its pixel values."""

    content_hash: str
    num_tokens: int
    pixels: PixelData


def content_hash(data: bytes, kwargs: MediaKwargs) -> str:
    # canonical JSON holds no raw newline, so the newline ends it unambiguously
    return hashlib.sha256(kwargs.canonical.encode() + b"\n" + data).hexdigest()


@dataclass(frozen=True)
class ImageTokens:
    """How many placeholders a processed image takes (LlavaProcessor's rule), and the square size the
    vision tower takes (None: any)."""

    patch_size: int
    num_additional_image_tokens: int = 0
    vision_feature_select_strategy: str = "default"
    image_size: int | None = None

    def count(self, shape: Sequence[int]) -> int:
        height, width = shape[-2], shape[-1]
        n = (height // self.patch_size) * (width // self.patch_size) + self.num_additional_image_tokens
        return n - 1 if self.vision_feature_select_strategy == "default" else n

    @classmethod
    def from_model(cls, model_dir: str | Path) -> ImageTokens:
        """From processor_config.json, else config.json (CLIP towers add their class token)."""
        folder = Path(model_dir)
        proc = _json_file(folder / "processor_config.json")
        hf = _json_file(folder / "config.json")
        vision = hf.get("vision_config") or {}
        patch = proc.get("patch_size") or vision.get("patch_size")
        if not isinstance(patch, int) or patch < 1:
            raise ConfigError(f"{folder} gives no patch_size (processor_config.json or vision_config)")
        extra = proc.get("num_additional_image_tokens")
        if extra is None:
            extra = 1 if vision.get("model_type") == "clip_vision_model" else 0
        strategy = proc.get("vision_feature_select_strategy") or hf.get("vision_feature_select_strategy")
        size = vision.get("image_size")
        return cls(patch, int(extra), strategy or "default", size if isinstance(size, int) else None)


def _json_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text())
    return value if isinstance(value, dict) else {}


class MediaIntake:
    """Fetches, decodes, processes and places the images of prompts for one multimodal model."""

    def __init__(self, model_dir: str, image_token_id: int, config: MediaConfig, tokens: ImageTokens) -> None:
        self.model_dir, self.image_token_id = model_dir, image_token_id
        self.config, self.tokens = config, tokens
        self.default_kwargs = MediaKwargs(config.processor_kwargs)
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self._fetchers: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[str, ProcessedImage] = OrderedDict()
        self._cache_bytes = 0

    @classmethod
    def from_model(
        cls, model_dir: str | Path, image_token_id: int, config: MediaConfig | None = None
    ) -> MediaIntake:
        return cls(str(model_dir), image_token_id, config or MediaConfig(), ImageTokens.from_model(model_dir))

    def __enter__(self) -> MediaIntake:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            fetchers, self._fetchers = self._fetchers, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if fetchers is not None:
            fetchers.shutdown(wait=False, cancel_futures=True)

    def warm(self) -> Future:
        """Start the image processes now (they load the processor); the future answers `ping`, and a
        processor that does not load is logged (every image request then answers 500 with why)."""
        fut = self._executor().submit(media_worker.ping)
        fut.add_done_callback(_log_failed_warm)
        return fut

    # ------------------------------------------------------------------ the steps

    def load(self, source: str | bytes, where: str = "image") -> bytes:
        """An image's encoded bytes from a URL (bytes are only checked for size)."""
        cfg = self.config
        if isinstance(source, (bytes, bytearray)):
            if len(source) > cfg.max_image_bytes:
                raise media_fetch.too_large(where, cfg.max_image_bytes)
            return bytes(source)
        return media_fetch.fetch(
            source,
            where,
            timeout=cfg.media_fetch_timeout,
            max_bytes=cfg.max_image_bytes,
            allowed_domains=cfg.allowed_domains,
            local_root=cfg.allowed_local_media_path,
        )

    def process(
        self, images: Sequence[bytes], kwargs: MediaKwargs | None = None, where: Sequence[str] = ()
    ) -> list[ProcessedImage]:
        """Decode and process encoded images in the image processes (cached by content hash)."""
        hashes, done, pending = self._start(images, kwargs, where)
        for h, job in pending.items():
            try:
                raw = job.future.result()
            except BrokenProcessPool:
                raw = ("crashed",)
            done[h] = self._finish(h, job, raw)
        return [done[h] for h in hashes]

    def expand(
        self, ids: Sequence[int], images: Sequence[ProcessedImage]
    ) -> tuple[list[int], list[MultiModalRef]]:
        """Each image token of `ids` (one per image, in order) as `num_tokens` copies, and the refs
        (offset: the first placeholder; the pixel data attached)."""
        token = self.image_token_id
        places = [i for i, t in enumerate(ids) if t == token]
        if len(places) != len(images):
            raise RequestError(
                f"the chat template placed {len(places)} image tokens for {len(images)} images", "messages"
            )
        out: list[int] = []
        refs = []
        start = 0
        for place, image in zip(places, images):
            out += ids[start:place]
            refs.append(MultiModalRef(image.content_hash, len(out), image.num_tokens, image.pixels))
            out += [token] * image.num_tokens
            start = place + 1
        out += ids[start:]
        return out, refs

    def take(
        self, ids: Sequence[int], parts: Sequence[ImagePart], kwargs: MediaKwargs | None = None
    ) -> tuple[list[int], list[MultiModalRef]]:
        """A rendered prompt's images loaded, processed and expanded (sync: batch mode, `LLM`)."""
        self.check(ids, parts)
        data = [self.load(p.url, p.where) for p in parts]
        return self.expand(ids, self.process(data, kwargs, [p.where for p in parts]))

    async def take_async(
        self, ids: Sequence[int], parts: Sequence[ImagePart], kwargs: MediaKwargs | None = None
    ) -> tuple[list[int], list[MultiModalRef]]:
        """`take` off the event loop: fetches on threads, processing awaited from the pool."""
        self.check(ids, parts)
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._fetchers is None:
                self._fetchers = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="ember-media-fetch")
            fetchers = self._fetchers
        data = await asyncio.gather(
            *(loop.run_in_executor(fetchers, self.load, p.url, p.where) for p in parts)
        )
        hashes, done, pending = self._start(data, kwargs, [p.where for p in parts])
        raws = await asyncio.gather(*(_outcome(job.future) for job in pending.values()))
        for (h, job), raw in zip(pending.items(), raws):
            done[h] = self._finish(h, job, raw)
        return self.expand(ids, [done[h] for h in hashes])

    def check(self, ids: Sequence[int], parts: Sequence[ImagePart]) -> None:
        """Before any fetching: the image count against the limit and against the template's tokens."""
        limit = self.config.max_images
        if len(parts) > limit:
            raise RequestError(
                f"{len(parts)} images in one prompt; this server takes at most {limit} "
                "(--limit-mm-per-prompt)",
                "messages",
            )
        placed = sum(1 for t in ids if t == self.image_token_id)
        if placed != len(parts):
            raise RequestError(
                f"the chat template placed {placed} image tokens for {len(parts)} images", "messages"
            )

    # ------------------------------------------------------------------ the pool and the cache

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                pool = ProcessPoolExecutor(
                    self.config.media_workers,
                    mp_context=multiprocessing.get_context("spawn"),  # never a fork of the server
                    initializer=media_worker.init,
                    initargs=(self.model_dir, self.config.max_image_pixels, os.getpid()),
                )
                with _without_main():  # each submit starts one process while none is idle
                    for _ in range(self.config.media_workers):
                        pool.submit(media_worker.ping)
                self._pool = pool
            return self._pool

    def _discard_pool(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is broken:
                self._pool = None
        broken.shutdown(wait=False, cancel_futures=True)

    def _submit(self, data: bytes, kwargs: MediaKwargs, where: str) -> _Job:
        pool = self._executor()
        args = (data, json.dumps(dict(kwargs.processor)), kwargs.image_mode)
        try:
            return _Job(where, pool.submit(media_worker.process, *args), pool)
        except BrokenProcessPool:  # broken by an earlier image: start afresh
            self._discard_pool(pool)
            pool = self._executor()
            return _Job(where, pool.submit(media_worker.process, *args), pool)

    def _start(
        self, images: Sequence[bytes], kwargs: MediaKwargs | None, where: Sequence[str]
    ) -> tuple[list[str], dict[str, ProcessedImage], dict[str, _Job]]:
        """Each image's hash; those cached; a pool job for each other (distinct) one."""
        kwargs = kwargs or self.default_kwargs
        where = list(where) or [f"images[{i}]" for i in range(len(images))]
        hashes: list[str] = []
        done: dict[str, ProcessedImage] = {}
        pending: dict[str, _Job] = {}
        for data, w in zip(images, where):
            h = content_hash(data, kwargs)
            hashes.append(h)
            if h in done or h in pending:
                continue
            with self._lock:
                hit = self._cache.get(h)
                if hit is not None:
                    self._cache.move_to_end(h)
            if hit is not None:
                done[h] = hit
            else:
                pending[h] = self._submit(data, kwargs, w)
        return hashes, done, pending

    def _finish(self, h: str, job: _Job, raw: tuple) -> ProcessedImage:
        kind, where = raw[0], job.where
        if kind == "crashed":
            self._discard_pool(job.pool)
            raise RequestError(f"{where}: the image process died while decoding this image", where)
        if kind == "refused":
            raise RequestError(f"{where}: {_one_line(raw[1])}", where)
        if kind != "ok":
            raise RequestError(_one_line(raw[1]), status=500, err_type="internal_error")
        _, dtype, shape, data = raw
        size = self.tokens.image_size
        if size is not None and list(shape[-2:]) != [size, size]:  # e.g. a crop_size in the kwargs
            raise RequestError(
                f"{where}: the image processor made a {shape[-2]}x{shape[-1]} image; this model's vision "
                f"tower takes {size}x{size} (check the mm_processor_kwargs)",
                where,
            )
        image = ProcessedImage(h, self.tokens.count(shape), PixelData(dtype, list(shape), data))
        if image.num_tokens < 1:
            raise RequestError(f"{where}: the processed image {shape} is smaller than one patch", where)
        with self._lock:
            if h not in self._cache:
                self._cache[h] = image
                self._cache_bytes += len(data)
            while self._cache_bytes > CACHE_BYTES and self._cache:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= len(old.pixels.data)
        return image


@contextlib.contextmanager
def _without_main() -> Iterator[None]:
    """While processes are spawned: a spawned child imports the parent's `__main__` again, and a
    script without an `if __name__ == "__main__"` guard would run again in it. The image processes
    need nothing from it, so they are started with a blank one in its place."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class _Job(NamedTuple):
    """One image in the pool: the part it came from, its future, the pool running it."""

    where: str
    future: Future
    pool: ProcessPoolExecutor


async def _outcome(fut: Future) -> tuple:
    try:
        return await asyncio.wrap_future(fut)
    except BrokenProcessPool:
        return ("crashed",)


def _log_failed_warm(fut: Future) -> None:
    if fut.cancelled():
        return
    answer = ("failed", repr(fut.exception())) if fut.exception() is not None else fut.result()
    if answer[0] != "ok":
        log.error("the image processes are not ready: %s", answer[1])


def _one_line(message: str) -> str:
    return " ".join(message.split())
