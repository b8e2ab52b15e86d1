"""Images through the engine: greedy tokens equal transformers' `LlavaForConditionalGeneration.generate`.

The prompts and pixels come from the checkpoint's own transformers processor (so this tests the
engine, not the intake): one and two images, images of different sizes, image requests batched with
text-only ones, a chunked prefill that splits an image, and the caches: the same image re-sent reuses
its KV blocks and encoder output, two images never share either, a hash-only item the core no longer
holds is refused as "mm_cache_miss", and fresh pixels replace what the core held under a hash.
Run: `pytest -q tests/workers/test_mm_engine.py`.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from coreproc.base.config import EngineConfig
from coreproc.base.protocol import EngineRequest, MultiModalRef, PixelData, SamplingParams
from coreproc.core.engine import EngineCore
from coreproc.core.mm_store import MediaStore, MultiModalCacheMiss
from frontend.make_model import main as make_model

pytestmark = pytest.mark.model

MAX_NEW = 12


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def llava(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"llava-{request.param}")
    assert make_model([str(out), "--arch", "llava", "--text-arch", request.param]) == 0
    return out


def image(seed: int, size: tuple[int, int] = (64, 48)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


@lru_cache(maxsize=4)
def _hf(path: str) -> tuple:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    return AutoProcessor.from_pretrained(path), LlavaForConditionalGeneration.from_pretrained(path).eval()


def hf_inputs(path: Path, text: str, images: list[Image.Image]) -> tuple[list[int], np.ndarray | None]:
    """transformers' prompt ids (images expanded) and pixel values for a user turn with `images` before
    `text`, from its processor's own `apply_chat_template(tokenize=True)`."""
    processor, _ = _hf(str(path))
    content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    batch = processor.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="np",
    )
    pixels = batch["pixel_values"] if images else None
    return batch["input_ids"][0].tolist(), pixels


@torch.inference_mode()
def hf_generate(path: Path, ids: list[int], pixels: np.ndarray | None) -> list[int]:
    _, model = _hf(str(path))
    input_ids = torch.tensor([ids])
    images = {} if pixels is None else {"pixel_values": torch.from_numpy(pixels)}
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        **images,
        do_sample=False,
        max_new_tokens=MAX_NEW,
        min_new_tokens=MAX_NEW,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def refs(
    ids: list[int], image_token: int, pixels: np.ndarray | None, send: bool = True
) -> list[MultiModalRef]:
    """One ref per run of placeholders, in order, with the image's pixels (hash: sha256 of them)."""
    out: list[MultiModalRef] = []
    k = 0
    i = 0
    while i < len(ids):
        if ids[i] != image_token:
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == image_token:
            j += 1
        assert pixels is not None
        arr = np.ascontiguousarray(pixels[k], dtype=np.float32)
        data = PixelData("float32", list(arr.shape), arr.tobytes())
        out.append(MultiModalRef(hashlib.sha256(data.data).hexdigest(), i, j - i, data if send else None))
        k, i = k + 1, j
    return out


def engine(path: Path, **kw) -> EngineCore:
    return EngineCore(EngineConfig.create(str(path), dtype="float32", **kw), show_progress=False)


def run(core: EngineCore, requests: list[EngineRequest]) -> dict[str, list[int]]:
    core.add_requests(requests)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while core.has_unfinished_requests():
        for out in core.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
    return tokens


def request(rid: str, ids: list[int], mm: list[MultiModalRef]) -> EngineRequest:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    return EngineRequest(request_id=rid, prompt_token_ids=ids, sampling_params=params, mm_refs=mm)


def image_token(path: Path) -> int:
    return _hf(str(path))[1].config.image_token_id


CASES = {
    "one image": ("what is in the picture?", [image(1)]),
    "two images, two sizes": ("compare them", [image(2, (80, 40)), image(3, (30, 90))]),
    "no image": ("just text, please", []),
}


@pytest.mark.parametrize("setup", ["default", "chunked"])
def test_greedy_matches_hf_batched_with_text(llava: Path, setup: str) -> None:
    """One batch: image prompts next to a text-only one; "chunked" splits each image across chunks."""
    kw = {"max_num_batched_tokens": 8} if setup == "chunked" else {}
    core = engine(llava, **kw)
    try:
        reqs, expected = [], {}
        for name, (text, images) in CASES.items():
            ids, pixels = hf_inputs(llava, text, images)
            reqs.append(request(name, ids, refs(ids, image_token(llava), pixels)))
            expected[name] = hf_generate(llava, ids, pixels)
        got = run(core, reqs)
        assert got == expected
        stats = core.stats()
        assert stats.encoder_cache_misses == 3  # three distinct images, each encoded once
    finally:
        core.shutdown()


