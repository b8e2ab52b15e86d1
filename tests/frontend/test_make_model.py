"""Tests for the checkpoint tools: frontend/make_model.py, frontend/tokenizer_train.py, the bundled model.

Builds tiny checkpoints of every architecture into temporary folders, reloads them offline with
transformers, and checks determinism, sharding, the chat template, argument validation and the
bundled default model. Everything runs on CPU in well under a minute.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from frontend.make_model import ARCHS, TIED_BY_DEFAULT, build_checkpoint, main
from frontend.tokenizer_train import train_tokenizer
from tests.paths import ASSETS

pytestmark = pytest.mark.unit

DEFAULT_MODEL = ASSETS / "default_model"
REQUIRED = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
CODE = "def f(x):\n    return x\n"


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def logits(folder: Path, text: str = CODE) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = AutoTokenizer.from_pretrained(folder)(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_checkpoint(root / arch, arch, "tiny", seed=0) for arch in ARCHS}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tiny_checkpoint_loads_and_runs(tiny: dict[str, Path], arch: str) -> None:
    folder = tiny[arch]
    for name in REQUIRED:
        assert (folder / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == ARCHS[arch][1]
    assert model.config.architectures == [ARCHS[arch][1]]
    assert model.config.vocab_size == 512 and model.config.hidden_size == 64
    assert model.config.tie_word_embeddings == (arch in TIED_BY_DEFAULT)
    assert model.config.bos_token_id == tokenizer.bos_token_id
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.eos_token_id == [
        tokenizer.eos_token_id,
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ]
    names = {n for n, _ in model.named_parameters()}
    assert any(n.endswith("q_proj.bias") for n in names) == (arch in ("qwen2", "qwen2_moe", "glm4_moe"))
    q_norms = ("qwen3", "gemma3", "olmo2", "qwen3_moe", "olmoe", "glm4_moe")
    assert any("q_norm" in n for n in names) == (arch in q_norms)
    ids = tokenizer(CODE, return_tensors="pt").input_ids
    assert ids[0, 0].item() == tokenizer.bos_token_id
    assert tokenizer.decode(ids[0], skip_special_tokens=True) == CODE
    with torch.no_grad():
        out = model(ids).logits
    assert out.shape == (1, ids.shape[1], 512)
    assert torch.isfinite(out).all()


def test_hf_and_raw_tokenizers_agree(tiny: dict[str, Path]) -> None:
    from tokenizers import Tokenizer

    text = "class Café:\n\tx = 12345  # it's <|im_end|>\n\n"
    expected = Tokenizer.from_file(str(tiny["llama"] / "tokenizer.json")).encode(text).ids
    for arch, folder in tiny.items():  # transformers rebuilds qwen2 tokenizers itself: must match
        assert AutoTokenizer.from_pretrained(folder)(text).input_ids == expected, arch


def test_build_is_deterministic(tiny: dict[str, Path], tmp_path: Path) -> None:
    again = build_checkpoint(tmp_path / "again", "llama", "tiny", seed=0)
    assert digests(again) == digests(tiny["llama"])
    other = digests(build_checkpoint(tmp_path / "other", "llama", "tiny", seed=1))
    reference = digests(tiny["llama"])
    assert other["model.safetensors"] != reference["model.safetensors"]
    assert other["tokenizer.json"] == reference["tokenizer.json"]


def test_tokenizer_training_is_deterministic() -> None:
    fresh = train_tokenizer.__wrapped__(512)  # bypass the cache: a genuinely second training run
    assert fresh.to_str() == train_tokenizer(512).to_str()
    assert [fresh.id_to_token(i) for i in range(4)] == [
        "<|endoftext|>",
        "<|bos|>",
        "<|im_start|>",
        "<|im_end|>",
    ]


def test_sharded_bfloat16_build_loads(tiny: dict[str, Path], tmp_path: Path) -> None:
    folder = build_checkpoint(tmp_path / "sharded", "qwen2", "tiny", dtype="bfloat16", max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert not (folder / "model.safetensors").exists()
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.dtype == torch.bfloat16
    # Same seed, same weights: the bf16 shards hold the float32 checkpoint rounded.
    torch.testing.assert_close(logits(folder), logits(tiny["qwen2"]), atol=0.05, rtol=0.05)


def test_overrides_and_cli(tmp_path: Path) -> None:
    argv = [str(tmp_path / "cli"), "--arch", "qwen3", "--layers", "1", "--hidden", "32", "--heads", "2"]
    argv += ["--kv-heads", "1", "--head-dim", "24", "--no-tie-word-embeddings", "--sliding-window", "8"]
    assert main(argv) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "cli")
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (1, 32, 2)
    assert (config.num_key_value_heads, config.head_dim, config.tie_word_embeddings) == (1, 24, False)
    assert config.sliding_window == 8 and config.layer_types == ["sliding_attention"]
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (48, 32)
    assert main([str(tmp_path / "bad"), "--arch", "llama", "--heads", "3"]) == 2


def test_chat_template(tiny: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny["qwen3"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert no_prompt.endswith("<|im_end|>\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(arch="gpt2"), "unknown arch"),
        (dict(arch="llama", size="huge"), "unknown size"),
        (dict(arch="llama", dtype="int8"), "unknown dtype"),
        (dict(arch="llama", heads=5), "must divide hidden"),
        (dict(arch="llama", heads=4, kv_heads=3), "must divide heads"),
        (dict(arch="llama", layers=0), "must be positive"),
        (dict(arch="llama", sliding_window=16), "no sliding window"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        build_checkpoint(tmp_path / "x", **kwargs)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "x").exists()


def test_default_model() -> None:
    for name in (*REQUIRED, "README.md", "special_tokens_map.json"):
        assert (DEFAULT_MODEL / name).is_file(), name
    assert sum(p.stat().st_size for p in DEFAULT_MODEL.iterdir()) <= 12_000_000
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL).eval()
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    assert model.config.architectures == ["LlamaForCausalLM"] and model.dtype == torch.bfloat16
    assert model.config.tie_word_embeddings and model.config.vocab_size == len(tokenizer) == 8192
    ids = tokenizer(CODE).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == CODE
    # Trained, not random: ordinary Python is far more likely than uniform (ln 8192 = 9.0 nats).
    snippet = tokenizer("import os\nimport sys\n\n\ndef main(argv):\n    return 0\n", return_tensors="pt")
    with torch.no_grad():
        loss = model(**snippet, labels=snippet.input_ids).loss
    assert torch.isfinite(loss) and loss.item() < 6.0
