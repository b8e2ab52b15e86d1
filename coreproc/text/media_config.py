"""The `media` flags of `serve` and `batch` (`MediaConfig`), and the image kwargs of one request.

Imported where requests come in (the HTTP frontend, batch mode, the offline API) and by the CLI, so
it stays light: no transformers, no Pillow, no httpx. `MediaConfig.request_kwargs` applies the trust
rule: a request's `mm_processor_kwargs` / `media_io_kwargs` are a 400 naming the field unless the
server runs with `--trust-request-mm-kwargs`; then they are merged over the server's
(`--mm-processor-kwargs`) into the `MediaKwargs` that `coreproc.text.media` processes with. These
settings are flags, not `LLM(...)` keywords (`LLM(media=MediaConfig(...))`): their errors name the flag.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from coreproc.base.errors import ConfigError
from coreproc.base.options import option
from coreproc.text.openai_protocol import RequestError

DEFAULT_IMAGES_PER_PROMPT = 4
IMAGE_MODES = ("1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "YCbCr", "I", "F")  # Pillow's


@dataclass(frozen=True)
class MediaConfig:
    """Where images may come from, how big they may be, and who chooses how they are processed."""

    allowed_local_media_path: str | None = option(
        "file:// image URLs are read only under this folder (default: file:// refused)", None, metavar="DIR"
    )
    allowed_media_domains: tuple[str, ...] = option(
        "the hosts http(s) image URLs (and their redirects) may name (default: any)", (), metavar="HOST"
    )
    media_fetch_timeout: float = option(
        "seconds to fetch one image URL, redirects included", 10.0, metavar="SECONDS"
    )
    max_image_bytes: int = option(
        "largest encoded image (data URL, download or file), bytes (a data URL must also fit "
        "--max-request-bytes)",
        10 * 2**20,
        metavar="BYTES",
    )
    max_image_pixels: int = option(
        "most pixels (width x height) of a decoded image", 4096 * 4096, metavar="N"
    )
    limit_mm_per_prompt: str = option(
        'most images in one prompt: N, or as vLLM spells it, JSON {"image": N}',
        str(DEFAULT_IMAGES_PER_PROMPT),
        metavar="N|JSON",
    )
    trust_request_mm_kwargs: bool = option(
        "take requests' mm_processor_kwargs and media_io_kwargs (else they are refused with 400)", False
    )
    mm_processor_kwargs: str | None = option(
        'a JSON object of image-processor kwargs for every image (e.g. {"do_center_crop": false})',
        None,
        metavar="JSON",
    )
    media_workers: int = option("processes that decode and process images", 1, metavar="N")

    def __post_init__(self) -> None:
        if self.media_fetch_timeout <= 0:
            raise ConfigError(f"--media-fetch-timeout must be positive, got {self.media_fetch_timeout}")
        for flag, value in (
            ("--max-image-bytes", self.max_image_bytes),
            ("--max-image-pixels", self.max_image_pixels),
            ("--media-workers", self.media_workers),
        ):
            if value < 1:
                raise ConfigError(f"{flag} must be at least 1, got {value}")
        _ = self.max_images, self.processor_kwargs  # parse errors now, as ConfigError

    @cached_property
    def max_images(self) -> int:
        value: Any = self.limit_mm_per_prompt
        try:
            value = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError:
            raise ConfigError(f'--limit-mm-per-prompt takes N or {{"image": N}}, not {value!r}') from None
        if isinstance(value, dict):
            others = {k: v for k, v in value.items() if k != "image" and v}
            if others:
                raise ConfigError(f"--limit-mm-per-prompt: Ember takes images only, not {sorted(others)}")
            value = value.get("image", DEFAULT_IMAGES_PER_PROMPT)
        if type(value) is not int or value < 0:
            raise ConfigError(
                f"--limit-mm-per-prompt: the image limit must be a non-negative int, not {value!r}"
            )
        return value

    @property
    def allowed_domains(self) -> frozenset[str]:
        return frozenset(d.lower() for d in self.allowed_media_domains)

    @cached_property
    def processor_kwargs(self) -> dict[str, Any]:
        value: Any = self.mm_processor_kwargs
        try:
            value = json.loads(value) if isinstance(value, str) else (value or {})
        except json.JSONDecodeError as e:
            raise ConfigError(f"--mm-processor-kwargs is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError(
                f"--mm-processor-kwargs must be a JSON object, got {self.mm_processor_kwargs!r}"
            )
        return value

    def request_kwargs(self, mm_processor_kwargs: Any = None, media_io_kwargs: Any = None) -> MediaKwargs:
        """The effective kwargs of one request: its own (refused unless --trust-request-mm-kwargs)
        merged over the server's. `media_io_kwargs` takes {"image": {"image_mode": MODE}}: decoded
        images are converted to that Pillow mode before the processor sees them."""
        for name, value in (
            ("mm_processor_kwargs", mm_processor_kwargs),
            ("media_io_kwargs", media_io_kwargs),
        ):
            if value is not None and not self.trust_request_mm_kwargs:
                raise RequestError(
                    f"{name} is refused: this server takes no per-request image kwargs "
                    "(a server started with --trust-request-mm-kwargs does)",
                    name,
                )
        if mm_processor_kwargs is not None and not isinstance(mm_processor_kwargs, dict):
            raise RequestError("mm_processor_kwargs must be an object", "mm_processor_kwargs")
        return MediaKwargs(
            {**self.processor_kwargs, **(mm_processor_kwargs or {})}, _image_mode(media_io_kwargs)
        )


MEDIA_SECTIONS: tuple[tuple[str, type], ...] = (("media", MediaConfig),)


def _image_mode(io: Any) -> str | None:
    param = "media_io_kwargs"
    if io is None:
        return None
    if not isinstance(io, dict) or set(io) - {"image"}:
        raise RequestError('media_io_kwargs takes only {"image": {...}} (Ember reads images only)', param)
    image = io.get("image") or {}
    if not isinstance(image, dict) or set(image) - {"image_mode"}:
        raise RequestError("media_io_kwargs.image takes only image_mode", param)
    mode = image.get("image_mode")
    if mode is not None and mode not in IMAGE_MODES:
        raise RequestError(f"media_io_kwargs.image.image_mode must be one of {', '.join(IMAGE_MODES)}", param)
    return mode


@dataclass(frozen=True)
class MediaKwargs:
    """How a request's images are processed: processor kwargs, and a Pillow mode to convert to first."""

    processor: Mapping[str, Any] = field(default_factory=dict)
    image_mode: str | None = None

    @property
    def canonical(self) -> str:
        return json.dumps(
            {"processor": self.processor, "image_mode": self.image_mode},
            sort_keys=True,
            separators=(",", ":"),
        )
