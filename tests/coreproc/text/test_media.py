"""The image intake (coreproc/text/media*.py): fetching, decoding, processing and placeholder expansion.

Data URLs, http(s) from a loopback server in a thread (ok, redirects, a slow server against a short
timeout, a body too big cut off while streaming, a redirect to a domain not allowed), file:// inside
and outside the allowed folder (a symlink out of it too); not-an-image, truncated, too many pixels,
too many images; placeholders and pixels equal to transformers' `AutoProcessor` for one and two images
of different sizes; the content hash follows the processor kwargs; a repeated image is not processed
again; a dead image process fails one request and the next works; the trust rule for per-request
kwargs; the chat parts and the engine requests that carry the images; and none of it imports torch in
the importing process. Run: `pytest -q tests/coreproc/text/test_media.py`.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import os
import subprocess
import sys
import threading
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from coreproc.base.errors import ConfigError
from coreproc.base.protocol import SamplingParams
from coreproc.text.chat import TEXT_ONLY, chat_images, render_chat, template_messages
from coreproc.text.media import ImagePart, ImageTokens, MediaIntake, _Job
from coreproc.text.media_config import MediaConfig, MediaKwargs
from coreproc.text.openai_protocol import RequestError, parse_chat_request
from coreproc.text.output_processor import OutputProcessor
from coreproc.text.render import render_prompts, take_images
from frontend.make_model import main as make_model

pytestmark = pytest.mark.unit

MAX_PIXELS = 300 * 300  # small, so a "too many pixels" image stays cheap
WHERE = "messages[0].content[0]"


def png(seed: int, size: tuple[int, int] = (70, 90), fmt: str = "PNG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llava")
    assert make_model([str(out), "--arch", "llava"]) == 0
    return out


@pytest.fixture(scope="module")
def token_id(llava: Path) -> int:
    import json

    return json.loads((llava / "config.json").read_text())["image_token_index"]


@pytest.fixture(scope="module")
def tokenizer(llava: Path):
    from coreproc.base.tokenizer import load_tokenizer

    return load_tokenizer(str(llava))


@pytest.fixture(scope="module")
def intake(llava: Path, token_id: int):
    """One intake (one image process) for the module; its config allows loopback URLs."""
    with MediaIntake.from_model(llava, token_id, MediaConfig(max_image_pixels=MAX_PIXELS)) as m:
        yield m


@pytest.fixture(scope="module")
def loader(llava: Path, token_id: int):
    """Intakes of other configs, for `load` (no image process starts until an image is processed)."""
    return lambda **config: MediaIntake.from_model(llava, token_id, MediaConfig(**config))


# ----------------------------------------------------------------------------- a loopback HTTP server


class Handler(http.server.BaseHTTPRequestHandler):
    release: threading.Event  # set when the module ends: lets the slow handler go
    image: bytes

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        host = self.headers["Host"]
        port = host.rsplit(":", 1)[1]
        routes = {
            "/img.png": lambda: self._send(200, self.image),
            "/missing.png": lambda: self._send(404, b"not found"),
            "/to-img": lambda: self._redirect("/img.png"),
            "/to-other-domain": lambda: self._redirect(f"http://localhost:{port}/img.png"),
            "/loop": lambda: self._redirect("/loop"),
            "/announced-too-big": lambda: self._send(200, b"x" * 5000),
            "/endless": self._endless,
            "/slow": self._slow,
        }
        routes.get(self.path, lambda: self._send(404, b""))()

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _endless(self) -> None:
        """No Content-Length, and more bytes than any test allows: only a reader that stops at the
        limit gets an answer."""
        self.send_response(200)
        self.end_headers()
        try:
            for _ in range(100_000):
                self.wfile.write(b"\0" * 4096)
        except OSError:  # the client hung up
            pass

    def _slow(self) -> None:
        self.release.wait(30)
        try:
            self._send(200, self.image)
        except OSError:  # the client gave up long ago
            pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def http_url():
    release = threading.Event()
    handler = type("H", (Handler,), {"release": release, "image": png(7)})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    release.set()
    server.shutdown()
    server.server_close()


# ----------------------------------------------------------------------------- loading


def test_data_urls(loader) -> None:
    m = loader()
    assert m.load(data_url(png(1)), WHERE) == png(1)
    assert m.load(png(1)) == png(1)  # bytes pass through
    with pytest.raises(RequestError, match=r"messages\[0\]\.content\[0\]: the data URL is not valid base64"):
        m.load("data:image/png;base64,@@not base64@@", WHERE)
    with pytest.raises(RequestError, match="not image/"):
        m.load("data:text/plain;base64,aGVsbG8=", WHERE)
    with pytest.raises(RequestError, match="only base64 data URLs"):
        m.load("data:image/png,rawbytes", WHERE)
    with pytest.raises(RequestError, match=r"larger than 100 bytes \(--max-image-bytes\)") as e:
        loader(max_image_bytes=100).load(data_url(png(1)), WHERE)
    assert e.value.param == WHERE and e.value.status == 400
    for url in ("ftp://host/img.png", "img.png", "javascript:alert(1)"):
        with pytest.raises(RequestError, match="must be a data:, http"):
            m.load(url, WHERE)


def test_http_fetch(loader, http_url: str) -> None:
    with pytest.raises(RequestError, match=r"'127\.0\.0\.1' is an internal address"):
        loader().load(f"{http_url}/img.png", WHERE)  # no list: public hosts only
    m = loader(media_fetch_timeout=5, allowed_media_domains=("127.0.0.1",))
    assert m.load(f"{http_url}/img.png", WHERE) == png(7)
    assert m.load(f"{http_url}/to-img", WHERE) == png(7)  # a redirect within the allowed domain
    assert loader(allowed_media_domains=("127.0.0.1",)).load(f"{http_url}/to-img", WHERE) == png(7)
    with pytest.raises(RequestError, match="HTTP 404"):
        m.load(f"{http_url}/missing.png", WHERE)
    with pytest.raises(RequestError, match="redirects more than 3 times"):
        m.load(f"{http_url}/loop", WHERE)
    with pytest.raises(RequestError, match=r"domain '127\.0\.0\.1' is not allowed"):
        loader(allowed_media_domains=("example.com",)).load(f"{http_url}/img.png", WHERE)


def test_http_redirect_to_a_domain_not_allowed(loader, http_url: str) -> None:
    m = loader(allowed_media_domains=("127.0.0.1",))
    with pytest.raises(RequestError, match=r"domain 'localhost' \(after a redirect\) is not allowed") as e:
        m.load(f"{http_url}/to-other-domain", WHERE)
    assert e.value.param == WHERE


def test_http_timeout_and_size_limit(loader, http_url: str) -> None:
    with pytest.raises(
        RequestError, match=r"messages\[0\]\.content\[0\]: fetching the image took longer than 0.5s"
    ):
        loader(media_fetch_timeout=0.5, allowed_media_domains=("127.0.0.1",)).load(f"{http_url}/slow", WHERE)
    small = loader(max_image_bytes=1000, media_fetch_timeout=5, allowed_media_domains=("127.0.0.1",))
    with pytest.raises(RequestError, match="larger than 1000 bytes"):
        small.load(f"{http_url}/announced-too-big", WHERE)  # refused on its Content-Length
    with pytest.raises(RequestError, match="larger than 1000 bytes"):
        small.load(f"{http_url}/endless", WHERE)  # refused while streaming: the body never ends


def test_file_urls(loader, tmp_path: Path) -> None:
    root, outside = tmp_path / "media", tmp_path / "private"
    root.mkdir(), outside.mkdir()
    (root / "cat.png").write_bytes(png(2))
    (outside / "secret.png").write_bytes(png(3))
    (root / "escape.png").symlink_to(outside / "secret.png")
    (root / "inner.png").symlink_to(root / "cat.png")
    m = loader(allowed_local_media_path=str(root))
    assert m.load(f"file://{root}/cat.png", WHERE) == png(2)
    assert m.load(f"file://{root}/inner.png", WHERE) == png(2)  # a link that stays inside
    for url in (
        f"file://{outside}/secret.png",
        f"file://{root}/escape.png",
        f"file://{root}/../private/secret.png",
    ):
        with pytest.raises(RequestError, match="outside the allowed local media path"):
            m.load(url, WHERE)
    with pytest.raises(RequestError, match="no such file"):
        m.load(f"file://{root}/none.png", WHERE)
    with pytest.raises(RequestError, match="file:// image URLs are refused"):
        loader().load(f"file://{root}/cat.png", WHERE)
    with pytest.raises(RequestError, match="larger than 10 bytes"):
        loader(allowed_local_media_path=str(root), max_image_bytes=10).load(f"file://{root}/cat.png", WHERE)


# ----------------------------------------------------------------------------- processing


def hf_expand(
    llava: Path, tokenizer, messages: list[dict], images: list[bytes]
) -> tuple[list[int], np.ndarray]:
    """transformers' LlavaProcessor on the same rendered text and images."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(llava)
    text = tokenizer.apply_chat_template(
        template_messages(messages, True), tokenize=False, add_generation_prompt=True
    )
    pil = [Image.open(io.BytesIO(d)) for d in images]
    out = processor(text=text, images=pil, return_tensors="np", add_special_tokens=False)
    return out["input_ids"][0].tolist(), out["pixel_values"]


