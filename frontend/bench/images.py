"""The `random-mm` dataset of `ember bench serve`: chat requests with random images as data URLs.

Runs in the benchmark client. Each request carries `--mm-images-per-request` PNG images of
`--mm-image-size` pixels (random noise, deterministic in the seed) before its text. With
`--mm-unique-images K` the images are drawn from a pool of K, so a run measures image reuse (the
engine's image store, encoder cache and prefix cache); 0 makes every image distinct.
"""

from __future__ import annotations

import base64
import io
import random


def parse_size(text: str) -> tuple[int, int]:
    """ "WxH" (or one number for a square) -> (width, height)."""
    parts = text.lower().split("x")
    try:
        width, height = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        width = height = 0
    if width < 1 or height < 1:
        raise ValueError(f"image size {text!r} must be WxH or N, positive")
    return width, height


def png_data_url(rng: random.Random, size: tuple[int, int]) -> str:
    """A random-noise RGB PNG as a data: URL."""
    from PIL import Image

    width, height = size
    image = Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def request_images(
    rng: random.Random, num_requests: int, per_request: int, size: tuple[int, int], unique: int
) -> list[tuple[str, ...]]:
    """The image URLs of each request: fresh ones, or drawn from a pool of `unique`."""
    pool = [png_data_url(rng, size) for _ in range(unique)]
    return [
        tuple(rng.choice(pool) if pool else png_data_url(rng, size) for _ in range(per_request))
        for _ in range(num_requests)
    ]