def test_same_image_reuses_kv_and_encoder_and_different_images_share_nothing(llava: Path) -> None:
    core = engine(llava, block_size=4)
    try:
        tok = image_token(llava)
        ids, pixels = hf_inputs(llava, "describe", [image(4)])
        first = run(core, [request("a", ids, refs(ids, tok, pixels))])["a"]
        again = run(core, [request("b", ids, refs(ids, tok, pixels))])["b"]
        stats = core.stats()
        assert again == first == hf_generate(llava, ids, pixels)
        assert stats.encoder_cache_hits == 0  # the whole image was a prefix-cache hit: nothing to encode
        assert stats.prefix_cache_hits >= len(ids) - 4  # every full block, image blocks included
        before = stats.prefix_cache_hits
        other_ids, other = hf_inputs(llava, "describe", [image(5)])
        assert other_ids == ids  # the same tokens: only the pixels differ
        third = run(core, [request("c", ids, refs(ids, tok, other))])["c"]
        stats = core.stats()
        first_image = ids.index(tok)
        # only the blocks wholly before the image hit; the new image is encoded, not taken from the cache
        assert stats.prefix_cache_hits - before == (first_image // 4) * 4
        assert stats.encoder_cache_misses == 2
        assert third == hf_generate(llava, ids, other)
        assert third != first  # the pixels, not the tokens, made the difference
        # the image's blocks are evicted from the prefix cache: the next request encodes it again, or
        # reuses the worker's encoder output (its encoder cache holds both images)
        core.reset_prefix_cache()
        fourth = run(core, [request("d", ids, refs(ids, tok, pixels))])["d"]
        assert fourth == first
        assert core.stats().encoder_cache_hits == 1
    finally:
        core.shutdown()


def test_hash_only_items_resolve_from_the_core_or_are_refused(llava: Path) -> None:
    core = engine(llava)
    try:
        tok = image_token(llava)
        ids, pixels = hf_inputs(llava, "describe", [image(6)])
        with pytest.raises(MultiModalCacheMiss):
            core.add_requests([request("stale", ids, refs(ids, tok, pixels, send=False))])
        assert not core.has_unfinished_requests()
        first = run(core, [request("full", ids, refs(ids, tok, pixels))])["full"]
        by_hash = run(core, [request("hash", ids, refs(ids, tok, pixels, send=False))])["hash"]
        assert by_hash == first
        assert core.stats().mm_cache_hits == 1
    finally:
        core.shutdown()


@pytest.mark.unit
def test_fresh_pixels_replace_what_the_store_held() -> None:
    store = MediaStore(10**6)
    old = PixelData("float32", [1, 1, 1], b"\x00\x00\x00\x00")
    new = PixelData("float32", [1, 1, 1], b"\x00\x00\x80\x3f")
    params = SamplingParams()

    def req(data: PixelData | None) -> EngineRequest:
        return EngineRequest(
            request_id="r",
            prompt_token_ids=[5],
            sampling_params=params,
            mm_refs=[MultiModalRef("h", 0, 1, data)],
        )

    assert store.resolve([req(old)])[0][0].data == old
    assert store.resolve([req(new)])[0][0].data == new
    assert store.resolve([req(None)])[0][0].data == new  # the fresh payload, never the stale one
    small = MediaStore(3)  # holds nothing: a hash-only item is refused, the same submission's data counts
    with pytest.raises(MultiModalCacheMiss):
        small.resolve([req(None)])
    assert [r[0].data for r in small.resolve([req(new), req(None)])] == [new, new]


def test_bad_image_spans_are_refused(llava: Path) -> None:
    core = engine(llava)
    try:
        tok = image_token(llava)
        ids, pixels = hf_inputs(llava, "describe", [image(7)])
        good = refs(ids, tok, pixels)[0]
        cases = {
            "span outside": MultiModalRef(good.content_hash, len(ids) - 2, good.length, good.data),
            "not placeholders": MultiModalRef(good.content_hash, 0, good.length, good.data),
            "short span": MultiModalRef(good.content_hash, good.offset, good.length - 1, good.data),
            "bad bytes": MultiModalRef(
                good.content_hash, good.offset, good.length, PixelData("float32", [3, 2, 2], b"1")
            ),
        }
        for name, ref in cases.items():
            with pytest.raises(ValueError):
                core.add_requests([request(name, ids, [ref])])
        with pytest.raises(ValueError, match="no image fills"):
            core.add_requests([request("none", ids, [])])
        assert not core.has_unfinished_requests()
    finally:
        core.shutdown()


@pytest.mark.e2e
def test_sdk_sends_known_images_by_hash_and_resends_after_a_miss(llava: Path) -> None:
    """Through a real core process: the second request with an image travels as its hash; a client
    whose picture of the core's store is wrong recovers by resending; a caller's own hash-only item
    the core never saw is the retryable "mm_cache_miss" error."""
    from coreproc.client.sdk import EngineClient, EngineRequestError
    from coreproc.startup.launcher import CoreProcess

    tok = image_token(llava)
    ids, pixels = hf_inputs(llava, "describe", [image(8)])
    expected = hf_generate(llava, ids, pixels)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)

    def tokens(client: EngineClient, mm: list[MultiModalRef]) -> list[int]:
        return [t for out in client.generate(ids, params, mm_refs=mm) for t in out.new_token_ids]

    with (
        CoreProcess(EngineConfig.create(str(llava), dtype="float32")) as proc,
        EngineClient(proc.address) as client,
    ):
        assert client.info().image_token_id == tok
        assert tokens(client, refs(ids, tok, pixels)) == expected
        assert tokens(client, refs(ids, tok, pixels)) == expected
        stats = client.stats()
        assert (stats.mm_cache_hits, stats.mm_cache_misses) == (1, 0)  # the second went as a hash
        other = refs(ids, tok, hf_inputs(llava, "describe", [image(9)])[1])
        shadow = client._client.media
        assert shadow is not None
        shadow.prepare([request("x", ids, other)])  # the client now wrongly believes the core holds it
        assert tokens(client, other) == hf_generate(llava, ids, hf_inputs(llava, "describe", [image(9)])[1])
        stats = client.stats()
        assert (stats.mm_cache_hits, stats.mm_cache_misses) == (1, 1)  # refused once, resent with pixels
        unknown = [MultiModalRef("0" * 64, other[0].offset, other[0].length)]
        with pytest.raises(EngineRequestError) as refused:
            tokens(client, unknown)
        assert refused.value.code == "mm_cache_miss"
        assert tokens(client, refs(ids, tok, pixels)) == expected  # the engine is still healthy


