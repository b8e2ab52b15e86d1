"""Loading errors are one clear line naming what is wrong; dtypes and tied weights load as declared.

Each case copies a tiny checkpoint and breaks one thing (architecture, files, a tensor's name or
shape, a shard). Run: `pytest -q tests/workers/test_loading.py`.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from coreproc import LLM, SamplingParams
from coreproc.base.config import ConfigError
from workers.loader import WeightLoadError

pytestmark = pytest.mark.model


@pytest.fixture
def broken(make_ckpt, tmp_path):
    """A fresh copy of the tiny llama checkpoint to damage."""
    dst = tmp_path / "ckpt"
    shutil.copytree(make_ckpt("llama"), dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_unknown_architecture(broken):
    edit_config(broken, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="unsupported architecture.*LlamaForCausalLM"):
        LLM(str(broken), show_progress=False)


def test_missing_files(broken, tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        LLM(str(tmp_path / "nope"), show_progress=False)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        LLM(str(broken), show_progress=False)
    (broken / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        LLM(str(broken), show_progress=False)


def test_pre_quantized_checkpoint_is_refused(broken):
    edit_config(broken, quantization_config={"quant_method": "awq"})
    with pytest.raises(ConfigError, match="pre-quantized.*awq"):
        LLM(str(broken), show_progress=False)


def test_unexpected_tensor_name(broken):
    edit_tensors(
        broken,
        lambda t: t.__setitem__(
            "model.layers.0.mlp.gate_projj.weight", t.pop("model.layers.0.mlp.gate_proj.weight")
        ),
    )
    with pytest.raises(
        WeightLoadError, match="unexpected tensor model.layers.0.mlp.gate_projj.weight .* model.safetensors"
    ):
        LLM(str(broken), show_progress=False)


def test_missing_tensor(broken):
    edit_tensors(broken, lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"))
    with pytest.raises(
        WeightLoadError, match="missing weights for parameter model.layers.1.self_attn.qkv_proj"
    ):
        LLM(str(broken), show_progress=False)


def test_wrong_shape(broken):
    def shrink(t):
        t["model.norm.weight"] = t["model.norm.weight"][:-1].clone()

    edit_tensors(broken, shrink)
    with pytest.raises(
        WeightLoadError, match=r"model.norm.weight in model.safetensors: shape \(63,\) .* \(64,\)"
    ):
        LLM(str(broken), show_progress=False)


def test_missing_shard(make_ckpt, tmp_path):
    dst = tmp_path / "sharded"
    shutil.copytree(make_ckpt("llama", seed=3, max_shard_size="200KB"), dst)
    victim = sorted(dst.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(WeightLoadError, match=f"shard {victim.name} .* missing"):
        LLM(str(dst), show_progress=False)


def test_kv_cache_too_small_for_max_model_len(make_ckpt):
    with pytest.raises(ConfigError, match="fewer than the .* one sequence"):
        LLM(str(make_ckpt("llama")), num_kv_blocks=3, max_model_len=128, show_progress=False)


def resident_fraction(t) -> float:
    """Share of a CPU tensor's pages that are resident (mincore)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    pages = (t.data_ptr() + t.numel() * t.element_size() - start + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) == 0
    return sum(v & 1 for v in vec) / pages


