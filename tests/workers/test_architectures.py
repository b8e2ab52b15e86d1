"""The architectures beyond Llama's shape (workers/models/parts.py and one file each) against transformers.

Each is a tiny checkpoint built with transformers' own classes (`ember make-model --arch ...`), with
what makes it itself: Gemma 2 with sliding and global layers in turn and soft caps that bind on
attention scores and logits; Gemma 3 with seven layers (six sliding, one global, their own rope bases), a
window shorter than the prompts, `query_pre_attn_scalar` unlike the head size; SmolLM3 with a NoPE
layer; OLMo 2's post-norms and q/k norms over all heads; Granite's four multipliers far from 1;
Phi-3's fused projections, a window on every layer and LongRoPE; all with 6 heads over 2 kv heads.
Shown per architecture: float32 greedy tokens equal transformers' for prompts longer than the
window, batched and one at a time and with a tiny token budget (chunked prefill across the window),
logprobs within 1e-4; the same tokens with prefix-cache hits, preemption, n-gram speculation, two
tensor-parallel ranks and two pipeline stages; bf16 on the native CPU ops agrees with float32 on the
next token teacher-forced;
a GGUF file of it, written under llama.cpp's names and keys (tools/hf_to_gguf.py), gives the
float32 folder's tokens.
Run: `pytest -q tests/workers/test_architectures.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coreproc import LLM
from coreproc.base.errors import ConfigError
from tests.hf_ref import (
    PROMPT_TEXTS,
    check_logprobs_close,
    check_outputs_equal,
    engine_greedy,
    hf_greedy,
    teacher_forced,
    top1_agreement,
)
from tools.hf_to_gguf import write_gguf

pytestmark = pytest.mark.model

MAX_NEW = 20
WINDOW = 8
# make-model arguments: odd sizes, several layer kinds
SHAPES = dict(hidden=72, heads=6, kv_heads=2, head_dim=16, intermediate=112)
FAMILIES = {
    # soft caps that bind on a tiny model's small scores and logits: an engine that skips one is caught
    "gemma2": dict(
        layers=4,
        sliding_window=WINDOW,
        extra_config={"attn_logit_softcapping": 0.5, "final_logit_softcapping": 1.5},
    ),
    # a query scale unlike 1/sqrt(head_dim): an engine that ignores query_pre_attn_scalar is caught
    "gemma3": dict(layers=7, sliding_window=WINDOW, extra_config={"query_pre_attn_scalar": 24}),
    "smollm3": dict(layers=4),  # layer 3 has no positional encoding
    "olmo2": dict(layers=3),
    "granite": dict(layers=3),
    "phi3": dict(layers=3, head_dim=None, sliding_window=WINDOW),  # fused qkv and gate_up; hidden / heads
}
GGUF_FAMILIES = ("gemma2", "gemma3", "smollm3", "olmo2", "granite", "phi3")
BF16_MIN_TOP1 = 0.97


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, make_ckpt) -> tuple[str, Path]:
    return request.param, make_ckpt(request.param, **{**SHAPES, **FAMILIES[request.param]})


@pytest.fixture(scope="module")
def reference(family) -> tuple[list[list[int]], list[tuple[list[int], list[float]]]]:
    """The prompts (every one longer than the window but one) and transformers' greedy runs of them."""
    _, path = family
    with LLM(str(path), dtype="float32", show_progress=False) as llm:
        prompts = [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS[:6]]
    assert sum(len(p) > WINDOW for p in prompts) >= 5
    return prompts, [hf_greedy(str(path), p, MAX_NEW) for p in prompts]


