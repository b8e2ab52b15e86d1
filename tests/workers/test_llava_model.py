"""LLaVA in the workers (workers/models/llava.py) against transformers' LlavaForConditionalGeneration in
float32: the image features of the CLIP tower and projector (as built, and with other feature layers
and strategies), the checkpoint layouts of transformers 4 and 5, a tied head, and the logits of one
prompt with one image through Ember's paged-attention prefill.

Run with `pytest -q tests/workers/test_llava_model.py`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from frontend.make_model import main
from kernels import AttentionMetadata, select_backend
from workers.loader import ModelSpec, build_model
from workers.models.llama import LlamaForCausalLM
from workers.models.llava import LlavaForConditionalGeneration
from workers.models.qwen2 import Qwen2ForCausalLM

pytestmark = pytest.mark.model

CPU = torch.device("cpu")
BLOCK = 16


def load(folder: Path) -> Any:
    spec = ModelSpec(
        str(folder), "LlavaForConditionalGeneration", torch.float32, CPU, select_backend(CPU), 256
    )
    model, _, _ = build_model(spec, show_progress=False)
    return model


def hf_load(folder: Path) -> Any:
    from transformers import LlavaForConditionalGeneration as HFLlava

    return HFLlava.from_pretrained(folder).eval()


@torch.no_grad()
def hf_features(hf: Any, pixels: torch.Tensor) -> torch.Tensor:
    """[N, tokens, hidden]: transformers returns a BaseModelOutputWithPooling whose pooler_output is
    the projected features of each image."""
    return torch.stack(list(hf.model.get_image_features(pixel_values=pixels).pooler_output))


def pixels(seed: int, n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, 56, 56, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def llava_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"llava-{request.param}")
    assert main([str(out), "--arch", "llava", "--text-arch", request.param]) == 0
    return out


@pytest.fixture(scope="module")
def hf_llava(llava_dir: Path) -> Any:
    return hf_load(llava_dir)


@pytest.fixture(scope="module")
def ember_llava(llava_dir: Path) -> Any:
    return load(llava_dir)


def test_model_is_the_text_class(llava_dir: Path, ember_llava: Any) -> None:
    text = json.loads((llava_dir / "config.json").read_text())["text_config"]
    text_cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[text["model_type"]]
    assert isinstance(ember_llava, text_cls) and isinstance(ember_llava, LlavaForConditionalGeneration)
    assert type(ember_llava).__name__ == f"Llava{text_cls.__name__.removesuffix('ForCausalLM')}"
    assert ember_llava.config.hidden_size == text["hidden_size"]  # the text config
    names = dict(ember_llava.named_parameters())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert "vision_tower.encoder.layers.1.self_attn.qkv_proj.weight" in names
    assert "multi_modal_projector.linear_2.bias" in names
    assert ember_llava.image_token_id == 511
    assert ember_llava.num_image_tokens(56, 56) == 16


def test_image_features_match_hf(hf_llava: Any, ember_llava: Any) -> None:
    x = pixels(0)
    with torch.no_grad():
        ours = ember_llava.embed_images(x)
        assert ours.shape == (2, 16, ember_llava.config.hidden_size) and ours.dtype == torch.float32
        torch.testing.assert_close(ours, hf_features(hf_llava, x), atol=1e-5, rtol=0)
        torch.testing.assert_close(ember_llava.embed_images(x.double()), ours, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("layer", "strategy"), [(-1, "full"), ([-2, 0], "default")])
def test_other_feature_layers_match_hf(
    llava_dir: Path, tmp_path: Path, layer: int | list[int], strategy: str
) -> None:
    """The last layer with the class token kept, and a concatenation of two layers (the second being
    the embeddings themselves), whose projector takes twice the tower's width."""
    from transformers import AutoConfig
    from transformers import LlavaForConditionalGeneration as HFLlava

    cfg = AutoConfig.from_pretrained(llava_dir)
    cfg.vision_feature_layer, cfg.vision_feature_select_strategy = layer, strategy
    torch.manual_seed(0)  # a list of layers gets a new, wider linear_1
    hf = HFLlava.from_pretrained(llava_dir, config=cfg, ignore_mismatched_sizes=True).eval()
    hf.save_pretrained(tmp_path)
    ours = load(tmp_path)
    tokens = 17 if strategy == "full" else 16
    assert ours.num_image_tokens(56, 56) == tokens
    x = pixels(1)
    with torch.no_grad():
        got = ours.embed_images(x)
    assert got.shape == (2, tokens, ours.config.hidden_size)
    torch.testing.assert_close(got, hf_features(hf, x), atol=1e-5, rtol=0)


