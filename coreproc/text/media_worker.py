"""The image process (`ember-media`): decodes images with Pillow and runs the checkpoint's processor.

Runs in the worker processes of `MediaIntake`'s pool (spawned, never forked from the frontend), so the
frontend never imports torch (transformers' image processing does) and an image that crashes or
exhausts Pillow takes down only this process. `init` loads the processor once per process; `process`
receives encoded image bytes and the effective kwargs as JSON and answers plain tuples, never
exceptions: `("ok", dtype, shape, pixel bytes)` (one image's `pixel_values`, C order, float32 or
float16), `("refused", message)` for a request's fault (HTTP 400) or `("failed", message)` for the
server's (HTTP 500).
"""

from __future__ import annotations

import io
import json
import os
import threading
import time
import warnings
from typing import Any

PARENT_POLL_S = 1.0

_processor: Any = None
_load_error: str | None = None
_max_pixels = 0

Result = tuple[Any, ...]


def init(model_dir: str, max_pixels: int, parent_pid: int) -> None:
    """Pool initializer: name the process, watch the parent, load the image processor (once)."""
    global _processor, _load_error, _max_pixels
    try:
        from setproctitle import setproctitle

        setproctitle("ember-media")
    except ImportError:  # a nicety only
        pass
    threading.Thread(target=_exit_with, args=(parent_pid,), daemon=True, name="parent-watch").start()
    _max_pixels = max_pixels
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = max_pixels  # Pillow's own bomb guard refuses at twice this while opening
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the explicit check below refuses
    try:
        from transformers import AutoImageProcessor

        _processor = AutoImageProcessor.from_pretrained(model_dir)
    except Exception as e:  # reported by every call, so the server answers 500 with the reason
        _load_error = f"the model's image processor did not load: {type(e).__name__}: {e}"


def _exit_with(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(0)


def ping() -> Result:
    """Answers once `init` ran: ("ok",) or ("failed", why the processor did not load)."""
    return ("failed", _load_error) if _load_error else ("ok",)


def process(data: bytes, kwargs_json: str, image_mode: str | None) -> Result:
    """One encoded image through Pillow and the processor (kwargs: the effective processor kwargs)."""
    if _load_error:
        return ("failed", _load_error)
    try:
        image = _decode(data, image_mode)
    except _Refused as e:
        return ("refused", str(e))
    try:
        out = _processor(images=[image], return_tensors="np", **json.loads(kwargs_json))
        pixels = out["pixel_values"][0]
    except Exception as e:  # bad kwargs, an image the processor cannot take
        return ("refused", f"the image processor failed: {type(e).__name__}: {e}")
    import numpy as np

    pixels = np.ascontiguousarray(pixels)
    if pixels.dtype not in (np.float32, np.float16):  # what the engine takes (e.g. without rescaling)
        pixels = pixels.astype(np.float32)
    if pixels.ndim != 3:
        return (
            "failed",
            f"the image processor gave pixel values of shape {list(pixels.shape)}, not [C, H, W]",
        )
    return ("ok", str(pixels.dtype), [int(n) for n in pixels.shape], pixels.tobytes())


class _Refused(Exception):
    pass


def _decode(data: bytes, image_mode: str | None) -> Any:
    from PIL import Image, UnidentifiedImageError

    image: Any
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except UnidentifiedImageError:
        raise _Refused("the data is not an image (or not in a format Pillow reads)") from None
    except Image.DecompressionBombError:
        raise _Refused(f"the image has more than {_max_pixels} pixels (--max-image-pixels)") from None
    except Exception as e:
        raise _Refused(f"the data is not a readable image ({type(e).__name__}: {e})") from None
    width, height = image.size
    if width * height > _max_pixels:
        raise _Refused(f"the image has {width}x{height} pixels, more than {_max_pixels} (--max-image-pixels)")
    try:
        image.load()
    except Exception as e:  # OSError "image file is truncated", SyntaxError, ValueError, ...
        raise _Refused(f"the image is truncated or corrupt ({type(e).__name__}: {e})") from None
    if image_mode is not None and image.mode != image_mode:
        try:
            image = image.convert(image_mode)
        except ValueError as e:
            raise _Refused(f"the image cannot be converted to {image_mode} ({e})") from None
    return image
