"""Ember's greedy output equals Hugging Face `generate()` token for token (float32), logprobs within 1e-4.

Covers every architecture with 10 prompts of different lengths in one batch, then the same batch
under a tiny token budget (chunked prefill mixed with decodes) and a tiny KV cache (preemption by
recompute). Run: `pytest -q tests/workers/test_hf_equivalence.py`.
"""

from __future__ import annotations

import pytest
import torch

from coreproc import LLM, SamplingParams
from tests.hf_ref import (
    PROMPT_TEXTS,
    check_logprobs_close,
    check_outputs_equal,
    hf_greedy,
    hf_prompt_logprobs,
)

pytestmark = pytest.mark.model

MAX_NEW = 24

ENGINE_SETUPS = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=16),
    "preempting": dict(block_size=8, max_model_len=128, num_kv_blocks=20, max_num_batched_tokens=64),
}


def greedy_params(n: int = MAX_NEW, logprobs: int | None = 0) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, logprobs=logprobs)


def run_and_compare(model_dir, llm: LLM, prompts: list[list[int]], max_new: int = MAX_NEW) -> None:
    outs = llm.generate(prompts, greedy_params(max_new), use_tqdm=False)
    ref = [hf_greedy(str(model_dir), p, max_new) for p in prompts]
    check_outputs_equal([o.outputs[0].token_ids for o in outs], [r[0] for r in ref])
    ours_lp = [[next(iter(pos.values())).logprob for pos in o.outputs[0].logprobs] for o in outs]
    check_logprobs_close(ours_lp, [r[1] for r in ref])
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason == "length"
        assert abs(o.outputs[0].cumulative_logprob - sum(ours_lp[outs.index(o)])) < 1e-3


@pytest.mark.parametrize("setup", sorted(ENGINE_SETUPS))
def test_greedy_matches_hf(tiny_ckpt, setup):
    llm = LLM(str(tiny_ckpt), dtype="float32", show_progress=False, **ENGINE_SETUPS[setup])
    prompts = [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS]
    assert len({len(p) for p in prompts}) >= 8, "prompts must have different lengths"
    run_and_compare(tiny_ckpt, llm, prompts)
    stats = llm.stats()
    assert stats.num_blocks_in_use == 0 or stats.num_blocks_in_use == 0
    if setup == "preempting":
        assert stats.num_preemptions > 0, "the tiny KV cache should force preemption"


def test_triton_backend_matches_hf(make_ckpt):
    """The Triton kernels (interpreted on CPU) drive the same model to the same tokens."""
    path = make_ckpt("llama")
    llm = LLM(
        str(path), dtype="float32", attention_backend="triton", max_num_batched_tokens=32, show_progress=False
    )
    prompts = [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS[:4]]
    run_and_compare(path, llm, prompts, max_new=6)


def test_sliding_window_matches_hf(make_ckpt):
    path = make_ckpt("mistral", sliding_window=8)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=24, show_progress=False)
    prompts = [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS]
    assert max(len(p) for p in prompts) > 8
    run_and_compare(path, llm, prompts)


def test_llama3_rope_scaling_matches_hf(make_ckpt):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    path = make_ckpt("llama", rope_parameters=rope)
    llm = LLM(str(path), dtype="float32", show_progress=False)
    prompts = [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS]
    run_and_compare(path, llm, prompts)


def test_sharded_checkpoint_loads_same_weights(make_ckpt):
    whole = make_ckpt("llama", seed=3)
    sharded = make_ckpt("llama", seed=3, max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    params = greedy_params(12)
    a = LLM(str(whole), dtype="float32", show_progress=False)
    b = LLM(str(sharded), dtype="float32", show_progress=False)
    prompts = PROMPT_TEXTS[:5]
    ta = [o.outputs[0].token_ids for o in a.generate(prompts, params, use_tqdm=False)]
    tb = [o.outputs[0].token_ids for o in b.generate(prompts, params, use_tqdm=False)]
    assert ta == tb


def test_prompt_logprobs_match_hf(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), dtype="float32", max_num_batched_tokens=16, show_progress=False)
    prompts = [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS[:6]]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        ref = hf_prompt_logprobs(str(tiny_ckpt), prompt)
        for pos in range(1, len(prompt)):
            entry = plp[pos]
            assert prompt[pos] in entry
            assert abs(entry[prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
            top = torch.topk(ref[pos - 1], 3)
            for lp, tid in zip(top.values.tolist(), top.indices.tolist()):
                assert tid in entry and abs(entry[tid].logprob - lp) < 1e-4