def greedy(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    return engine_greedy(llm, prompts, MAX_NEW)


@pytest.mark.parametrize("setup", [{}, {"max_num_batched_tokens": 16}], ids=["default", "chunked"])
def test_float32_greedy_equals_transformers_batched_and_alone(family, reference, setup) -> None:
    _, path = family
    prompts, ref = reference
    with LLM(str(path), dtype="float32", show_progress=False, **setup) as llm:
        tokens, logprobs = greedy(llm, prompts)
        alone = [greedy(llm, [p])[0][0] for p in prompts[:3]]
    check_outputs_equal(tokens, [r[0] for r in ref])
    check_logprobs_close(logprobs, [r[1] for r in ref])
    check_outputs_equal(alone, [r[0] for r in ref[:3]])


def kv_bytes(path: Path, blocks: int, block_size: int) -> int:
    """The float32 KV memory of `blocks` blocks of every layer of the checkpoint at `path`."""
    cfg = json.loads((path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    return blocks * block_size * per_token


FEATURES = {
    "prefix-cache": dict(enable_prefix_caching=True),  # run twice: the second run hits the cache
    # as much memory as 20 blocks of every layer: the sliding layers' blocks come and go
    "preempting": dict(block_size=8, max_model_len=128, kv_cache_memory=20, max_num_batched_tokens=64),
    "ngram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    "tp2": dict(tensor_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_engine_features_keep_transformers_tokens(family, reference, feature: str) -> None:
    """What works for Llama works for each family: the same greedy tokens with prefix-cache hits,
    under preemption, with n-gram speculation, over two tensor-parallel ranks and two pipeline stages."""
    arch, path = family
    if arch == "olmo2" and feature == "tp2":
        pytest.skip("OLMo 2 with tensor parallelism is refused (test below)")
    prompts, ref = reference
    setup = dict(FEATURES[feature])
    if "kv_cache_memory" in setup:
        setup["kv_cache_memory"] = kv_bytes(path, setup["kv_cache_memory"], setup["block_size"])
    with LLM(str(path), dtype="float32", show_progress=False, **setup) as llm:
        runs = [greedy(llm, prompts)[0] for _ in range(2 if feature == "prefix-cache" else 1)]
        hits = llm.stats().prefix_cache_hits if feature == "prefix-cache" else None
    for tokens in runs:
        check_outputs_equal(tokens, [r[0] for r in ref])
    assert hits is None or hits > 0


def test_bf16_on_the_native_ops_agrees_teacher_forced(family, reference, native_kernels) -> None:
    """Prompt + float32 continuation through a bf16 engine: its top-1 next token at every position of
    the continuation against float32's (the continuation's next token)."""
    _, path = family
    prompts, ref = reference
    seqs = [p + r[0] for p, r in zip(prompts, ref)]
    with LLM(str(path), dtype="bfloat16", show_progress=False) as llm:
        assert llm.engine.executor.worker.linear_kernel == "cpu_bf16"
        hits, total, _ = top1_agreement(teacher_forced(llm, seqs), seqs, [len(p) for p in prompts])
    print(f"{family[0]}: bf16 top-1 {hits / total:.3f} over {total} positions")
    assert hits / total >= BF16_MIN_TOP1


@pytest.mark.parametrize("arch", GGUF_FAMILIES)
def test_a_gguf_file_gives_the_folders_tokens(arch: str, make_ckpt, tmp_path: Path) -> None:
    # llama.cpp derives Gemma's query scale from head_dim: its GGUF files cannot say another
    extra = {
        k: v for k, v in (FAMILIES[arch].get("extra_config") or {}).items() if k != "query_pre_attn_scalar"
    }
    folder = make_ckpt(arch, **{**SHAPES, **FAMILIES[arch], "extra_config": extra or None})
    gguf = write_gguf(folder, tmp_path / f"{arch}.gguf")
    runs = []
    prompts: list[list[int]] = []
    for path in (folder, gguf):  # the same ids into both: the tiny tokenizer's split is not GPT-2's
        with LLM(str(path), dtype="float32", show_progress=False) as llm:
            prompts = prompts or [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS[:4]]
            runs.append(greedy(llm, prompts))
    (tokens, logprobs), (gguf_tokens, gguf_logprobs) = runs
    check_outputs_equal(gguf_tokens, tokens)
    check_logprobs_close(gguf_logprobs, logprobs)


LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.1, 1.3, 1.7, 2.3, 3.1],
    "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
    "original_max_position_embeddings": 256,
}


def test_phi3_longrope_runs_its_short_factors_within_its_trained_context(make_ckpt, tmp_path: Path) -> None:
    """Phi-3's LongRoPE: transformers' short factors and attention factor (max_position_embeddings 1024
    over 256 trained), the context cut to 256 when none is asked for, a longer one refused; its GGUF
    file (the factors as llama.cpp's rope_factors tensors) gives the same tokens."""
    arch = "phi3"
    path = make_ckpt(arch, **{**SHAPES, **FAMILIES[arch]}, rope_parameters=LONGROPE)
    gguf = write_gguf(path, tmp_path / "phi3-longrope.gguf")
    runs = []
    prompts: list[list[int]] = []
    for source in (path, gguf):  # the folder's token ids into both (the tiny tokenizer is not GPT-2's)
        with LLM(str(source), dtype="float32", show_progress=False) as llm:
            assert llm.engine.config.model.max_model_len == 256
            prompts = prompts or [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS[:4]]
            runs.append(greedy(llm, prompts))
    ref = [hf_greedy(str(path), p, MAX_NEW) for p in prompts]
    for tokens, logprobs in runs:
        check_outputs_equal(tokens, [r[0] for r in ref])
        check_logprobs_close(logprobs, [r[1] for r in ref])
    with pytest.raises(ConfigError, match="max_model_len 512 needs LongRoPE's long factors"):
        LLM(str(path), dtype="float32", max_model_len=512, show_progress=False)


def test_gemma3_with_soft_caps_keeps_transformers_tokens(make_ckpt) -> None:
    """Gemma 3 configs may set Gemma 2's soft caps too: the final one applies (binding here), the
    attention one does not (as in transformers and llama.cpp)."""
    config = {"attn_logit_softcapping": 0.5, "final_logit_softcapping": 1.5}
    path = make_ckpt("gemma3", **{**SHAPES, **FAMILIES["gemma3"], "extra_config": config})
    with LLM(str(path), dtype="float32", show_progress=False) as llm:
        prompts = [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS[:3]]
        tokens, logprobs = greedy(llm, prompts)
    ref = [hf_greedy(str(path), p, MAX_NEW) for p in prompts]
    check_outputs_equal(tokens, [r[0] for r in ref])
    check_logprobs_close(logprobs, [r[1] for r in ref])


def test_olmo2_with_tensor_parallelism_is_refused_in_one_line(make_ckpt) -> None:
    path = make_ckpt("olmo2", **{**SHAPES, **FAMILIES["olmo2"]})
    with pytest.raises(ConfigError, match="Olmo2ForCausalLM cannot run with tensor parallelism"):
        LLM(str(path), dtype="float32", tensor_parallel_size=2, show_progress=False)
