"""Hugging Face `transformers` as the reference: greedy generation and prompt logprobs in float32.

Imported by tests only. Models are loaded once per (folder, dtype) and kept for the session.
`check_outputs_equal` / `check_logprobs_close` compare Ember results with the reference;
`check_greedy_close` compares two greedy runs whose roundings differ (other kernels or thread counts).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
from transformers import AutoModelForCausalLM

PROMPT_TEXTS = [
    "def fibonacci(n):",
    "x",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
    "for i in range(10):\n    print(i)",
    "    return self._cache[key]\n\n    def __len__(self):",
    "# Copyright\n",
    'raise ValueError("unexpected value: %r" % (value,))\n\n\ndef parse(text, *, strict=False):\n    '
    '"""Parse text into tokens."""\n    tokens = []\n    for line in text.splitlines():\n',
    "with open(filename) as f:",
    "try:\n    import threading\nexcept ImportError:\n    threading = None",
    "a = b + c * d - (e / f)",
]


@lru_cache(maxsize=8)
def hf_model(model_dir: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy(
    model_dir: str, prompt_ids: list[int], max_new_tokens: int, dtype: torch.dtype = torch.float32
) -> tuple[list[int], list[float]]:
    """Greedy tokens (EOS suppressed, like min_new_tokens) and the raw logprob of each chosen token."""
    model = hf_model(str(model_dir), dtype)
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=model.generation_config.pad_token_id or 0,
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens)]
    return tokens, logprobs


@torch.inference_mode()
def hf_prompt_logprobs(model_dir: str, prompt_ids: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab] logprobs of each next prompt token given its prefix."""
    logits = hf_model(str(model_dir))(torch.tensor([prompt_ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1)


def check_outputs_equal(ours: list[list[int]], ref: list[list[int]]) -> None:
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a == b, f"prompt {i}: tokens differ\n ours: {a}\n   hf: {b}"


def check_logprobs_close(ours: list[list[float]], ref: list[list[float]], atol: float = 1e-4) -> None:
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert len(a) == len(b)
        worst = max(abs(x - y) for x, y in zip(a, b))
        assert worst <= atol, f"prompt {i}: logprob differs by {worst:.2e} (> {atol})"


# One prompt's greedy run: its tokens and, per token, the top logprobs by token id (the chosen one's too).
Greedy = tuple[list[int], list[dict[int, float]]]


def greedy_runs(outputs: list[Any]) -> list[Greedy]:
    """`Greedy` runs from `LLM.generate` outputs made with `logprobs` >= 1 (2 shows a near-tie)."""
    return [
        (o.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
        for o in outputs
    ]


def check_greedy_close(ours: list[Greedy], ref: list[Greedy], tie: float, atol: float) -> int:
    """Two greedy runs of one model whose roundings differ (bf16 kernels of another ISA, another
    accumulation order or thread count): per prompt the tokens are equal and their logprobs within
    `atol`, up to a parting at a near-tie, where each run's token is among the other's top logprobs
    within `tie` of its best; after a parting the runs continue different texts and nothing more is
    compared. Returns how many prompts parted, for the caller to print: that count depends on the
    CPU, so it is never asserted."""
    parted = 0
    for i, ((toks_a, lps_a), (toks_b, lps_b)) in enumerate(zip(ours, ref, strict=True)):
        for j, (a, b) in enumerate(zip(toks_a, toks_b)):
            if a != b:
                for name, top, other in (("ours", lps_a[j], b), ("ref", lps_b[j], a)):
                    gap = max(top.values()) - top.get(other, float("-inf"))
                    assert gap <= tie, f"prompt {i}, token {j}: {a} against {b}, {name} {top}: no near-tie"
                parted += 1
                break
            diff = abs(lps_a[j][a] - lps_b[j][b])
            assert diff <= atol, f"prompt {i}, token {j}: logprobs differ by {diff:.3f} (> {atol})"
        else:
            assert len(toks_a) == len(toks_b), f"prompt {i}: {len(toks_a)} tokens against {len(toks_b)}"
    return parted


def engine_greedy(
    llm: Any, prompts: list[list[int]], max_new: int
) -> tuple[list[list[int]], list[list[float]]]:
    """An Ember engine's greedy tokens (EOS suppressed, as `hf_greedy`) and the logprob of each."""
    from coreproc import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new, min_tokens=max_new, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens, [[next(iter(p.values())).logprob for p in o.outputs[0].logprobs] for o in outs]


def teacher_forced(llm: Any, seqs: list[list[int]], top: int = 1) -> list[list[Any]]:
    """An Ember engine's prompt logprobs (its `top` best at each position) of each sequence."""
    from coreproc import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top)
    return [o.prompt_logprobs for o in llm.generate(seqs, params, use_tqdm=False)]


def top1_agreement(
    ours: list[list[Any]],
    seqs: list[list[int]],
    starts: list[int],
    exact: list[list[Any]] | None = None,
    margin: float = 0.0,
) -> tuple[int, int, int]:
    """Teacher-forced: at each position of each sequence from its start, whether the engine's best
    token (`ours`, from `teacher_forced`) is the sequence's. With `exact` (a reference run's top-2
    prompt logprobs), positions whose two best are closer than `margin` are near-ties, left out.
    Returns (agreeing, counted, near-ties)."""
    hits = total = ties = 0
    for i, (seq, start) in enumerate(zip(seqs, starts, strict=True)):
        for pos in range(start, len(seq)):
            if exact is not None:
                best = sorted((e.logprob for e in exact[i][pos].values()), reverse=True)
                if best[0] - best[1] < margin:
                    ties += 1
                    continue
            entry = ours[i][pos]
            hits += max(entry, key=lambda t: entry[t].logprob) == seq[pos]
            total += 1
    return hits, total, ties
