"""Mixture-of-experts models (workers/models/moe.py and one file per family) against transformers.

Tiny checkpoints built with transformers' own classes (`ember make-model --arch ...`), routers scaled
so routing is decisive: Mixtral (renormalized top-2 of 6), Qwen2-MoE (a shared expert behind its
sigmoid gate), Qwen3-MoE (a dense layer among sparse ones, renormalized), OLMoE (top-3 of 7, q/k
norms over all heads), Granite-MoE (top-k logits then softmax, stacked 3-D expert tensors, Granite's
multipliers), GLM-4.5 (sigmoid scores with the correction bias, top-3 within 2 of 4 groups, routed
scale, a shared expert, a dense first layer, partial rotary, q/k norms and biases). Shown per
family: float32 greedy tokens equal transformers' over 48 tokens, batched and one at a time,
logprobs within 1e-4; bf16 on the native ops and int8 experts agree teacher-forced;
two tensor-parallel ranks (experts split along their intermediate size) and two pipeline stages give
the same tokens, as does n-gram speculation; LoRA: attention adapters equal PEFT, expert adapters
refused in one line; each layer's expert load reaches the engine's stats; memory planning counts the
experts' worst-case workspace.
Run: `pytest -q tests/workers/test_moe.py`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from coreproc import LLM, SamplingParams
from tests.hf_ref import (
    PROMPT_TEXTS,
    check_logprobs_close,
    check_outputs_equal,
    engine_greedy,
    hf_greedy,
    teacher_forced,
    top1_agreement,
)
from tests.workers.test_lora import ATTENTION, make_adapter, peft_greedy
from workers.models.moe import MoEParts

pytestmark = pytest.mark.model

MAX_NEW = 48
INT8_MIN_TOP1 = 0.95  # int8 experts: the floor a GGUF Q8_0 file is held to
MARGIN = 0.02  # float32's best two logprobs closer than this: a near-tie
SHAPES = dict(hidden=72, heads=6, kv_heads=2, head_dim=12, intermediate=40, layers=3)
DECISIVE = {"initializer_range": 0.06}  # logits far enough apart that bf16 rounding rarely swaps the top two
FAMILIES = {
    "mixtral": {"extra_config": DECISIVE},
    "qwen2_moe": {"extra_config": DECISIVE},
    "qwen3_moe": {
        "extra_config": {**DECISIVE, "mlp_only_layers": [1], "norm_topk_prob": True}
    },  # as released
    "olmoe": {"extra_config": {**DECISIVE, "num_experts": 7, "num_experts_per_tok": 3}},
    "granitemoe": {"extra_config": DECISIVE},
    "glm4_moe": {"extra_config": DECISIVE},
}


# the families each parallel layout runs on: tensor parallelism on the plain, shared-expert and grouped
# (V3) routers with their first dense layers, pipeline parallelism on the others
PARALLEL_FAMILIES = {
    "tensor": ("mixtral", "qwen2_moe", "glm4_moe"),
    "pipeline": ("granitemoe", "qwen3_moe", "olmoe"),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, make_ckpt) -> tuple[str, Path]:
    return request.param, make_ckpt(request.param, **{**SHAPES, **FAMILIES[request.param]})


@pytest.fixture(scope="module")
def reference(family) -> tuple[list[list[int]], list[tuple[list[int], list[float]]]]:
    _, path = family
    with LLM(str(path), dtype="float32", show_progress=False) as llm:
        prompts = [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS[:5]]
    return prompts, [hf_greedy(str(path), p, MAX_NEW) for p in prompts]


def greedy(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    return engine_greedy(llm, prompts, MAX_NEW)


def test_float32_greedy_equals_transformers_batched_and_alone(family, reference) -> None:
    _, path = family
    prompts, ref = reference
    with LLM(str(path), dtype="float32", show_progress=False) as llm:
        tokens, logprobs = greedy(llm, prompts)
        alone = [greedy(llm, [p])[0][0] for p in prompts[:2]]
    check_outputs_equal(tokens, [r[0] for r in ref])
    check_logprobs_close(logprobs, [r[1] for r in ref])
    check_outputs_equal(alone, [r[0] for r in ref[:2]])


def top2(path: Path, seqs: list[list[int]], **setup) -> list[list]:
    """An engine's two best prompt logprobs at each position of each sequence."""
    with LLM(str(path), show_progress=False, **setup) as llm:
        return teacher_forced(llm, seqs, top=2)