def test_kv_cache_prefault_commits_the_cache_at_start(make_ckpt):
    """By default the KV cache's pages become resident only once used; `kv_cache_prefault` commits
    every page at start (and the engine generates the same)."""
    path, budget = str(make_ckpt("llama")), 64 * 2**20
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for prefault in (False, True):
        with LLM(
            path, dtype="float32", kv_cache_memory=budget, kv_cache_prefault=prefault, show_progress=False
        ) as llm:
            caches = llm.engine.executor.worker.runner.kv_caches
            assert sum(t.numel() * t.element_size() for t in caches) > budget // 2
            share = sum(resident_fraction(t) for t in caches) / len(caches)
            assert share > 0.99 if prefault else share < 0.5, (prefault, share)
            tokens.append(llm.generate(["def f(x):"], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert tokens[0] == tokens[1]


def test_bf16_checkpoint_dtype_auto_and_explicit(make_ckpt):
    from coreproc.base.host import cpu_has_fast_half

    path = make_ckpt("qwen2", dtype="bfloat16")
    auto = LLM(str(path), show_progress=False)
    # auto keeps the checkpoint's dtype unless this CPU would only emulate it
    assert auto.config.model.dtype == ("bfloat16" if cpu_has_fast_half() else "float32")
    llm = LLM(str(path), dtype="bfloat16", show_progress=False)
    assert llm.config.model.dtype == "bfloat16"
    runner = llm.engine.executor.worker.runner
    assert all(
        p.dtype.is_floating_point and str(p.dtype) == "torch.bfloat16" for p in runner.model.parameters()
    )
    out = llm.generate(
        ["def f(x):"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 8


def test_tied_embeddings_share_one_tensor(make_ckpt):
    llm = LLM(str(make_ckpt("qwen3")), show_progress=False)
    model = llm.engine.executor.worker.runner.model
    assert model.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_weights_file_serves_the_same_weights_from_file_pages(make_ckpt, tmp_path):
    """--weights-file (used by snapshots): parameters live in a private mapping of the file, tied
    weights stay shared, and generation is unchanged."""
    path = str(make_ckpt("qwen3"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    plain = LLM(path, dtype="float32", show_progress=False)
    expected = plain.generate(["def f(x):", "Hello"], params, use_tqdm=False)
    mapped = LLM(path, dtype="float32", weights_file=str(tmp_path / "w.bin"), show_progress=False)
    worker = mapped.engine.executor.worker
    model = worker.runner.model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    maps = Path("/proc/self/maps").read_text().splitlines()
    spans = [ln for ln in maps if ln.endswith(str(tmp_path / "w.bin"))]
    assert spans, "the weights file is mapped"
    lo, hi = (int(x, 16) for x in spans[0].split()[0].split("-"))
    assert all(lo <= p.data_ptr() < hi for p in model.parameters())
    got = mapped.generate(["def f(x):", "Hello"], params, use_tqdm=False)
    for a, b in zip(expected, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {k: v.logprob for k, v in pa.items()} == {k: v.logprob for k, v in pb.items()}


@pytest.mark.e2e
def test_cli_reports_one_line_errors(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "generate", "--model", str(tmp_path / "missing"), "hello"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model directory not found" in lines[0]


USED_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "rms_norm_eps",
    "vocab_size",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "tie_word_embeddings",
    "sliding_window",
)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_config_read_without_transformers_matches_autoconfig(make_ckpt, tmp_path, arch):
    """A plain Llama (or Qwen2 without sliding windows) config.json is read directly (no transformers
    import on the start-up path); every field the models read equals what transformers' AutoConfig
    gives, defaults included."""
    from transformers import AutoConfig

    from workers.loader import read_hf_config
    from workers.models.layers import rope_parameters

    src = make_ckpt(arch)
    optional = ("rms_norm_eps", "attention_bias", "mlp_bias", "head_dim")
    for drop in ((), optional + (("num_key_value_heads",) if arch == "llama" else ())):
        folder = tmp_path / f"drop{len(drop)}"
        shutil.copytree(src, folder)
        raw = json.loads((folder / "config.json").read_text())
        for key in drop:
            raw.pop(key, None)
        (folder / "config.json").write_text(json.dumps(raw))
        light, ref = read_hf_config(str(folder)), AutoConfig.from_pretrained(str(folder))
        assert not hasattr(light, "to_dict"), "a plain Llama / Qwen2 must not go through transformers"
        for key in USED_FIELDS:
            if arch == "llama" or hasattr(ref, key):  # Qwen2Config has no attention_bias / mlp_bias
                assert getattr(light, key) == getattr(ref, key, None), key
        heads = ref.num_attention_heads
        assert (light.num_key_value_heads or heads) == (ref.num_key_value_heads or heads)
        ref_head_dim = getattr(ref, "head_dim", None) or ref.hidden_size // heads
        assert (light.head_dim or ref.hidden_size // heads) == ref_head_dim
        for key in ("rope_type", "rope_theta"):
            assert rope_parameters(light)[key] == rope_parameters(ref)[key], key


def test_other_configs_go_through_transformers(make_ckpt, tmp_path):
    from workers.loader import read_hf_config

    for arch in ("qwen3", "mistral"):
        assert hasattr(read_hf_config(str(make_ckpt(arch))), "to_dict"), arch
    windowed = tmp_path / "qwen2-windowed"
    shutil.copytree(make_ckpt("qwen2"), windowed)
    raw = json.loads((windowed / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps(raw | {"use_sliding_window": True, "sliding_window": 8}))
    assert hasattr(read_hf_config(str(windowed)), "to_dict")


@pytest.mark.e2e
@pytest.mark.parametrize("command", ["generate", "core"])
def test_a_checkpoint_that_does_not_fit_is_one_line_in_process_or_from_the_worker(
    make_ckpt, tmp_path, command
):
    """WeightLoadError is an EmberError: one line and exit 2, whether the loader runs in the CLI's
    process (`generate`) or in a worker behind the core process (`core` with two ranks)."""
    dst = tmp_path / "wrong"
    shutil.copytree(make_ckpt("llama"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["intermediate_size"] += 8  # the weights no longer fit the model the config describes
    (dst / "config.json").write_text(json.dumps(cfg))
    argv = (
        ["generate", "--model", str(dst), "hi"] if command == "generate" else ["core", str(dst), "-tp", "2"]
    )
    proc = subprocess.run(
        [sys.executable, "-m", "frontend.cli", *argv, "--dtype", "float32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ember {command}: error:") and "mlp" in last and "Traceback" not in proc.stderr
