"""coreproc/base/gguf_tokenizer.py against transformers' tokenizer from the same GGUF file.

The reference is `AutoTokenizer.from_pretrained(folder, gguf_file=name)`. Fast tests write small
metadata-only GGUF files in a temp folder (the bundled tiny model's byte-level BPE, and a sentencepiece
vocabulary trained on the spot) and check the errors. The `real` tests read SmolLM2-135M-Instruct and
Qwen2.5-Coder-0.5B-Instruct GGUF files (fetched by tools/real_models.py on first use, then cached; each
file's metadata read once per session) and compare encode and decode on random text and ids
(hypothesis), special tokens, sizes and chat prompts.
Run: `pytest -q tests/coreproc/base/test_gguf_tokenizer.py` (the real ones alone: `-m real`).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coreproc.base.gguf_tokenizer import gguf_eos_token_ids
from coreproc.base.tokenizer import Tokenizer, tokenizer_from_gguf
from tests.paths import REPO

ROOT = REPO
TINY_TOKENIZER = ROOT / "coreproc" / "assets" / "default_model" / "tokenizer.json"
TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "def add(a, b):\n\treturn a + b  # 12345\n\n\n",
    "<|im_start|>user\nCafé, déjà vu? 日本語 🙂 Привет<|im_end|>",
    "x  1\t\t2   3 ² ½",
]
CHAT = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "What is a prime number?"},
    {"role": "assistant", "content": "A number with exactly two divisors: 2, 3, 5, 7, ..."},
    {"role": "user", "content": "Name one, and say it in français, s'il vous plaît. 数字?"},
]


def read_metadata(path: Path) -> dict[str, Any]:
    """As `gguf.GGUFReader(path)`'s fields' `contents()` give it (tests/workers/test_gguf.py checks),
    faster (arrays of strings as lists, ready to be written again)."""
    from coreproc.base.gguf_file import GGUFFile, StringArray

    return {k: list(v) if isinstance(v, StringArray) else v for k, v in GGUFFile(path).metadata.items()}


def write_gguf(path: Path, metadata: dict[str, Any]) -> Path:
    """A GGUF file holding only `metadata` (no tensors)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), metadata["general.architecture"])
    for key, value in metadata.items():
        if key == "general.architecture" or key.startswith("GGUF."):  # the writer writes these itself
            continue
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_metadata(vocab_size: int, arch: str = "llama") -> dict[str, Any]:
    """The model keys transformers needs to build a config for a GGUF of `arch`."""
    keys = {"context_length": 2048, "embedding_length": 64, "block_count": 1, "feed_forward_length": 128}
    keys |= {"attention.head_count": 4, "attention.head_count_kv": 2, "vocab_size": vocab_size}
    keys |= {"attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 10000.0}
    keys |= {"attention.key_length": 16, "attention.value_length": 16, "attention.sliding_window": 512}
    return {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in keys.items()}}


def tiny_byte_level_metadata() -> dict[str, Any]:
    """The bundled tiny model's tokenizer as llama.cpp would write it (its split is Qwen2's)."""
    spec = json.loads(TINY_TOKENIZER.read_text(encoding="utf-8"))
    vocab, added = spec["model"]["vocab"], spec["added_tokens"]
    tokens = [""] * (max([*vocab.values(), *(t["id"] for t in added)]) + 1)
    types = [1] * len(tokens)
    for token, index in vocab.items():
        tokens[index] = token
    for token in added:
        tokens[token["id"]], types[token["id"]] = token["content"], 3
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    template = (
        "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    )
    template += "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    return llama_metadata(len(tokens)) | {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": template,
    }


