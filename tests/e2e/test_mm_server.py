"""Images through `ember serve`: the real `openai` client, a real server on a tiny LLaVA checkpoint.

A chat with an image (data URL, http:// from a loopback server, file:// from the allowed folder)
answers what transformers' `LlavaForConditionalGeneration.generate` answers on its own processor's
inputs, streamed or not, with n > 1; /tokenize counts the placeholders. Every bad image is a 400 that
names the part and the problem, and the server stays healthy. A second server shows the trust flag:
per-request `mm_processor_kwargs` / `media_io_kwargs` are refused without it and used with it.
`ember batch` takes the same chats through the same intake. Run: `pytest -q tests/e2e/test_mm_server.py`.
"""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading
from functools import cache
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from frontend.cli import main as ember
from frontend.make_model import main as make_model
from tests.server_util import start_server, stop_server

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
QUESTION = "what is in the picture?"


def png(seed: int, size: tuple[int, int] = (70, 90), noise: bool = True) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256 if noise else 1, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(*urls: str, text: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llava")
    assert make_model([str(out), "--arch", "llava"]) == 0
    return out


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(png(1))
    outside = tmp_path_factory.mktemp("private")
    (outside / "secret.png").write_bytes(png(2))
    (root / "escape.png").symlink_to(outside / "secret.png")
    return root


class Images(http.server.BaseHTTPRequestHandler):
    release: threading.Event

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        port = self.headers["Host"].rsplit(":", 1)[1]
        if self.path == "/cat.png":
            return self._send(png(1))
        if self.path == "/away":  # to a domain the server does not allow
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{port}/cat.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        if self.path == "/slow":
            self.release.wait(30)
        self._send(b"")

    def _send(self, body: bytes) -> None:
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the server's fetch gave up
            pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def images_url():
    release = threading.Event()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("H", (Images,), {"release": release}))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    release.set()
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def server(llava, media_dir):
    proc, url = start_server(
        str(llava),
        "--allowed-local-media-path", str(media_dir),
        "--allowed-media-domains", "127.0.0.1",
        "--media-fetch-timeout", "1",
        "--max-image-pixels", "90000",
        "--max-image-bytes", "100000",
        name="llava",
    )  # fmt: skip
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def trusting(llava):
    proc, url = start_server(str(llava), "--trust-request-mm-kwargs", name="llava")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