def test_an_image_the_tower_cannot_take_fails_only_its_request(llava: Path) -> None:
    core = engine(llava)
    try:
        tok = image_token(llava)
        ids, pixels = hf_inputs(llava, "describe", [image(10)])
        good = refs(ids, tok, pixels)[0]
        small = np.zeros((3, 28, 28), dtype=np.float32)  # the tower takes 56 x 56
        bad = MultiModalRef(
            "f" * 64, good.offset, good.length, PixelData("float32", [3, 28, 28], small.tobytes())
        )
        core.add_requests([request("bad", ids, [bad]), request("good", ids, [good])])
        errors: dict[str, str] = {}
        tokens: list[int] = []
        while core.has_unfinished_requests():
            for out in core.step():
                if out.error:
                    errors[out.request_id] = out.error
                elif out.request_id == "good":
                    tokens += out.new_token_ids
        assert list(errors) == ["bad"] and "cannot be used" in errors["bad"]
        assert tokens == hf_generate(llava, ids, pixels)
        assert core.stats().num_blocks_in_use == 0
    finally:
        core.shutdown()


def test_offline_llm_takes_images_in_prompts_and_chats(llava: Path) -> None:
    """`LLM.generate` with multi_modal_data and `LLM.chat` with an image part give transformers' tokens
    (the intake runs the same processor: PNG round trips are lossless)."""
    import base64
    import io

    from coreproc import LLM

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    processor, _ = _hf(str(llava))
    pictures = [image(11), image(12, (40, 70))]
    text = "<image>\n<image>\nwhich is brighter?"
    batch = processor(text=text, images=pictures, return_tensors="np")
    expected = hf_generate(llava, batch["input_ids"][0].tolist(), batch["pixel_values"])
    buf = io.BytesIO()
    pictures[0].save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    chat_ids, chat_pixels = hf_inputs(llava, "what is in the picture?", [pictures[0]])
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "what is in the picture?"},
            ],
        }
    ]
    with LLM(str(llava), dtype="float32", show_progress=False) as llm:
        out = llm.generate({"prompt": text, "multi_modal_data": {"image": pictures}}, params, use_tqdm=False)
        assert out[0].outputs[0].token_ids == expected
        assert out[0].prompt_token_ids == batch["input_ids"][0].tolist()
        chat = llm.chat(messages, params, use_tqdm=False)
        assert chat[0].outputs[0].token_ids == hf_generate(llava, chat_ids, chat_pixels)
        with pytest.raises(ValueError, match="image tokens"):
            llm.generate(
                {"prompt": "no image token here", "multi_modal_data": {"image": pictures[0]}}, params
            )


@pytest.mark.e2e
def test_tensor_parallel_with_images_equals_transformers(llava: Path) -> None:
    """Two worker processes: the text model sharded, the tower whole on each rank."""
    ids, pixels = hf_inputs(llava, "compare them", [image(13), image(14, (30, 90))])
    core = engine(llava, tensor_parallel_size=2)
    try:
        got = run(core, [request("tp", ids, refs(ids, image_token(llava), pixels))])
        assert got["tp"] == hf_generate(llava, ids, pixels)
    finally:
        core.shutdown()
