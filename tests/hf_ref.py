"""Hugging Face `transformers` as the reference: greedy generation and prompt logprobs in float32.

Imported by tests only. Models are loaded once per (folder, dtype) and kept for the session.
`check_outputs_equal` / `check_logprobs_close` compare Ember results with the reference.
"""

from __future__ import annotations

from functools import lru_cache

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
