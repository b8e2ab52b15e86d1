"""Images in a step: the encoder cache, and the embeddings a step's placeholders take.

Runs in each worker process. A request's images arrive with their pixels (`NewRequestData.mm_items`).
When a step's tokens reach an image's placeholder span, its vision-encoder output is taken from the
encoder cache (by the image's content hash) or computed, once, and kept by the request until its
prefill has passed the span, so a chunked prefill that splits an image reuses it. `MultiModalInputs`
scatters the rows a step covers into the input embeddings; a request whose image does not fit its
span fails alone (`RunnerOutput.failed`), never the step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from coreproc.base.protocol import MultiModalRef


class ImageEncoder(Protocol):
    """What a vision-language model offers the runner (workers/models/llava.py)."""

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor: ...


class EncoderCache:
    """Vision-encoder outputs by image content hash, least recently used out first, within a budget."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0

    def get(self, key: str) -> torch.Tensor | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: str, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old.numel() * old.element_size()
        if size > self.capacity:
            return
        self._items[key] = value
        self.bytes += size
        while self.bytes > self.capacity:
            _, dropped = self._items.popitem(last=False)
            self.bytes -= dropped.numel() * dropped.element_size()

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class RequestImages:
    """A request's images and the encoder outputs it still needs (by item index)."""

    items: list[MultiModalRef]
    embeds: dict[int, torch.Tensor] = field(default_factory=dict)

    def overlaps(self, start: int, end: int) -> list[int]:
        """Indices of the items whose span meets positions [start, end)."""
        return [k for k, it in enumerate(self.items) if it.offset < end and it.offset + it.length > start]

    def release(self, computed: int) -> None:
        """Drop the outputs of items the prefill has passed."""
        for k in [k for k in self.embeds if self.items[k].offset + self.items[k].length <= computed]:
            del self.embeds[k]


def pixels(item: MultiModalRef, device: torch.device) -> torch.Tensor:
    """An item's pixel values as a [C, H, W] tensor (a copy: the message's bytes are read-only)."""
    assert item.data is not None, "the core sends every image with its pixels"
    data = item.data
    array = np.frombuffer(data.data, dtype=np.dtype(data.dtype)).reshape(data.shape)
    return torch.tensor(array, device=device)


@dataclass
class StepImages:
    """What one step learned about images: rows to overwrite, requests that failed, cache counts."""

    rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (first flat row, embeddings)
    failed: dict[str, str] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0


def gather_step_images(
    model: ImageEncoder,
    cache: EncoderCache,
    requests: Sequence[tuple[str, RequestImages | None, int, int, int]],
    device: torch.device,
) -> StepImages:
    """For each (request id, its images, first flat row, start, end) of a step: the embedding rows its
    positions [start, end) take from its images, encoding (in one batch per image size) those
    neither the request nor the cache holds."""
    step = StepImages()
    wanted: dict[str, list[tuple[RequestImages, int]]] = {}
    for _, images, _, start, end in requests:
        if images is None:
            continue
        for k in images.overlaps(start, end):
            if k in images.embeds:
                continue
            found = cache.get(images.items[k].content_hash)
            if found is not None:
                images.embeds[k] = found
                step.hits += 1
            else:
                wanted.setdefault(images.items[k].content_hash, []).append((images, k))
    refused = _encode(model, cache, wanted, device, step)
    for rid, images, base, start, end in requests:
        if images is None:
            continue
        for k in images.overlaps(start, end):
            item, emb = images.items[k], images.embeds.get(k)
            if emb is None or emb.shape[0] != item.length:
                got = "nothing" if emb is None else f"{emb.shape[0]} embeddings"
                why = refused.get(item.content_hash, f"its encoder gave {got}")
                step.failed[rid] = f"image {k} (filling {item.length} placeholders) cannot be used: {why}"
                continue
            lo, hi = max(start, item.offset), min(end, item.offset + item.length)
            step.rows.append((base + lo - start, emb[lo - item.offset : hi - item.offset]))
    return step


def _encode(
    model: ImageEncoder,
    cache: EncoderCache,
    wanted: dict[str, list[tuple[RequestImages, int]]],
    device: torch.device,
    step: StepImages,
) -> dict[str, str]:
    """Run the vision encoder once per distinct image, batched by pixel shape; returns why the
    images of a batch the model refused (a size its tower does not take) could not be encoded."""
    by_shape: dict[tuple[int, ...], list[str]] = {}
    for key, users in wanted.items():
        images, k = users[0]
        data = images.items[k].data
        assert data is not None, "the core sends every image with its pixels"
        by_shape.setdefault(tuple(data.shape), []).append(key)
    refused: dict[str, str] = {}
    for keys in by_shape.values():
        batch = torch.stack([pixels(wanted[key][0][0].items[wanted[key][0][1]], device) for key in keys])
        try:
            out = model.embed_images(batch)  # [N, tokens, hidden]
        except ValueError as e:  # the request fails, not the worker
            refused.update(dict.fromkeys(keys, str(e)))
            continue
        for key, emb in zip(keys, out):
            cache.put(key, emb)
            step.misses += 1
            for images, k in wanted[key]:
                images.embeds[k] = emb
    return refused