@pytest.mark.parametrize(
    "setup",
    [{"dtype": "bfloat16"}, {"dtype": "float32", "quantization": "int8"}],
    ids=["bf16-native", "int8-experts"],
)
def test_bf16_and_int8_agree_teacher_forced(family, reference, native_kernels, setup) -> None:
    """Prompt + float32 continuation: the engine's top-1 next token at each position of the
    continuation against float32's, where float32's best two differ by at least MARGIN (a tiny random
    model has near-ties that any rounding may swap: those are left out, at least 60 positions kept)."""
    _, path = family
    prompts, ref = reference
    seqs = [p + r[0] for p, r in zip(prompts, ref)]
    exact, ours = top2(path, seqs, dtype="float32"), top2(path, seqs, **setup)
    hits, total, ties = top1_agreement(ours, seqs, [len(p) for p in prompts], exact, MARGIN)
    floor = 0.97 if setup["dtype"] == "bfloat16" else INT8_MIN_TOP1
    print(f"{family[0]} {setup}: top-1 {hits / total:.3f} over {total} positions ({ties} near-ties apart)")
    assert hits / total >= floor and total >= 60  # (Granite's logit divisor leaves many near-ties)


@pytest.mark.parametrize(
    "parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"]
)
def test_parallel_ranks_keep_transformers_tokens(family, reference, parallel) -> None:
    arch, path = family
    if arch == "olmoe" and "tensor_parallel_size" in parallel:
        pytest.skip("OLMoE's q/k norms over all heads refuse tensor parallelism (as OLMo 2's)")
    kind = "tensor" if "tensor_parallel_size" in parallel else "pipeline"
    if arch not in PARALLEL_FAMILIES[kind]:  # each engine start is two worker processes: seconds
        pytest.skip(f"{kind} parallelism runs on {', '.join(PARALLEL_FAMILIES[kind])}")
    prompts, ref = reference
    with LLM(str(path), dtype="float32", show_progress=False, **parallel) as llm:
        tokens, _ = greedy(llm, prompts[:3])
    check_outputs_equal(tokens, [r[0] for r in ref[:3]])


def test_lora_reaches_attention_and_refuses_experts(make_ckpt, tmp_path: Path) -> None:
    path = make_ckpt("mixtral", **SHAPES)
    attention = make_adapter(path, tmp_path / "attn", 4, ATTENTION, seed=2)
    experts = Path(shutil.copytree(attention, tmp_path / "experts"))  # one expert's w1 added to it
    weights = load_file(experts / "adapter_model.safetensors")
    weights["base_model.model.model.layers.0.block_sparse_moe.experts.0.w1.lora_A.weight"] = torch.zeros(
        4, 72
    )
    save_file(weights, experts / "adapter_model.safetensors")
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    with LLM(str(path), dtype="float32", enable_lora=True, show_progress=False) as llm:
        llm.load_lora("attn", str(attention))
        prompt = llm.get_tokenizer()(PROMPT_TEXTS[0]).input_ids
        out = llm.generate([prompt], params, lora_request="attn", use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == peft_greedy(path, attention, prompt)[:8]
        with pytest.raises(
            ValueError, match="is not a LoRA weight of a q/k/v/o/gate/up/down projection"
        ) as info:
            llm.load_lora("experts", str(experts))
        assert "\n" not in str(info.value)


GGUF_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "glm4_moe")
LLAMA_CPP_ROUTING = {"glm4_moe": {"n_group": 1, "topk_group": 1}}  # llama.cpp's glm4moe: one group


@pytest.mark.parametrize("arch", GGUF_FAMILIES)
def test_gguf_files_give_the_folders_tokens(arch: str, make_ckpt, tmp_path: Path, native_kernels) -> None:
    """Its GGUF file under llama.cpp's names and keys (experts stacked in `ffn_*_exps`, the router in
    `ffn_gate_inp`, the `*_shexp` shared experts, GLM's `exp_probs_b` correction bias and dense first
    layer): in F32 the folder's float32 tokens and logprobs; in Q8_0,
    run in its own bits (bf16), the float32 folder's next token teacher-forced."""
    from tools.hf_to_gguf import write_gguf

    extra = {k: v for k, v in FAMILIES[arch]["extra_config"].items() if k != "mlp_only_layers"}
    extra |= LLAMA_CPP_ROUTING.get(arch, {})
    folder = make_ckpt(arch, **{**SHAPES, "extra_config": extra})  # llama.cpp's: experts on every layer
    runs, prompts = [], []
    for source in (folder, write_gguf(folder, tmp_path / f"{arch}.gguf")):
        with LLM(str(source), dtype="float32", show_progress=False) as llm:
            prompts = prompts or [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS[:3]]
            runs.append(greedy(llm, prompts))
    (tokens, logprobs), (gguf_tokens, gguf_logprobs) = runs
    check_outputs_equal(gguf_tokens, tokens)
    check_logprobs_close(gguf_logprobs, logprobs)
    q8 = write_gguf(folder, tmp_path / f"{arch}-q8_0.gguf", "Q8_0")
    seqs = [p + t for p, t in zip(prompts, tokens)]
    exact, ours = top2(folder, seqs, dtype="float32"), top2(q8, seqs, dtype="bfloat16")
    hits, total, _ = top1_agreement(ours, seqs, [len(p) for p in prompts], exact, MARGIN)
    print(f"{arch} Q8_0: top-1 {hits / total:.3f} over {total} positions")
    assert hits / total >= 0.95 and total >= 40


