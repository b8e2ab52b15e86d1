"""Sampling and stop conditions, end to end through the offline API and against HF's logits warpers.

Seeded sampling must reproduce exactly and not depend on what else is in the batch (or on
preemption); filters (top-k, top-p, min-p) must keep the same tokens Hugging Face keeps; stop token
ids, stop strings, max_tokens and n > 1 behave as in vLLM. Run: `pytest -q tests/workers/test_sampling.py`.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from coreproc import LLM, SamplingParams
from coreproc.base.logits_processors import BUILTIN_SPECS, ProcessorContext, Row, load_processors
from tests.hf_ref import PROMPT_TEXTS, hf_model
from workers.sampler import Sampler, SamplingBatch


def builtin_processors(vocab: int) -> list:
    return load_processors(list(BUILTIN_SPECS), ProcessorContext(vocab, 128))


pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def llama(make_ckpt):
    return make_ckpt("llama")


@pytest.fixture(scope="module")
def llm(llama):
    return LLM(str(llama), dtype="float32", show_progress=False)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sampling_is_reproducible_and_batch_independent(llama, llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=100, seed=1234, max_tokens=20, ignore_eos=True)
    alone = tokens(llm.generate([PROMPT_TEXTS[0]], seeded, use_tqdm=False))[0]
    assert alone == tokens(llm.generate([PROMPT_TEXTS[0]], seeded, use_tqdm=False))[0]
    others = [SamplingParams(temperature=0.7, max_tokens=25, ignore_eos=True) for _ in PROMPT_TEXTS[1:6]]
    mixed = llm.generate(
        PROMPT_TEXTS[1:3] + [PROMPT_TEXTS[0]] + PROMPT_TEXTS[3:6], others[:2] + [seeded] + others[2:]
    )
    assert mixed[2].outputs[0].token_ids == alone
    # under KV pressure (preemption and recompute) the seeded request still draws the same tokens
    tight = LLM(
        str(llama), dtype="float32", block_size=8, max_model_len=96, num_kv_blocks=14, show_progress=False
    )
    outs = tight.generate(
        PROMPT_TEXTS[1:3] + [PROMPT_TEXTS[0]] + PROMPT_TEXTS[3:6], others[:2] + [seeded] + others[2:]
    )
    assert tight.stats().num_preemptions > 0
    assert outs[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=100, seed=99, max_tokens=20, ignore_eos=True
    )
    assert tokens(llm.generate([PROMPT_TEXTS[0]], other_seed, use_tqdm=False))[0] != alone


def test_filters_keep_the_same_tokens_as_hf():
    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 3
    for k in (1, 5, 50):
        ours = Sampler._filter(logits.clone(), [k] * 6, [1.0] * 6)
        ref = TopKLogitsWarper(k)(None, logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    for p in (0.1, 0.5, 0.9):
        ours = Sampler._filter(logits.clone(), [0] * 6, [p] * 6)
        ref = TopPLogitsWarper(p)(None, logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(ref))


def batch(n: int, **overrides) -> SamplingBatch:
    fields = dict(
        temperature=[1.0] * n,
        top_k=[0] * n,
        top_p=[1.0] * n,
        min_p=[0.0] * n,
        seeds=[None] * n,
        output_positions=[0] * n,
        presence_penalty=[0.0] * n,
        frequency_penalty=[0.0] * n,
        repetition_penalty=[1.0] * n,
        prompt_ids=[[] for _ in range(n)],
        output_ids=[[] for _ in range(n)],
        rows=[Row(i, SamplingParams(), [], [], []) for i in range(n)],
        max_num_logprobs=0,
    )
    fields.update(overrides)
    return SamplingBatch(**fields)


def test_sampling_follows_the_filtered_distribution():
    """8000 draws from one row: empirical frequencies match softmax(top-p/min-p filtered logits / T)."""
    torch.manual_seed(1)
    row = torch.randn(1, 12) * 2
    sampler = Sampler(torch.device("cpu"), seed=5)
    n = 8000
    b = batch(n, temperature=[0.8] * n, top_p=[0.9] * n, min_p=[0.05] * n)
    draws = sampler(row.repeat(n, 1), b).sampled
    ref_logits = TopPLogitsWarper(0.9)(None, row / 0.8)
    probs = torch.softmax(ref_logits, -1)[0]
    probs = torch.softmax(MinPLogitsWarper(0.05)(None, torch.log(probs).unsqueeze(0)), -1)[0]
    freq = torch.bincount(draws, minlength=12).float() / n
    assert torch.all(freq[probs == 0] == 0), "a filtered token was drawn"
    assert torch.allclose(freq, probs, atol=0.02)


def test_penalties_match_reference_formulas():
    torch.manual_seed(2)
    logits = torch.randn(2, 40)
    prompt, output = [3, 4, 5], [5, 6, 6, 7]
    b = batch(
        2,
        repetition_penalty=[1.3, 1.0],
        presence_penalty=[0.0, 0.5],
        frequency_penalty=[0.0, 0.25],
        prompt_ids=[prompt, prompt],
        output_ids=[output, output],
    )
    ours = Sampler(torch.device("cpu"))._apply_penalties(logits.clone(), b)
    rep = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits[:1].clone())
    assert torch.allclose(ours[0], rep[0])
    expected = logits[1].clone()
    for t in set(output):
        expected[t] -= 0.25 * output.count(t) + 0.5
    assert torch.allclose(ours[1], expected)


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.zeros(1, 10)
    logits[0, 2] = 5.0  # EOS would win
    logits[0, 7] = 4.0  # a stop id next
    rows = [Row(0, SamplingParams(min_tokens=1, stop_token_ids=[7]), [5], [], [2])]
    sampler = Sampler(torch.device("cpu"), processors=builtin_processors(10))
    out = sampler(logits, batch(1, temperature=[0.0], rows=rows))
    assert out.sampled.item() not in (2, 7)
    rows[0].output_ids.append(3)  # min_tokens reached: EOS allowed again
    assert sampler(logits, batch(1, temperature=[0.0], rows=rows)).sampled.item() == 2


def test_repetition_penalty_greedy_matches_hf(llama, llm):
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=16, min_tokens=16)
    prompt = llm.get_tokenizer()(PROMPT_TEXTS[2]).input_ids
    ours = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    model = hf_model(str(llama))
    ids = torch.tensor([prompt])
    ref = model.generate(
        ids, do_sample=False, repetition_penalty=1.5, max_new_tokens=16, min_new_tokens=16, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert ours == ref


def test_stop_token_ids_and_max_tokens(llm):
    base = llm.generate([PROMPT_TEXTS[0]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    out = base.outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    target = out.token_ids[5]
    first = out.token_ids.index(target)
    stopped = llm.generate(
        [PROMPT_TEXTS[0]],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[target]),
    )[0].outputs[0]
    assert stopped.token_ids == out.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == target


def test_stop_strings_truncate_and_free_blocks(llm):
    base = llm.generate([PROMPT_TEXTS[3]], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    text = base.outputs[0].text
    stop = text[10:13]
    at = text.find(stop)
    for include in (False, True):
        params = SamplingParams(
            temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=include
        )
        out = llm.generate([PROMPT_TEXTS[3]], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == (text[: at + len(stop)] if include else text[:at])
        assert len(out.token_ids) < 30
    assert llm.stats().num_blocks_in_use == 0


def test_streamed_deltas_add_up_to_the_result(llm):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=["\n\n"])
    deltas = list(llm.stream(PROMPT_TEXTS[6], params))
    final = llm.generate([PROMPT_TEXTS[6]], params, use_tqdm=False)[0].outputs[0]
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert deltas[-1].finish_reason == final.finish_reason


def test_n_sequences(llm):
    outs = llm.generate(
        [PROMPT_TEXTS[0]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    )
    seqs = outs[0].outputs
    assert [s.index for s in seqs] == [0, 1, 2]
    assert len({tuple(s.token_ids) for s in seqs}) == 3, "seeded children must draw different tokens"
    again = llm.generate(
        [PROMPT_TEXTS[0]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    )
    assert [s.token_ids for s in again[0].outputs] == [s.token_ids for s in seqs]
    greedy = llm.generate([PROMPT_TEXTS[0]], SamplingParams(n=2, temperature=0.0, max_tokens=8))[0].outputs
    assert greedy[0].token_ids == greedy[1].token_ids


def test_logprobs_top_n_are_sorted_and_include_the_chosen_token(llm):
    out = llm.generate([PROMPT_TEXTS[1]], SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=4))[
        0
    ]
    comp = out.outputs[0]
    for tok, pos in zip(comp.token_ids, comp.logprobs):
        assert tok in pos and 4 <= len(pos) <= 5
        alts = sorted((lp for t, lp in pos.items() if lp.rank <= 4), key=lambda lp: lp.rank)
        assert [lp.rank for lp in alts][:4] == [1, 2, 3, 4]
        assert all(a.logprob >= b.logprob for a, b in zip(alts, alts[1:]))