@pytest.mark.parametrize("sizes", [[(70, 90)], [(120, 40), (33, 200)]])
def test_expansion_equals_transformers(llava, tokenizer, token_id, intake, sizes) -> None:
    images = [png(i, size) for i, size in enumerate(sizes)]
    parts = [image_part(data_url(d)) for d in images]
    messages = user(parts[0], {"type": "text", "text": "what is it?"}, *parts[1:])
    rendered = render_chat(tokenizer, messages, takes_images=True)
    assert rendered.count(token_id) == len(images)
    ids, refs = intake.take(rendered, chat_images(messages))
    want_ids, want_pixels = hf_expand(llava, tokenizer, messages, images)
    assert ids == want_ids
    assert [(r.offset, r.length) for r in refs] == [
        (i, 16) for i in range(len(ids)) if ids[i] == token_id and (i == 0 or ids[i - 1] != token_id)
    ]
    for ref, want in zip(refs, want_pixels):
        assert ref.data is not None and ref.data.shape == [3, 56, 56] and ref.data.dtype == "float32"
        assert np.frombuffer(ref.data.data, np.float32).reshape(ref.data.shape).tobytes() == want.tobytes()
    async_ids, async_refs = asyncio.run(intake.take_async(rendered, chat_images(messages)))
    assert async_ids == ids and async_refs == refs


