"""GGUF checkpoints on tiny random models: header, config, weights, generation, errors, fingerprint.

Tiny Hugging Face folders are written as GGUF files by `tools.hf_to_gguf` (the `gguf` package's
writer and reference quantizer). Ember's header parser must read what the `gguf` package's reader
reads; the loaded weights must be the reference dequantization of the file's tensors (with the
llama q/k permutation undone); greedy tokens from the GGUF file must equal transformers' on the
original folder (float32 files). The real GGUF files are in tests/e2e/test_real_models.py.
Run: `pytest -q tests/workers/test_gguf.py`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from coreproc import LLM, SamplingParams
from coreproc.base.config import EngineConfig
from coreproc.base.errors import ConfigError
from coreproc.base.gguf_file import SUPPORTED_TYPES, GGUFFile, StringArray, find_gguf, open_gguf
from coreproc.base.model_config import ModelConfig
from tests.hf_ref import check_logprobs_close, check_outputs_equal, hf_greedy
from tools.hf_to_gguf import write_gguf
from workers.gguf.dequant import SUPPORTED
from workers.gguf.weights import hf_name, iter_gguf, unpermute_rotary
from workers.weight_cache.fingerprint import checkpoint_hash, config_hash

pytestmark = pytest.mark.model

PROMPTS = [[1, 5, 9, 200, 31], [1, 77], [1, 300, 301, 302, 303, 304, 305, 306, 42]]
MAX_NEW = 16


@pytest.fixture(scope="module")
def gguf_of(make_ckpt, tmp_path_factory):
    """(architecture, GGUF type) -> (HF folder, GGUF file), written once."""
    root, made = tmp_path_factory.mktemp("gguf"), {}

    def make(arch: str, qtype: str = "F32") -> tuple[Path, Path]:
        if (arch, qtype) not in made:
            folder = make_ckpt(arch)
            made[arch, qtype] = folder, write_gguf(folder, root / f"{arch}-{qtype}.gguf", qtype)
        return made[arch, qtype]

    return make


def test_supported_types_agree_with_the_dequantizer():
    assert {GGMLQuantizationType[name] for name in SUPPORTED_TYPES} == set(SUPPORTED)


def test_header_reads_as_the_gguf_package_reads_it(gguf_of):
    _, path = gguf_of("qwen2", "Q8_0")
    ours, ref = GGUFFile(path), GGUFReader(path)
    expected = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == expected

    def kind(value: object) -> type:  # arrays of strings are decoded when first read
        return list if isinstance(value, StringArray) else type(value)

    assert {k: kind(v) for k, v in ours.metadata.items()} == {k: type(v) for k, v in expected.items()}
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert (info.qtype, info.offset, info.nbytes) == (t.tensor_type, t.data_offset, t.n_bytes)
        assert info.shape == tuple(int(d) for d in reversed(t.shape))


def test_one_parse_is_shared_while_the_file_stays_the_same(gguf_of, tmp_path):
    _, llama = gguf_of("llama")
    _, qwen = gguf_of("qwen2")
    path = tmp_path / "model.gguf"
    shutil.copy(llama, path)
    first = open_gguf(path)
    assert open_gguf(str(path)) is first and first.architecture == "llama"
    config = first.hf_config
    config["num_hidden_layers"] = -1  # a caller's edits stay its own
    assert first.hf_config["num_hidden_layers"] > 0
    tokens = "tokenizer.ggml.tokens"
    assert list(first.metadata[tokens]) == list(GGUFFile(llama).metadata[tokens])
    shutil.copy(qwen, path)  # replaced in place: parsed again
    assert open_gguf(path).architecture == "qwen2"
    with pytest.raises(ConfigError, match="cannot read GGUF file"):
        open_gguf(tmp_path / "missing.gguf")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_implied_config_matches_the_folder(gguf_of, arch):
    import json

    folder, path = gguf_of(arch)
    ours, hf = ModelConfig.from_dir(path, dtype="float32"), ModelConfig.from_dir(folder, dtype="float32")
    assert ours.model == str(path) and ours.tokenizer == str(path)
    same = (
        "architecture",
        "vocab_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "hidden_size",
    )
    assert {k: getattr(ours, k) for k in same} == {k: getattr(hf, k) for k in same}
    assert ours.max_model_len == hf.max_model_len
    cfg, raw = GGUFFile(path).hf_config, json.loads((folder / "config.json").read_text())
    for key in ("intermediate_size", "tie_word_embeddings"):
        assert cfg[key] == raw.get(key, False), key
    assert cfg["rms_norm_eps"] == pytest.approx(raw["rms_norm_eps"], rel=1e-6)


@pytest.mark.parametrize(
    ("arch", "qtype"), [("llama", "F32"), ("llama", "Q4_1"), ("qwen2", "Q5_0"), ("qwen3", "F16")]
)
def test_weights_are_the_reference_dequantization(gguf_of, arch, qtype):
    """Every tensor as Ember loads it: the reference dequantization, renamed, q/k rows in HF order."""
    from safetensors.torch import load_file

    folder, path = gguf_of(arch, qtype)
    original = load_file(str(folder / "model.safetensors"))
    reader = {t.name: t for t in GGUFReader(path).tensors}
    loaded = {name: tensor for _, name, tensor in iter_gguf(GGUFFile(path))}
    assert set(loaded) == set(original) - ({"lm_head.weight"} if "output.weight" not in reader else set())
    meta = GGUFFile(path).metadata
    heads = {
        "attn_q": meta[f"{arch}.attention.head_count"],
        "attn_k": meta[f"{arch}.attention.head_count_kv"],
    }
    for gguf_name, t in reader.items():
        name = hf_name(gguf_name)
        ref = torch.from_numpy(quants.dequantize(t.data, t.tensor_type).copy()).reshape(loaded[name].shape)
        kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        if arch == "llama" and kind in heads:
            ref = unpermute_rotary(ref, heads[kind])
        assert torch.equal(loaded[name], ref), gguf_name
    tolerance = {"F32": 0.0, "F16": 1e-3}.get(qtype, 0.15)
    for name, weight in original.items():
        if name in loaded:
            assert (loaded[name] - weight.float()).abs().max() <= tolerance * weight.abs().max() + 1e-6, name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_float32_gguf_generates_what_transformers_generates_from_the_folder(gguf_of, arch):
    folder, path = gguf_of(arch)
    llm = LLM(str(path), dtype="float32", show_progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    ref = [hf_greedy(str(folder), p, MAX_NEW) for p in PROMPTS]
    check_outputs_equal([o.outputs[0].token_ids for o in outs], [r[0] for r in ref])
    ours_lp = [[next(iter(pos.values())).logprob for pos in o.outputs[0].logprobs] for o in outs]
    check_logprobs_close(ours_lp, [r[1] for r in ref])


def test_quantized_gguf_composes_with_online_quantization(gguf_of):
    folder, path = gguf_of("llama", "Q8_0")
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    for quantization in (None, "int8"):
        llm = LLM(str(path), dtype="float32", quantization=quantization, show_progress=False)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
        del llm


def test_a_folder_holding_one_gguf_is_that_file(gguf_of, tmp_path):
    _, path = gguf_of("llama")
    shutil.copy(path, tmp_path / "model.gguf")
    assert find_gguf(tmp_path) == tmp_path / "model.gguf"
    assert ModelConfig.from_dir(tmp_path).model == str(tmp_path / "model.gguf")
    shutil.copy(path, tmp_path / "other.gguf")
    with pytest.raises(ConfigError, match="several GGUF files"):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.from_dir(tmp_path / "missing.gguf")


def _write(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]]) -> Path:
    writer = GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 64)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_uint32(f"{arch}.attention.head_count", 2)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    for name, (data, raw) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture_and_tensor_type_are_named(tmp_path):
    plain = {"token_embd.weight": (np.zeros((3, 32), np.float32), None)}
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'gpt2'"):
        ModelConfig.from_dir(_write(tmp_path / "a.gguf", "gpt2", plain))
    q2k = {"token_embd.weight": (np.zeros((3, 84), np.uint8), GGMLQuantizationType.Q2_K)}
    with pytest.raises(ConfigError, match="token_embd.weight has GGUF type Q2_K"):
        ModelConfig.from_dir(_write(tmp_path / "b.gguf", "llama", q2k))
    (tmp_path / "c.gguf").write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ConfigError, match="not a GGUF file"):
        ModelConfig.from_dir(tmp_path / "c.gguf")
    good = (tmp_path / "a.gguf").read_bytes()
    (tmp_path / "d.gguf").write_bytes(good[: len(good) // 2])
    with pytest.raises(ConfigError, match="corrupt|past the end"):
        GGUFFile(tmp_path / "d.gguf")


@pytest.mark.e2e
def test_cli_names_the_problem_in_one_line(tmp_path):
    path = _write(tmp_path / "m.gguf", "falcon", {"token_embd.weight": (np.zeros((3, 32), np.float32), None)})
    proc = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "generate", "--model", str(path), "hello"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unsupported GGUF architecture 'falcon'" in lines[0], proc.stderr


def test_fingerprint_covers_gguf_files(gguf_of, tmp_path):
    _, path = gguf_of("llama")
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    assert checkpoint_hash(str(copy)) == checkpoint_hash(str(path))
    assert config_hash(str(copy)) == config_hash(str(path))
    data = bytearray(copy.read_bytes())
    start = GGUFFile(copy).data_start
    data[start : start + 4096] = bytes(4096)  # other weights, same header
    copy.write_bytes(bytes(data))
    assert checkpoint_hash(str(copy)) != checkpoint_hash(str(path))
    _, other = gguf_of("llama", "Q8_0")
    assert checkpoint_hash(str(other)) != checkpoint_hash(str(path))
    config = EngineConfig.create(str(path), dtype="float32")
    assert config.model.model == str(path)
