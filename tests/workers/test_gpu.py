"""The engine on a CUDA device (marker `gpu`; skipped without CUDA): workers on the GPU, the Triton
attention kernels compiled for it, quantized layers and the fp8 KV cache on it.

Greedy float32 output must equal Hugging Face `generate()` (the same references as the CPU suite),
with logprobs close; lossy setups (bf16, fp8/int8/int4 weights, fp8 KV) are measured teacher-forced
on the bundled trained model against the float32 GPU engine. Run: `pytest -q -m gpu tests/workers/test_gpu.py`
on a machine with CUDA (`tools/gpu_check.sh` runs it together with the kernel tests and a benchmark).
"""

from __future__ import annotations

import pytest
import torch

from coreproc import LLM, SamplingParams
from coreproc.base.host import default_model_dir
from tests.hf_ref import PROMPT_TEXTS, check_logprobs_close, check_outputs_equal, hf_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.model]

MAX_NEW = 24

# Floors for teacher-forced top-1 agreement with the float32 GPU engine on the bundled trained model
# (the CPU suite's floors for the same formats: tests/workers/test_quantization.py and
# tests/workers/test_kv_fp8.py).
LOSSY = {
    "bf16": (dict(dtype="bfloat16"), 0.95),
    "fp8_per_tensor": (dict(dtype="bfloat16", quantization="fp8_per_tensor"), 0.95),
    "int8": (dict(dtype="bfloat16", quantization="int8"), 0.95),
    "int4": (dict(dtype="bfloat16", quantization="int4"), 0.85),
    "fp8_kv": (dict(dtype="bfloat16", kv_cache_dtype="fp8"), 0.9),
}


def greedy(n: int = MAX_NEW, logprobs: int | None = 0) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, logprobs=logprobs)


def cuda_llm(path: str, **kwargs) -> LLM:
    llm = LLM(path, device="cuda", show_progress=False, **kwargs)
    assert llm.config.device.resolved_type == "cuda"
    return llm


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize(
    "setup",
    [
        dict(),
        dict(max_num_batched_tokens=16),  # chunked prefill mixed with decodes
        dict(block_size=8, max_model_len=128, num_kv_blocks=20, max_num_batched_tokens=64),  # preemption
    ],
    ids=["default", "chunked", "preempting"],
)
def test_cuda_greedy_matches_hf(make_ckpt, arch: str, setup: dict) -> None:
    path = str(make_ckpt(arch))
    llm = cuda_llm(path, dtype="float32", **setup)
    try:
        prompts = [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS]
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
        ref = [hf_greedy(path, p, MAX_NEW) for p in prompts]
        check_outputs_equal([o.outputs[0].token_ids for o in outs], [r[0] for r in ref])
        ours = [[next(iter(pos.values())).logprob for pos in o.outputs[0].logprobs] for o in outs]
        check_logprobs_close(ours, [r[1] for r in ref], atol=1e-3)
        assert llm.stats().num_blocks_in_use == 0
    finally:
        llm.close()


@pytest.fixture(scope="module")
def trained_reference() -> tuple[str, list[list[int]], list[int]]:
    """The bundled trained model: prompts, each followed by 16 greedy tokens of the float32 GPU engine."""
    path = str(default_model_dir())
    llm = cuda_llm(path, dtype="float32")
    try:
        prompts = [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS]
        outs = llm.generate(prompts, greedy(16, None), use_tqdm=False)
    finally:
        llm.close()
    return path, [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)], [len(p) for p in prompts]


def teacher_forced_top1(llm: LLM, seqs: list[list[int]], starts: list[int]) -> float:
    """Share of the continuation positions where the engine's argmax is the reference's token."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate(seqs, params, use_tqdm=False)
    agree = total = 0
    for out, ids, start in zip(outs, seqs, starts):
        for pos in range(start, len(ids)):
            entry = out.prompt_logprobs[pos]
            agree += entry[ids[pos]].rank == 1
            total += 1
    return agree / total


@pytest.mark.parametrize("name", sorted(LOSSY))
def test_cuda_lossy_formats_agree(trained_reference, name: str) -> None:
    path, seqs, starts = trained_reference
    kwargs, floor = LOSSY[name]
    llm = cuda_llm(path, **kwargs)
    try:
        top1 = teacher_forced_top1(llm, seqs, starts)
        print(f"{name}: teacher-forced top-1 agreement with float32 {top1:.3f}")
        assert top1 >= floor, f"{name}: top-1 agreement {top1:.3f} < {floor}"
        assert llm.stats().num_blocks_in_use == 0
    finally:
        llm.close()


def test_cuda_ngram_speculation_keeps_greedy_tokens(trained_reference) -> None:
    path, seqs, starts = trained_reference
    prompts = [ids[:n] for ids, n in zip(seqs, starts)]
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    spec = cuda_llm(path, dtype="float32", speculative_config=ngram)
    try:
        outs = spec.generate(prompts, greedy(16, None), use_tqdm=False)
    finally:
        spec.close()
    check_outputs_equal([o.outputs[0].token_ids for o in outs], [ids[n:] for ids, n in zip(seqs, starts)])


def test_cuda_is_what_auto_picks() -> None:
    llm = LLM(str(default_model_dir()), show_progress=False)
    try:
        assert llm.config.device.resolved_type == "cuda"
        assert torch.cuda.memory_allocated() > 0
    finally:
        llm.close()