def test_hash_follows_kwargs_and_repeats_are_not_processed_again(intake, monkeypatch) -> None:
    data = png(11)
    (plain,) = intake.process([data])
    raw_kwargs = MediaKwargs({"do_normalize": False})
    (raw,) = intake.process([data], raw_kwargs)
    (gray,) = intake.process([data], MediaKwargs(image_mode="L"))
    assert len({plain.content_hash, raw.content_hash, gray.content_hash}) == 3
    assert raw.pixels.data != plain.pixels.data and gray.pixels.data != plain.pixels.data
    assert raw.pixels.shape == gray.pixels.shape == [3, 56, 56] and raw.num_tokens == 16
    assert intake.process([png(12)])[0].content_hash != plain.content_hash

    def no_processing(*args: object) -> None:
        raise AssertionError("a cached image went to the image process")

    monkeypatch.setattr(intake, "_submit", no_processing)
    assert intake.process([data, data]) == [plain, plain]
    assert intake.process([data], raw_kwargs) == [raw]


def test_placeholder_count_follows_the_processed_size(intake) -> None:
    assert intake.tokens == ImageTokens(14, 1, "default", 56)
    assert [intake.tokens.count([3, n, n]) for n in (28, 56, 112)] == [4, 16, 64]
    with pytest.raises(RequestError, match=r"made a 28x28 image; this model's vision tower takes 56x56") as e:
        intake.process([png(1)], MediaKwargs({"crop_size": {"height": 28, "width": 28}}), [WHERE])
    assert e.value.param == WHERE