def test_memory_planning_counts_the_experts_workspace(make_ckpt, monkeypatch) -> None:
    """A full batch every token of which goes to the same experts: its workspace is taken from the
    memory the KV cache is sized from, and a fixed KV budget that leaves no room for it is refused at
    start-up in one line."""
    from coreproc.base.config import ConfigError, EngineConfig
    from coreproc.base.kv_layout import KVLayout
    from workers import kv_memory

    moe = MoEParts(32, 8, 512)
    tokens, hidden = 2048, 1024
    workspace = moe.workspace_bytes(hidden, tokens, 2)
    # 8 experts each holding every token: inputs, gate/up, activation, down in bf16; the float32 sums
    assert workspace >= 8 * tokens * (2 * hidden + 3 * 512) * 2 + tokens * hidden * 4
    config = EngineConfig.create(str(make_ckpt("mixtral", **SHAPES)), dtype="bfloat16")
    free, per_block = 1 << 30, 1 << 20
    monkeypatch.setattr(kv_memory, "available_memory", lambda device: free)
    layout = KVLayout.full(3)
    plain = kv_memory.plan_kv_blocks(config, per_block, torch.device("cpu"), layout)
    less = kv_memory.plan_kv_blocks(config, per_block, torch.device("cpu"), layout, workspace)
    fraction = kv_memory.CPU_DEFAULT_KV_FRACTION
    assert plain == int(free * fraction) // per_block
    assert less == int((free - workspace) * fraction) // per_block
    assert less < plain
    fixed = EngineConfig.create(str(config.model.model), dtype="bfloat16", num_kv_blocks=1000)
    with pytest.raises(ConfigError, match="workspace"):
        kv_memory.plan_kv_blocks(fixed, per_block, torch.device("cpu"), layout, workspace)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # the torch path, the native one-call layers
def test_engine_reports_each_layers_expert_load(make_ckpt, native_kernels, dtype: str) -> None:
    """Every token a layer ran went to top-k experts: each MoE layer's counts add up to top-k times the
    tokens forwarded (the prompt, then each generated token but the last); a dense layer has none."""
    path = make_ckpt("qwen3_moe", **{**SHAPES, **FAMILIES["qwen3_moe"]})  # layer 1 dense
    prompt, new = [5, 17, 33, 2, 9, 41, 7], 6
    params = SamplingParams(temperature=0.0, max_tokens=new, min_tokens=new)
    with LLM(str(path), dtype=dtype, show_progress=False, enable_prefix_caching=False) as llm:
        llm.generate([prompt], params, use_tqdm=False)
        stats = llm.stats()
    assert sorted(stats.expert_load) == [0, 2]
    assert all(sum(counts) == 2 * (len(prompt) + new - 1) for counts in stats.expert_load.values())
    assert stats.expert_imbalance >= 1.0 and set(stats.expert_layer_imbalance) == {0, 2}


def test_ngram_speculation_keeps_the_tokens(family) -> None:
    """Proposals verified in one step through the experts give the tokens plain decoding gives."""
    _, path = family
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "adaptive": false}'
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    runs, proposed = [], 0
    for speculative_config in (None, spec):
        with LLM(
            str(path), dtype="float32", show_progress=False, speculative_config=speculative_config
        ) as llm:
            outs = llm.generate(PROMPT_TEXTS[:2], params, use_tqdm=False)
            runs.append([list(o.outputs[0].token_ids) for o in outs])
            proposed = llm.stats().spec_num_proposed
    assert runs[1] == runs[0] and proposed > 0