def sentencepiece_metadata() -> dict[str, Any]:
    """A sentencepiece-style vocabulary (byte tokens, scores, no merges) trained on Ember's own sources."""
    from tokenizers import SentencePieceBPETokenizer

    texts = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "coreproc").glob("*.py"))]
    texts.append("Café déjà vu. Привет, мир! 日本語のテキスト。🙂 " * 10)
    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator(texts, vocab_size=1500, min_frequency=2, show_progress=False)
    pieces = json.loads(trainer.to_str())["model"]["vocab"]
    pieces = [p for p in sorted(pieces, key=pieces.__getitem__) if p != "<unk>"]
    tokens = [
        "<unk>",
        "<s>",
        "</s>",
        *(f"<0x{b:02X}>" for b in range(256)),
        *pieces,
        "<|im_start|>",
        "<think>",
    ]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces), 3, 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0, 0.0]
    return llama_metadata(len(tokens)) | {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def gemma_metadata(arch: str) -> dict[str, Any]:
    """A Gemma-style sentencepiece file: Gemma's special tokens first, turn markers, byte tokens, tokens
    of spaces spelled with real spaces (as Gemma's files spell them), trained pieces in merge order, no
    merges, scores that do not follow that order; BOS added, Gemma's chat template."""
    spm = sentencepiece_metadata()
    pieces = spm["tokenizer.ggml.tokens"][259:-2]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    tokens += [f"<0x{b:02X}>" for b in range(256)] + ["\n", "\n\n", "\t", "  ", "   ", "    "] + pieces
    types = [3, 3, 3, 2, 3, 3, 3, *[6] * 256, *[1] * (6 + len(pieces))]
    scores = [0.0] * 263 + [float(i % 7) for i in range(6 + len(pieces))]
    return llama_metadata(len(tokens), arch) | {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": GEMMA_TEMPLATE,
    }


@dataclasses.dataclass(frozen=True)
class Pair:
    """Ember's tokenizer and transformers' from one GGUF file, and the file's metadata."""

    ember: Tokenizer
    hf: Any
    metadata: dict[str, Any]


def load_pair(path: Path) -> Pair:
    from transformers import AutoTokenizer

    metadata = read_metadata(path)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return Pair(tokenizer_from_gguf(metadata, path.name), hf, metadata)


def assert_same(pair: Pair, texts: list[str]) -> None:
    """Same pipeline, vocabulary, added tokens, special tokens, encodings and decodings."""
    ember, hf = pair.ember, pair.hf
    assert json.loads(ember.backend_tokenizer.to_str()) == json.loads(hf.backend_tokenizer.to_str())
    assert {k: str(v) for k, v in hf.special_tokens_map.items()} == ember.special_tokens_map
    assert set(ember.all_special_tokens) == set(hf.all_special_tokens)
    assert (ember.bos_token_id, ember.eos_token_id, ember.pad_token_id) == (
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
    )
    assert (ember.vocab_size, len(ember)) == (hf.vocab_size, len(hf))
    for text in texts:
        for special in (True, False):
            ids = ember.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ember.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def chat_ids(tokenizer: Any) -> list[int]:
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ----------------------------------------------------------------------------- small written files


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return load_pair(write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_byte_level_metadata()))


@pytest.mark.unit
def test_byte_level_file_matches_transformers(tiny: Pair) -> None:
    assert_same(tiny, [*TEXTS, "<|bos|><|endoftext|> <|im_end|>"])
    assert tiny.ember.encode("hi")[0] == tiny.hf.bos_token_id == 1  # the file asks for BOS
    assert chat_ids(tiny.ember) == chat_ids(tiny.hf)


@pytest.mark.unit
def test_eos_ids_are_transformers_generation_eos(tiny: Pair, tmp_path: Path) -> None:
    from transformers import AutoConfig, GenerationConfig

    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny.metadata | {"tokenizer.ggml.eos_token_id": 3})
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert gguf_eos_token_ids(read_metadata(path)) == [
        GenerationConfig.from_model_config(config).eos_token_id
    ]
    ids = {
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.eot_token_id": 7,
        "tokenizer.ggml.eom_token_id": 2,
    }
    assert gguf_eos_token_ids(ids) == [2, 7]
    assert gguf_eos_token_ids({"tokenizer.ggml.eom_token_id": 5, "tokenizer.ggml.eot_token_id": 4}) == [4, 5]
    assert gguf_eos_token_ids({}) == []


