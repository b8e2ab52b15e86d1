"""The prompts of the offline benchmarks (`ember bench throughput`, `ember bench latency`).

- `random`: token ids drawn uniformly (fixed seed, no special tokens), `--input-len` each; the run
  ignores EOS so every request makes exactly `--output-len` tokens.
- `copy`: a window of a standard-library module's source, a marker, and the window's first tokens
  again, so the continuation retraces the window (a copy-like task where n-gram speculation shines).
- `rewrite`: a code-editing chat request: "rewrite this code with type hints", then one Python
  function or method of the standard library (0.8-2 KB), rendered with the model's chat template.
- `complete`: HumanEval-style code completion: a function header and docstring, as raw text.

`rewrite` and `complete` are what a user sends a code model; they stop at EOS (the answers differ in
length), so they are meant for real trained checkpoints. Prompts repeat (cycling) past the set's size.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import random
from typing import Any

from coreproc.base.errors import EmberError

WORKLOADS = ("random", "copy", "rewrite", "complete")
SOURCES = ("textwrap", "heapq", "bisect", "fractions", "string", "shlex", "calendar", "colorsys")
REWRITE_ASK = (
    "Rewrite this Python code with type hints on every function and argument. Reply with the full code only."
)
COMPLETIONS = (
    'def moving_average(values: list[float], window: int) -> list[float]:\n    """Return the mean of every '
    "run of `window` consecutive values.\n\n    >>> moving_average([1, 2, 3, 4], 2)\n    [1.5, 2.5, 3.5]\n"
    '    """\n',
    'def parse_duration(text: str) -> int:\n    """Parse a duration such as "1h30m", "45s" or "2h" into '
    'seconds.\n\n    >>> parse_duration("1h30m")\n    5400\n    """\n',
    'def is_balanced(expr: str) -> bool:\n    """Whether every bracket in expr ((), [] and {}) is closed in '
    'the right order.\n\n    >>> is_balanced("(a[b]{c})")\n    True\n    >>> is_balanced("(]")\n    False\n'
    '    """\n',
    'def top_k_words(text: str, k: int) -> list[tuple[str, int]]:\n    """The k most frequent words of '
    "text (lower-cased, split on non-letters) with their counts, most frequent first, ties in "
    'alphabetical order.\n    """\n',
    'def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:\n    """Merge '
    "overlapping closed intervals and return them sorted by start.\n\n    >>> merge_intervals([(1, 3), "
    '(2, 6), (8, 10)])\n    [(1, 6), (8, 10)]\n    """\n',
    'def roman_to_int(numeral: str) -> int:\n    """Convert a Roman numeral (I, V, X, L, C, D, M) to an '
    'integer.\n\n    >>> roman_to_int("MCMXCIV")\n    1994\n    """\n',
    'def transpose(matrix: list[list[int]]) -> list[list[int]]:\n    """Return the transpose of a '
    "rectangular matrix given as a list of rows.\n\n    >>> transpose([[1, 2, 3], [4, 5, 6]])\n"
    '    [[1, 4], [2, 5], [3, 6]]\n    """\n',
    'def run_length_encode(text: str) -> str:\n    """Encode runs of repeated characters as count and '
    'character.\n\n    >>> run_length_encode("aaabccdddd")\n    \'3a1b2c4d\'\n    """\n',
)


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """Prompt flags shared by the offline benchmarks."""
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the prompts")
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="random",
        help="random token ids; 'copy': source code, a marker and its start again; 'rewrite': a chat "
        "request to add type hints to a function; 'complete': function headers to complete "
        "(rewrite and complete stop at EOS: for real trained models)",
    )


def honors_eos(workload: str) -> bool:
    """Whether the workload's requests stop at EOS (else they run to --output-len)."""
    return workload in ("rewrite", "complete")


def make_prompts(vocab_size: int, special: set[int], n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ids = [i for i in range(vocab_size) if i not in special]
    return [[rng.choice(ids) for _ in range(length)] for _ in range(n)]


def copy_prompts(tokenizer: Any, n: int, length: int, seed: int) -> list[list[int]]:
    """`length`-token prompts: a window of a stdlib module's source, a rewrite marker, and the
    window's first tokens again, so the continuation retraces the window."""
    rng = random.Random(seed)
    marker = tokenizer.encode("\n\n# the same code, rewritten:\n", add_special_tokens=False)
    restart = 8
    body = length - len(marker) - restart
    if body < restart:
        raise EmberError(f"--input-len {length} is too short for the copy workload")
    sources = [
        tokenizer.encode(inspect.getsource(importlib.import_module(m)), add_special_tokens=False)
        for m in SOURCES
    ]
    prompts = []
    for i in range(n):
        src = sources[i % len(sources)]
        start = rng.randrange(0, max(1, len(src) - body))
        window = src[start : start + body]
        prompts.append(window + marker + window[:restart])
    return prompts


def functions_to_rewrite() -> list[str]:
    """Functions and methods of the `SOURCES` modules whose source is 0.8-2 KB, in a fixed order."""
    found = []
    for name in SOURCES:
        module = importlib.import_module(name)
        for obj in vars(module).values():
            members = vars(obj).values() if inspect.isclass(obj) else [obj]
            for fn in members:
                if inspect.isfunction(fn) and fn.__module__ == name:
                    src = inspect.getsource(fn)
                    if 800 <= len(src) <= 2000:
                        found.append(inspect.cleandoc("\n" + src) + "\n")
    return sorted(set(found))


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    """`text` as one user turn in the model's chat template (the raw text where it has none)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer.encode(text, add_special_tokens=False)


def workload_prompts(args: argparse.Namespace, tokenizer: Any, vocab_size: int, n: int) -> list[list[int]]:
    """`n` prompts of `args.workload` (`args.input_len` sets the length of random and copy)."""
    rng = random.Random(args.bench_seed)
    if args.workload == "copy":
        return copy_prompts(tokenizer, n, args.input_len, args.bench_seed)
    if args.workload == "rewrite":
        pool = functions_to_rewrite()
        rng.shuffle(pool)
        return [
            chat_prompt(tokenizer, f"{REWRITE_ASK}\n\n```python\n{pool[i % len(pool)]}```") for i in range(n)
        ]
    if args.workload == "complete":
        return [
            tokenizer.encode(COMPLETIONS[i % len(COMPLETIONS)], add_special_tokens=False) for i in range(n)
        ]
    return make_prompts(vocab_size, set(tokenizer.all_special_ids), n, args.input_len, args.bench_seed)
