"""Sliding-window KV memory on the scheduler side (pure CPU, no model): groups give back the blocks
behind their window, admission counts what a request really holds, prefix hits need only the window.

The layouts come from tests/sched_util.py: SLIDING (every layer one window, as Mistral) and MIXED
(full and sliding groups, as Gemma 3). The engine-level counterparts, against transformers' tokens,
are in tests/workers/test_sliding_window_kv.py. Run: `pytest -q tests/coreproc/core/test_sliding_kv.py`.
"""

from __future__ import annotations

import random

import pytest

from coreproc.base.kv_layout import KVGroup, KVLayout, plan_layout
from coreproc.base.protocol import EngineRequest, SamplingParams
from coreproc.core.kv_cache import KVCacheManager
from coreproc.core.request import Request
from coreproc.core.scheduler import Scheduler
from tests.sched_util import MIXED, SLIDING, check_invariants, fake_runner_output, make_config

pytestmark = pytest.mark.unit

BS = 4


def drive(sched: Scheduler, reqs: list[EngineRequest], watch=None) -> int:
    """Run `reqs` to the end (fake workers), calling `watch(sched)` after each step; returns the most
    requests that decoded at once."""
    rng = random.Random(0)
    for r in reqs:
        sched.add_request(r)
    most = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        check_invariants(sched, out)
        sched.update_from_output(out, fake_runner_output(sched, out, rng))
        most = max(most, sum(r.num_computed_tokens > r.num_prompt_tokens for r in sched.running))
        if watch is not None:
            watch(sched)
    assert sched.kv.num_blocks_in_use() == 0
    return most


def long_requests(n: int, prompt: int, new: int, seed: int = 1) -> list[EngineRequest]:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=new, min_tokens=new, ignore_eos=True)
    return [
        EngineRequest(
            request_id=f"r{i}",
            prompt_token_ids=[rng.randrange(2, 50) for _ in range(prompt)],
            sampling_params=params,
        )
        for i in range(n)
    ]


def test_layout_groups_layers_by_kind():
    """Gemma 3's five sliding layers to one global become groups of the smallest kind's size; a
    window as long as the context is full attention; a model of one kind is one group."""
    windows = [8, 8, 8, 8, 8, None] * 2
    layout = plan_layout(windows, max_model_len=64)
    assert layout.windows == (8,) * 5 + (None,)
    assert [g.layers for g in layout.groups] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10), (5, 11)]
    assert layout.slots == 2 and layout.layer_groups() == (0, 0, 1, 1, 2, 5, 2, 3, 3, 4, 4, 5)
    assert layout.layer_slots() == (0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 1)
    assert plan_layout([8, 8], max_model_len=8) == KVLayout.full(2)
    assert plan_layout([4, 4, 4], 64) == KVLayout((KVGroup(4, (0, 1, 2)),))


@pytest.mark.parametrize("layout", [SLIDING, MIXED], ids=["sliding", "mixed"])
def test_long_request_holds_only_its_window(layout):
    """A 40-token prompt decoding 60 more: while it decodes, each sliding group holds at most
    window / block_size + 1 blocks (the window of 8 over blocks of 4: 3), a full group all of them."""
    sched = Scheduler(make_config(budget=16, block_size=BS), 200, layout)
    seen: list[list[int]] = []

    def watch(s: Scheduler) -> None:
        for req in s.running:
            if req.num_computed_tokens > req.num_prompt_tokens:  # decoding
                seen.append(s.kv.held_blocks(req))
                for held, group in zip(seen[-1], layout.groups, strict=True):
                    if group.window is None:
                        assert held == -(-req.num_computed_tokens // BS)
                    else:
                        assert held <= group.window // BS + 1, (held, group.window)

    drive(sched, long_requests(1, 40, 60), watch)
    assert len(seen) == 58  # every decode step but the first and the last (which frees it all)


def test_more_long_requests_fit_when_windows_give_blocks_back():
    """The same cache (40 blocks of 4) decodes all six 60-token prompts at once when the window's
    blocks are given back, two when every block is kept (and then preempts)."""
    runs = {}
    for name, layout in (("kept", KVLayout.full(1)), ("freed", SLIDING)):
        sched = Scheduler(make_config(budget=64, block_size=BS), 41, layout)
        runs[name] = drive(sched, long_requests(6, 60, 20)), sched.counters.num_preemptions
    assert runs["kept"][0] == 2 and runs["kept"][1] > 0
    assert runs["freed"] == (6, 0)


def request(tokens: list[int], rid: str = "b") -> Request:
    return Request(
        EngineRequest(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=4)),
        0,
    )


def test_prefix_hit_needs_only_the_window_of_sliding_groups():
    """After a 33-token request, the same prompt hits 8 blocks: the full group all of them, a sliding
    group (window 8, blocks of 4) only the 2 its first new token sees, the rest the null block.
    Evicting a sliding group's old blocks keeps the hit; evicting its last block shortens the hit to
    the last run of 2 cached blocks; a full group's missing block bounds it, and a bound with no
    window cached before it leaves no hit."""
    layout = KVLayout((KVGroup(None, (0,)), KVGroup(8, (1,))))
    kv = KVCacheManager(40, BS, True, hash_seed=1, layout=layout)
    prompt = list(range(2, 35))
    first = request(prompt, "a")
    assert kv.allocate_slots(first, len(prompt)) is not None
    kv.free(first)

    def hit() -> tuple[list[list[int]], int]:
        blocks, n = kv.get_computed_blocks(request(prompt))
        return [[b.block_id for b in g] for g in blocks], n

    (full, sliding), n = hit()
    assert n == 32 and len(full) == 8 and sliding[:6] == [kv.null.block_id] * 6 and 0 not in sliding[6:]
    hashes = first.block_hashes

    def evict(group: int, index: int) -> None:
        kv.pool.cached.pop((group, hashes[index])).block_hash = None

    for i in range(4):
        evict(1, i)
    assert hit()[1] == 32
    evict(1, 7)
    assert hit()[1] == 28  # blocks 5 and 6 cover the window of position 28
    evict(0, 6)
    assert hit()[1] == 24  # blocks 4 and 5
    evict(0, 2)
    assert hit()[1] == 0  # the sliding group's blocks 0 and 1 are gone


def test_prefix_hits_on_mixed_groups_admit_and_finish():
    """Requests sharing a long prefix on the mixed layout: later ones hit the cache, every block is
    accounted for at each step, and none is left in use."""
    rng = random.Random(3)
    prefix = [rng.randrange(2, 50) for _ in range(28)]
    params = SamplingParams(max_tokens=12, min_tokens=12, ignore_eos=True)
    reqs = [
        EngineRequest(
            request_id=f"r{i}",
            prompt_token_ids=prefix + [rng.randrange(2, 50) for _ in range(5)],
            sampling_params=params,
        )
        for i in range(4)
    ]
    sched = Scheduler(make_config(budget=40, block_size=BS, max_num_seqs=1), 120, MIXED)
    drive(sched, reqs)
    assert sched.kv.hits >= 3 * 24
