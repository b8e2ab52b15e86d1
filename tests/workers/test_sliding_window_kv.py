"""Bounded sliding-window KV memory on real engines, against transformers' tokens.

Two tiny checkpoints built with transformers' classes: Mistral with a window of 8 on every layer (one
sliding group) and Gemma 3 with six sliding layers and one global (seven groups of one layer). With
blocks of 4 tokens, a long request's sliding groups hold at most 8 / 4 + 1 blocks each while it
decodes (read from the scheduler's KV manager after every step), its global group every block; the
same memory decodes more long requests at once than with `release_window_blocks=False`, and the
tokens are transformers' either way; prefix-cache hits on the mixed model give transformers' tokens.
The scheduler-side cases are tests/coreproc/core/test_sliding_kv.py.
Run: `pytest -q tests/workers/test_sliding_window_kv.py`.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from coreproc.base.config import EngineConfig
from coreproc.base.protocol import EngineRequest, SamplingParams
from coreproc.core.engine import EngineCore
from tests.hf_ref import check_outputs_equal, hf_greedy
from tests.workers.test_architectures import FAMILIES, SHAPES, WINDOW, kv_bytes

pytestmark = pytest.mark.model

BS = 4
NEW = 24


@pytest.fixture(scope="module", params=["mistral", "gemma3"])
def model(request: pytest.FixtureRequest, make_ckpt) -> Path:
    if request.param == "mistral":
        return make_ckpt("mistral", **SHAPES, layers=3, sliding_window=WINDOW)
    return make_ckpt("gemma3", **{**SHAPES, **FAMILIES["gemma3"]})


def prompts(n: int, length: int, seed: int, prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 400) for _ in range(prefix)]
    return [shared + [rng.randrange(3, 400) for _ in range(length - prefix)] for _ in range(n)]


def run(core: EngineCore, batch: list[list[int]], watch=None) -> list[list[int]]:
    """Greedy `NEW` tokens of each prompt, stepping the engine by hand (`watch(core)` after each)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW)
    core.add_requests(
        [
            EngineRequest(request_id=str(i), prompt_token_ids=p, sampling_params=params)
            for i, p in enumerate(batch)
        ]
    )
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(batch))}
    while core.has_unfinished_requests():
        for out in core.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
        if watch is not None:
            watch(core)
    return [tokens[str(i)] for i in range(len(batch))]


def engine(path: Path, **kw) -> EngineCore:
    config = EngineConfig.create(str(path), dtype="float32", block_size=BS, max_model_len=128, **kw)
    return EngineCore(config, show_progress=False)


def decoding(core: EngineCore) -> list:
    return [r for r in core.scheduler.running if r.num_computed_tokens > r.num_prompt_tokens]


def test_long_request_holds_window_blocks_and_keeps_tokens(model: Path) -> None:
    """A 60-token prompt decoding 24 more: each sliding group holds at most 3 blocks at every decode
    step, the global group all of them; transformers' tokens."""
    (prompt,) = prompts(1, 60, seed=1)
    held: list[list[int]] = []

    def watch(core: EngineCore) -> None:
        kv = core.scheduler.kv
        for req in decoding(core):
            held.append(kv.held_blocks(req))
            for blocks, window in zip(held[-1], kv.windows, strict=True):
                limit = -(-req.num_computed_tokens // BS) if window is None else WINDOW // BS + 1
                assert blocks <= limit and (window is not None or blocks == limit), (held[-1], window)

    core = engine(model, max_num_batched_tokens=16)
    try:
        ours = run(core, [prompt], watch)
        windows = core.scheduler.kv.windows
    finally:
        core.shutdown()
    check_outputs_equal(ours, [hf_greedy(str(model), prompt, NEW)[0]])
    assert len(held) == NEW - 2  # every decode step but the first and the last
    assert (None in windows) == (model.name.startswith("gemma3")) and WINDOW in windows


def test_same_memory_decodes_more_long_requests(model: Path) -> None:
    """Memory for 60 blocks of every layer: six 60-token prompts all decode at once when windows give
    their blocks back (Mistral; Gemma 3's global layer keeps its own), fewer when every block is kept;
    the tokens are the same and transformers'."""
    batch = prompts(6, 60, seed=2)
    memory = kv_bytes(model, 60, BS)
    most, tokens = {}, {}
    for release in (True, False):
        core = engine(model, kv_cache_memory=memory, release_window_blocks=release)
        seen: list[int] = [0]
        try:
            tokens[release] = run(core, batch, lambda c, seen=seen: seen.append(len(decoding(c))))
        finally:
            core.shutdown()
        most[release] = max(seen)
    assert most[False] < most[True] == 6, most
    assert tokens[True] == tokens[False]
    check_outputs_equal(tokens[True][:2], [hf_greedy(str(model), p, NEW)[0] for p in batch[:2]])


def test_prefix_hits_keep_transformers_tokens(model: Path) -> None:
    """Prompts sharing 40 tokens (ten blocks, five windows): the second run hits the cache in every
    group and still gives transformers' tokens."""
    batch = prompts(3, 52, seed=3, prefix=40)
    core = engine(model, enable_prefix_caching=True, max_num_batched_tokens=16)
    try:
        first = run(core, batch[:1])
        rest = run(core, batch[1:])
        hits = core.stats().prefix_cache_hits
    finally:
        core.shutdown()
    assert hits >= 2 * 40
    check_outputs_equal(first + rest, [hf_greedy(str(model), p, NEW)[0] for p in batch])