def v4_name(name: str) -> str:
    """As llava-hf's published checkpoints (transformers 4) name a tensor."""
    if name.startswith("vision_tower."):
        return name.replace("vision_tower.", "vision_tower.vision_model.", 1)
    return name


def v5_name(name: str) -> str:
    """As a transformers 5 model names a tensor in memory (`model.language_model.X`, `lm_head`)."""
    if name.startswith("language_model.model."):
        return name.replace("language_model.model.", "model.language_model.", 1)
    if name.startswith("language_model.lm_head."):
        return name.replace("language_model.", "", 1)
    return "model." + name


def v4_late_name(name: str) -> str:
    """As transformers 4.52+ saved it: the v5 prefixes over a CLIP tower with `vision_model`."""
    return v5_name(v4_name(name))


@pytest.mark.parametrize("rename", [v4_name, v5_name, v4_late_name])
def test_checkpoint_layouts_load_the_same_weights(
    llava_dir: Path, tmp_path: Path, ember_llava: Any, rename: Callable[[str], str]
) -> None:
    tensors = load_file(str(llava_dir / "model.safetensors"))
    renamed = {rename(name): t for name, t in tensors.items()}
    renamed[rename("vision_tower.embeddings.position_ids")] = torch.arange(17)[None]  # a stale buffer
    assert len(renamed) == len(tensors) + 1
    shutil.copy(llava_dir / "config.json", tmp_path / "config.json")
    save_file(renamed, str(tmp_path / "model.safetensors"))
    model = load(tmp_path)
    expected = dict(ember_llava.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, expected[name]), name
    x = pixels(2)
    with torch.no_grad():
        torch.testing.assert_close(model.embed_images(x), ember_llava.embed_images(x), atol=0, rtol=0)


def test_tied_head_follows_the_llava_config(llava_dir: Path, tmp_path: Path) -> None:
    """LlavaConfig's own tie_word_embeddings ties the head (the text config's is false), and the file's
    `language_model.lm_head.weight` is skipped once renamed to `lm_head.weight`, as for Ember's text
    models (transformers 5 instead unties a head whose stored values differ from the embedding's)."""
    config = json.loads((llava_dir / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(llava_dir / "model.safetensors", tmp_path / "model.safetensors")
    model = load(tmp_path)
    assert model.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(model.lm_head.weight, stored["language_model.model.embed_tokens.weight"])
    assert not torch.equal(model.lm_head.weight, stored["language_model.lm_head.weight"])


@torch.no_grad()
def ember_prefill_logits(model: Any, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[T, vocab] logits of one prompt whose image placeholders take the features of image `x`."""
    embeds = model.embed_input_ids(ids)
    placeholders = ids == model.image_token_id
    embeds[placeholders] = model.embed_images(x).reshape(-1, embeds.shape[-1])
    n = ids.shape[0]
    blocks = -(-n // BLOCK)
    meta = AttentionMetadata.build([n], [n], [list(range(blocks))], BLOCK, CPU)
    attn = model.model.layers[0].self_attn
    shape = (2, blocks, BLOCK, attn.num_kv_heads, attn.head_dim)
    caches = [torch.zeros(shape) for _ in model.model.layers]
    hidden = model(ids, torch.arange(n), caches, meta, inputs_embeds=embeds)
    return model.compute_logits(hidden)


def test_prompt_logits_match_hf(hf_llava: Any, ember_llava: Any) -> None:
    rng = torch.Generator().manual_seed(3)
    before, after = torch.randint(2, 500, (5,), generator=rng), torch.randint(2, 500, (7,), generator=rng)
    ids = torch.cat([torch.tensor([1]), before, torch.full((16,), 511), after])
    logits = []
    for seed in (4, 5):
        x = pixels(seed, n=1)
        ours = ember_prefill_logits(ember_llava, ids, x)
        with torch.no_grad():
            ref = hf_llava(input_ids=ids[None], pixel_values=x).logits[0]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
        logits.append(ours)
    assert not torch.allclose(logits[0], logits[1])  # the image reaches the text model