def test_bad_images_are_refused_with_their_part(intake) -> None:
    truncated = png(5)[:400]
    cases = {
        b"hello, not an image": "the data is not an image",
        truncated: "the image is truncated or corrupt",
        png(6, (400, 400)): r"the image has 400x400 pixels, more than 90000 \(--max-image-pixels\)",
        png(6, (2000, 50)): "the image has 50x2000 pixels",
        png(6, (600, 600)): "the image has more than 90000 pixels",  # Pillow's bomb guard (twice the limit)
    }
    for data, message in cases.items():
        with pytest.raises(RequestError, match=rf"^messages\[1\]\.content\[2\]: {message}") as e:
            intake.process([data], where=["messages[1].content[2]"])
        assert e.value.status == 400 and e.value.param == "messages[1].content[2]"
    with pytest.raises(RequestError, match="the image processor failed"):
        intake.process([png(1)], MediaKwargs({"crop_size": "not a size"}))
    assert intake.process([png(1)])[0].num_tokens == 16  # the image process is still fine


def test_counts_are_checked_before_fetching(intake, token_id) -> None:
    part = ImagePart("http://unreachable.invalid/x.png", WHERE)
    with pytest.raises(RequestError, match=r"5 images in one prompt; this server takes at most 4"):
        intake.take([token_id] * 5, [part] * 5)
    with pytest.raises(RequestError, match="the chat template placed 1 image tokens for 2 images"):
        intake.take([1, token_id, 2], [part] * 2)
    with pytest.raises(RequestError, match="the chat template placed 0 image tokens for 1 images"):
        intake.expand([1, 2], intake.process([png(1)]))


def test_a_dead_image_process_fails_one_request_and_the_next_works(intake, monkeypatch) -> None:
    pool = intake._executor()
    assert isinstance(pool.submit(os._exit, 1).exception(timeout=60), BrokenProcessPool)  # it died
    assert intake.process([png(21)])[0].num_tokens == 16  # a fresh image process took over
    pool = intake._executor()
    crashed: Future = Future()  # an image in flight when its process dies (as a hostile one might)
    crashed.set_exception(BrokenProcessPool("a child process terminated abruptly"))
    monkeypatch.setattr(intake, "_submit", lambda data, kwargs, where: _Job(where, crashed, pool))
    with pytest.raises(RequestError, match=r"^messages\[0\]\.content\[0\]: the image process died") as e:
        intake.process([png(22)], where=[WHERE])
    assert e.value.status == 400
    monkeypatch.undo()
    assert intake._executor() is not pool  # the pool that lost its process is replaced
    assert intake.process([png(22)])[0].num_tokens == 16