@pytest.mark.unit
def test_sentencepiece_file_matches_transformers(tmp_path: Path) -> None:
    pair = load_pair(write_gguf(tmp_path / "spm.gguf", sentencepiece_metadata()))
    texts = [*TEXTS, "  two  spaces\n", "\x00\x01 bytes ǅ ÿ", "<s>in</s> <|im_start|>x <think>y <unk>"]
    assert_same(pair, texts)
    assert pair.ember.encode("hi")[0] == 1  # sentencepiece files get BOS unless they say otherwise


@pytest.mark.unit
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_file_matches_transformers(arch: str, tmp_path: Path) -> None:
    """Gemma's vocabulary as transformers rebuilds it (GemmaTokenizer): no prefix space, runs of spaces
    as their own tokens, merges in the file's order; its chat template."""
    pair = load_pair(write_gguf(tmp_path / "gemma.gguf", gemma_metadata(arch)))
    texts = [*TEXTS, "  two  spaces\n    four", "\x00\x01 bytes ǅ ÿ", "<bos>in<eos> <start_of_turn>x"]
    assert_same(pair, texts)
    assert pair.ember.encode("hi")[0] == 2
    assert chat_ids(pair.ember) == chat_ids(pair.hf)


@pytest.mark.unit
def test_phi3_file_matches_transformers(tmp_path: Path) -> None:
    """Phi-3's sentencepiece file: the prefix space from a normalizer (it shows on leading spaces)."""
    metadata = sentencepiece_metadata() | {
        k.replace("llama.", "phi3."): v for k, v in llama_metadata(0).items() if k.startswith("llama.")
    }
    metadata = {k: v for k, v in metadata.items() if not k.startswith("llama.")}
    metadata |= {"general.architecture": "phi3", "phi3.vocab_size": len(metadata["tokenizer.ggml.tokens"])}
    pair = load_pair(write_gguf(tmp_path / "phi3.gguf", metadata))
    assert_same(pair, [*TEXTS, "  two  spaces\n", "<s>in</s> <|im_start|>x"])


@pytest.mark.unit
def test_named_chat_templates_sit_beside_the_default() -> None:
    metadata = tiny_byte_level_metadata()
    metadata["tokenizer.chat_template.tool_use"] = "tools: {{ messages[0]['content'] }}"
    tokenizer = tokenizer_from_gguf(metadata)
    assert isinstance(tokenizer.chat_template, dict)
    assert sorted(tokenizer.chat_template) == ["default", "tool_use"]
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, chat_template="tool_use", tokenize=False) == "tools: hi"
    assert tokenizer.apply_chat_template(chat, tokenize=False) == "<|bos|><|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.unit
def test_unbuildable_metadata_raises_one_line_naming_the_file() -> None:
    good = tiny_byte_level_metadata()
    no_merges = {k: v for k, v in good.items() if k != "tokenizer.ggml.merges"}
    cases = {
        "tokenizer.ggml.model 't5' is not supported": good | {"tokenizer.ggml.model": "t5"},
        "tokenizer.ggml.model None is not supported": {
            k: v for k, v in good.items() if "ggml.model" not in k
        },
        "no tokenizer.ggml.tokens": {k: v for k, v in good.items() if k != "tokenizer.ggml.tokens"},
        "has no tokenizer.ggml.tokens": good | {"tokenizer.ggml.tokens": []},
        "tokenizer.ggml.bos_token_id 99999 is not a token id": good | {"tokenizer.ggml.bos_token_id": 99999},
        "no tokenizer.ggml.merges": no_merges,
    }
    for reason, metadata in cases.items():
        with pytest.raises(ValueError, match="cannot build a tokenizer from model.gguf") as info:
            tokenizer_from_gguf(metadata, "model.gguf")
        assert reason in str(info.value) and "\n" not in str(info.value), reason