@cache
def hf_answer(llava: Path, seeds: tuple[int, ...]) -> tuple[int, str]:
    """transformers' prompt length and greedy answer for images `seeds` before QUESTION."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(llava)
    model = LlavaForConditionalGeneration.from_pretrained(llava).eval()
    content = [{"type": "image"} for _ in seeds] + [{"type": "text", "text": QUESTION}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    pil = [Image.open(io.BytesIO(png(s))) for s in seeds]
    inputs = processor(text=prompt, images=pil, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    n = inputs["input_ids"].shape[1]
    return n, processor.tokenizer.decode(out[0, n:], skip_special_tokens=True)


def test_image_chat_equals_transformers_streamed_or_not(client, llava) -> None:
    for seeds in ((1,), (3, 4)):
        prompt_len, want = hf_answer(llava, seeds)
        messages = chat(*(data_url(png(s)) for s in seeds))
        out = client.chat.completions.create(
            model="llava", messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        assert out.choices[0].message.content == want
        assert out.usage.prompt_tokens == prompt_len
        stream = client.chat.completions.create(
            model="llava", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_http_and_file_urls_and_n(client, llava, media_dir, images_url) -> None:
    _, want = hf_answer(llava, (1,))
    for url in (f"{images_url}/cat.png", f"file://{media_dir}/cat.png"):
        out = client.chat.completions.create(
            model="llava", messages=chat(url), max_tokens=MAX_TOKENS, temperature=0
        )
        assert out.choices[0].message.content == want, url
    out = client.chat.completions.create(  # siblings name the image by hash, resolved in one submission
        model="llava", messages=chat(data_url(png(1))), max_tokens=MAX_TOKENS, temperature=0, n=3
    )
    assert [c.message.content for c in out.choices] == [want] * 3


def test_tokenize_counts_the_placeholders(server, llava) -> None:
    prompt_len, _ = hf_answer(llava, (3, 4))
    body = {"model": "llava", "messages": chat(data_url(png(3)), data_url(png(4)))}
    assert httpx.post(f"{server}/tokenize", json=body, timeout=60).json()["count"] == prompt_len


def bad_cases(media_dir: Path, images_url: str) -> dict[str, tuple[list[dict], str, str]]:
    """name -> (messages, the error's param, a piece of its message)."""
    where = "messages[0].content[0]"
    truncated = png(5)[:300]
    return {
        "bad base64": (chat("data:image/png;base64,@@@"), where, "is not valid base64"),
        "not an image": (chat(data_url(b"plain text, no image")), where, "is not an image"),
        "truncated": (chat(data_url(truncated)), where, "is truncated or corrupt"),
        "too many pixels": (
            chat(data_url(png(6, (400, 400), noise=False))),
            where,
            "400x400 pixels, more than 90000",
        ),
        "too large": (chat(data_url(png(7, (250, 250)))), where, "larger than 100000 bytes"),
        "too many images": (chat(*[data_url(png(1))] * 5), "messages", "5 images in one prompt"),
        "bad scheme": (chat("ftp://127.0.0.1/cat.png"), where, "must be a data:, http(s):// or file:// URL"),
        "domain": (chat(images_url.replace("127.0.0.1", "localhost") + "/cat.png"), where, "not allowed"),
        "redirect": (chat(f"{images_url}/away"), where, "'localhost' (after a redirect) is not allowed"),
        "timeout": (chat(f"{images_url}/slow"), where, "took longer than 1s"),
        "file outside": (
            chat(f"file://{media_dir}/escape.png"),
            where,
            "outside the allowed local media path",
        ),
        "template": (
            chat(data_url(png(1)), text="<image>"),
            "messages",
            "placed 2 image tokens for 1 images",
        ),
    }


def test_bad_images_are_400s_and_the_server_stays_healthy(
    server, client, llava, media_dir, images_url
) -> None:
    for name, (messages, param, message) in bad_cases(media_dir, images_url).items():
        resp = httpx.post(
            f"{server}/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=60
        )
        assert resp.status_code == 400, (name, resp.text)
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, (name, error)
        assert message in error["message"] and "\n" not in error["message"], (name, error)
    with pytest.raises(openai.BadRequestError, match="is not valid base64"):
        client.chat.completions.create(
            model="llava", messages=chat("data:image/png;base64,@@@"), max_tokens=2
        )
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200
    _, want = hf_answer(llava, (1,))
    out = client.chat.completions.create(
        model="llava", messages=chat(data_url(png(1))), max_tokens=MAX_TOKENS, temperature=0
    )
    assert out.choices[0].message.content == want


def test_request_kwargs_only_with_the_trust_flag(server, trusting) -> None:
    body = {"messages": chat(data_url(png(1))), "max_tokens": 2, "temperature": 0}
    post = lambda url, extra: httpx.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=60)  # noqa: E731
    cases = {
        "mm_processor_kwargs": {"do_normalize": False},
        "media_io_kwargs": {"image": {"image_mode": "L"}},
    }
    for field, value in cases.items():
        refused = post(server, {field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field
        assert "--trust-request-mm-kwargs" in refused.json()["error"]["message"]
        assert post(trusting, {field: value}).status_code == 200
    # the kwargs reach the image processor: a crop this model's tower cannot take is refused by the intake
    crop = post(trusting, {"mm_processor_kwargs": {"crop_size": {"height": 28, "width": 28}}})
    assert crop.status_code == 400 and "made a 28x28 image" in crop.json()["error"]["message"]
    bad = post(trusting, {"media_io_kwargs": {"video": {}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "media_io_kwargs"
    assert httpx.get(f"{trusting}/health", timeout=10).status_code == 200


def test_batch_mode_takes_images(llava, tmp_path) -> None:
    _, want = hf_answer(llava, (1,))
    body = {"messages": chat(data_url(png(1))), "max_tokens": MAX_TOKENS, "temperature": 0}
    lines = {
        "ok": body,
        "n2": {**body, "n": 2},
        "bad": {**body, "messages": chat("data:image/png;base64,@@@")},
        "untrusted": {**body, "mm_processor_kwargs": {"do_normalize": False}},
    }
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    url = "/v1/chat/completions"
    rows = [{"custom_id": k, "method": "POST", "url": url, "body": v} for k, v in lines.items()]
    src.write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = ["--model", str(llava), "--dtype", "float32", "--no-progress"]
    assert ember(["batch", "-i", str(src), "-o", str(out), *flags]) == 0
    records = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    assert records["ok"]["status_code"] == 200
    assert records["ok"]["body"]["choices"][0]["message"]["content"] == want
    assert [c["message"]["content"] for c in records["n2"]["body"]["choices"]] == [want, want]
    assert records["bad"]["status_code"] == 400
    assert "not valid base64" in records["bad"]["body"]["error"]["message"]
    assert records["untrusted"]["body"]["error"]["param"] == "mm_processor_kwargs"


def test_bench_serve_random_mm_reports_images(trusting) -> None:
    """`ember bench serve --dataset random-mm` against the server: every request carries an image, and
    the engine's counters show each distinct image encoded once and the repeats reused."""
    import asyncio

    from frontend.bench.serve import BenchServeConfig, run_benchmark
    from frontend.bench.serve_report import format_table

    cfg = BenchServeConfig(
        base_url=trusting,
        dataset="random-mm",
        num_prompts=6,
        input_len=8,
        output_len=4,
        mm_image_size="64x48",
        mm_unique_images=2,
        max_concurrency=2,
        metrics_settle=1.2,
    )
    result = asyncio.run(run_benchmark(cfg))
    assert result["backend"] == "openai-chat" and result["completed"] == 6, result["errors"]
    assert result["num_images"] == 6
    assert result["encoder_cache_misses"] + result["encoder_cache_hits"] <= 6
    assert result["encoder_cache_misses"] >= 1 and result["prefix_cache_hits"] > 0  # repeats reused
    assert "Images/s" in format_table(result, cfg.percentiles)
