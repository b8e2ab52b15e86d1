"""Tests for `ember make-model --arch llava` (frontend/make_llava.py): the folder loads offline in
transformers' `AutoProcessor` and `LlavaForConditionalGeneration` as a published LLaVA folder would, its
processor expands `<image>` into one placeholder per patch, its pixels change what the model computes,
and the build is deterministic.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from frontend.make_model import main

pytestmark = pytest.mark.unit


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def llava(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"llava-{request.param}")
    assert main([str(out), "--arch", "llava", "--text-arch", request.param]) == 0
    return out


def test_llava_folder_runs_in_transformers(llava: Path) -> None:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(llava)
    model = LlavaForConditionalGeneration.from_pretrained(llava).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert "<image>\nwhat is it?" in prompt
    logits = []
    for seed, size in ((0, (70, 90)), (1, (120, 40))):  # other sizes: resized and cropped to 56 x 56
        inputs = processor(images=_image(seed, size), text=prompt, return_tensors="pt")
        assert inputs["pixel_values"].shape == (1, 3, 56, 56)
        assert int((inputs["input_ids"] == model.config.image_token_index).sum()) == 16  # (56 / 14)^2
        with torch.no_grad():
            logits.append(model(**inputs).logits[0, -1])
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        assert out.shape[1] == inputs["input_ids"].shape[1] + 4
    assert not torch.allclose(logits[0], logits[1])  # the pixels reach the text model


def test_llava_build_is_deterministic(llava: Path, tmp_path: Path) -> None:
    import json

    text_arch = json.loads((llava / "config.json").read_text())["text_config"]["model_type"]
    assert main([str(tmp_path), "--arch", "llava", "--text-arch", text_arch]) == 0
    digest = lambda p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert digest(tmp_path) == digest(llava)


def test_llava_refuses_the_size_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path), "--arch", "llava", "--layers", "3", "--size", "small"]) == 2
    assert "--arch llava builds the tiny preset; --layers, --size do not apply" in capsys.readouterr().out