@pytest.mark.unit
def test_gguf_tokenizer_never_imports_transformers(tmp_path: Path) -> None:
    metadata = tmp_path / "metadata.json"
    metadata.write_text(json.dumps(tiny_byte_level_metadata()), encoding="utf-8")
    script = (
        "import json, sys\n"
        "from coreproc.base.gguf_tokenizer import gguf_eos_token_ids\n"
        "from coreproc.base.tokenizer import tokenizer_from_gguf\n"
        f"metadata = json.loads(open({str(metadata)!r}, encoding='utf-8').read())\n"
        "tok = tokenizer_from_gguf(metadata)\n"
        "tok.decode(tok.encode('def f(x):'))\n"
        "gguf_eos_token_ids(metadata)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'gguf'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ----------------------------------------------------------------------------- real GGUF files


@pytest.fixture(scope="session", params=["smollm2", "qwen-0.5b"])
def real(request: pytest.FixtureRequest) -> Pair:
    from tools.real_models import DEFAULT_CACHE, MODELS, fetch

    return load_pair(fetch(MODELS[request.param], DEFAULT_CACHE))


def added_tokens(tokenizer: Tokenizer) -> list[str]:
    return [t.content for t in tokenizer.backend_tokenizer.get_added_tokens_decoder().values()]


PIECES = [
    "def main():\n    print('hi')\n",
    "if (a && b) { return x->y[0]; }",
    '<div class="x">&amp;</div>',
    "SELECT * FROM t WHERE id = 42;",
    "The quick brown fox",
    "don't I'll we've",
    "日本語",
    "中文字符",
    "🙂👍🏽🇫🇷",
    "café naïve Ærø",
    "Привет мир",
    "² ½ ① ٣",
    "<|im_",
    "|>",
]


def texts(specials: list[str]) -> st.SearchStrategy[str]:
    """Text mixing code, prose, whitespace runs, digits, non-ASCII, and the file's special tokens."""
    piece = st.one_of(
        st.sampled_from(PIECES),
        st.sampled_from(specials),
        st.text(alphabet=" \t\n\r", min_size=1, max_size=8),
        st.text(alphabet="0123456789", min_size=1, max_size=7),
        st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8),
        st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=12),
    )
    return st.lists(piece, max_size=12).map("".join)


@pytest.mark.real
def test_real_file_pipeline_and_special_tokens_match_transformers(real: Pair) -> None:
    assert_same(real, TEXTS)
    assert gguf_eos_token_ids(real.metadata)[0] == real.hf.eos_token_id


@pytest.mark.real
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_real_file_encodes_random_text_like_transformers(real: Pair, data: st.DataObject) -> None:
    text = data.draw(texts(added_tokens(real.ember)))
    for special in (True, False):
        assert real.ember.encode(text, add_special_tokens=special) == real.hf.encode(
            text, add_special_tokens=special
        )


@pytest.mark.real
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_real_file_decodes_random_ids_like_transformers(real: Pair, data: st.DataObject) -> None:
    special_ids = [real.ember.backend_tokenizer.token_to_id(t) for t in added_tokens(real.ember)]
    token_id = st.one_of(st.integers(0, len(real.hf) - 1), st.sampled_from(special_ids))
    ids = data.draw(st.lists(token_id, max_size=24))
    for skip in (True, False):
        assert real.ember.decode(ids, skip_special_tokens=skip) == real.hf.decode(
            ids, skip_special_tokens=skip
        )


@pytest.mark.real
def test_real_file_chat_prompt_matches_transformers(real: Pair) -> None:
    assert chat_ids(real.ember) == chat_ids(real.hf)
    text = real.ember.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text == real.hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