def test_nothing_here_imports_torch(llava: Path, token_id: int) -> None:
    """The frontend's intake and rendering, even while images are processed, stay torch-free."""
    code = (
        "import sys, base64\n"
        "import coreproc.text.media, coreproc.text.chat, coreproc.text.render, frontend.http.server\n"
        "from coreproc.text.media import MediaIntake, ImagePart\n"
        f"with MediaIntake.from_model({str(llava)!r}, {token_id}) as m:\n"
        f"    ids, refs = m.take([1, {token_id}, 2], [ImagePart({data_url(png(1))!r}, 'x')])\n"
        "assert len(ids) == 18 and refs[0].length == 16, (ids, refs)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ----------------------------------------------------------------------------- config and kwargs


def test_config_flags() -> None:
    assert MediaConfig().max_images == 4
    assert MediaConfig(limit_mm_per_prompt="2").max_images == 2
    assert MediaConfig(limit_mm_per_prompt='{"image": 3}').max_images == 3
    assert MediaConfig(limit_mm_per_prompt='{"image": 3, "video": 0}').max_images == 3
    for bad in ('{"video": 1}', "many", "-1", '{"image": "x"}'):
        with pytest.raises(ConfigError, match="--limit-mm-per-prompt"):
            MediaConfig(limit_mm_per_prompt=bad)
    with pytest.raises(ConfigError, match="--mm-processor-kwargs"):
        MediaConfig(mm_processor_kwargs="{not json")
    with pytest.raises(ConfigError, match="--mm-processor-kwargs must be a JSON object"):
        MediaConfig(mm_processor_kwargs="[1]")
    with pytest.raises(ConfigError, match="--media-fetch-timeout"):
        MediaConfig(media_fetch_timeout=0)


def test_request_kwargs_need_trust() -> None:
    server = '{"do_center_crop": true, "crop_size": {"height": 56, "width": 56}}'
    untrusted = MediaConfig(mm_processor_kwargs=server)
    assert untrusted.request_kwargs() == MediaKwargs(
        {"do_center_crop": True, "crop_size": {"height": 56, "width": 56}}
    )
    for name in ("mm_processor_kwargs", "media_io_kwargs"):
        with pytest.raises(RequestError, match=f"{name} is refused.*--trust-request-mm-kwargs") as e:
            untrusted.request_kwargs(**{name: {}})
        assert e.value.param == name
    trusted = MediaConfig(mm_processor_kwargs=server, trust_request_mm_kwargs=True)
    got = trusted.request_kwargs({"crop_size": {"height": 28, "width": 28}}, {"image": {"image_mode": "L"}})
    assert got == MediaKwargs({"do_center_crop": True, "crop_size": {"height": 28, "width": 28}}, "L")
    for io_kwargs in ({"video": {}}, {"image": {"num_frames": 2}}, {"image": {"image_mode": "XYZ"}}):
        with pytest.raises(RequestError, match="media_io_kwargs"):
            trusted.request_kwargs(None, io_kwargs)


# ----------------------------------------------------------------------------- chat parts and requests


def test_image_part_spellings_and_template_content(tokenizer, token_id) -> None:
    url = data_url(png(1))
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        user(
            {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
            {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": url},
            {"type": "image", "image": url},
            {"type": "input_image", "image_url": url, "detail": "auto"},
        )[0],
    ]
    req = parse_chat_request({"messages": messages})
    for given in (messages, req.messages):
        assert chat_images(given) == [ImagePart(url, f"messages[1].content[{j}]") for j in (0, 2, 3, 4)]
        conversation = template_messages(given, takes_images=True)
        assert conversation[0]["content"] == "be brief"  # no images: flattened as before
        image = {"type": "image"}
        assert conversation[1]["content"] == [image, {"type": "text", "text": "and"}, image, image, image]
    assert render_chat(tokenizer, messages, takes_images=True).count(token_id) == 4
    with pytest.raises(RequestError, match=rf"messages\[1\]\.content\[0\]: {TEXT_ONLY}") as e:
        render_chat(tokenizer, messages)
    assert e.value.param == "messages[1].content"
    with pytest.raises(RequestError, match=r"messages\[0\]\.content\[0\]: an image part needs its URL"):
        chat_images(user({"type": "image_url", "image_url": {"detail": "low"}}))
    with pytest.raises(RequestError, match="parts of type 'input_audio' are not supported"):
        chat_images(user({"type": "input_audio", "input_audio": {}}))


def test_render_and_take_images(tokenizer, token_id, intake) -> None:
    req = parse_chat_request({"messages": user(image_part(data_url(png(1))), {"type": "text", "text": "hi"})})
    with pytest.raises(RequestError, match=TEXT_ONLY):
        render_prompts(req, tokenizer, 512)
    (prompt,) = render_prompts(req, tokenizer, 512, takes_images=True)
    assert prompt.ids.count(token_id) == 1 and prompt.images == (ImagePart(data_url(png(1)), WHERE),)
    taken = take_images(prompt, intake)
    assert taken.images == () and len(taken.mm_refs) == 1 and taken.ids.count(token_id) == 16
    assert take_images(taken, None) is taken  # nothing left to take


def test_only_the_first_sequence_carries_the_pixels(intake, token_id) -> None:
    ids, refs = intake.take([1, token_id, 2], [ImagePart(data_url(png(1)), WHERE)])
    ers = OutputProcessor(None).engine_requests("r", ids, SamplingParams(n=3), mm_refs=tuple(refs))
    assert [len(er.mm_refs) for er in ers] == [1, 1, 1]
    assert ers[0].mm_refs == refs
    for er in ers[1:]:
        (ref,) = er.mm_refs
        assert ref.data is None and (ref.content_hash, ref.offset, ref.length) == (
            refs[0].content_hash,
            refs[0].offset,
            refs[0].length,
        )
    assert OutputProcessor(None).engine_requests("t", [1, 2], SamplingParams())[0].mm_refs == []
