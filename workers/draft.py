"""The draft model of speculative decoding, inside a worker: its own KV cache, the target's blocks.

Runs in the worker process next to the target model. The draft's KV tensors have the same number of
blocks as the target's and are indexed by the same block tables, so preemption and freeing need no
extra bookkeeping. The draft never runs the target's steps: after sampling, `propose` first catches
each request up — one forward over the tokens its KV lacks (the whole prompt the first time, then
usually the newest token, or the last proposal and the newest token when all proposals were kept) —
and then continues greedily for up to the request's k tokens, writing draft KV into the lookahead
slots the scheduler reserved (never past the request's blocks or the context). A request with k = 0
(its speculation paused) costs the draft nothing until it proposes again. What the draft's KV holds is
tracked per request (`DraftState`), and a new request (prefix-cache hits included) starts from zero:
a cached block carries the target's KV, not necessarily the draft's. Greedy proposals are a
deterministic function of the context, so the target's keep-while-equal verification stays exact.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels import AttentionMetadata
from workers.models.fused_decode import Forward
from workers.models.llama import LlamaForCausalLM


@dataclass
class DraftState:
    """Which positions of one request the draft's KV holds: all before `computed`, and after it the
    tokens of `pending` (its last proposals), valid only where the request's tokens turn out equal."""

    computed: int = 0
    pending: list[int] = field(default_factory=list)

    def settle(self, token: Callable[[int], int], num_tokens: int) -> int:
        """Advance `computed` over the pending proposals the request kept, short of its last token
        (the next forward starts from it: its logits give the first proposal); returns it."""
        for t in self.pending:
            if self.computed >= num_tokens - 1 or token(self.computed) != t:
                break
            self.computed += 1
        self.pending = []
        return self.computed


@dataclass(frozen=True)
class DraftJob:
    """One request to propose for: its tokens so far, blocks, draft state and how many to propose."""

    token: Callable[[int], int]  # the request's token at a position
    num_tokens: int
    block_ids: list[int]
    state: DraftState
    k: int


class DraftProposer:
    """A draft model with its KV cache; proposes tokens for the requests that just sampled."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        num_tokens: int,
        max_model_len: int,
        forward: Forward | None = None,
    ) -> None:
        self.model = model
        self.forward: Forward = model if forward is None else forward  # as ModelRunner.forward
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.k = num_tokens
        self.max_model_len = max_model_len
        self._forwards: list[tuple[int, float]] = []  # (tokens, seconds) of each forward

    def pop_forwards(self) -> list[tuple[int, float]]:
        """The draft forwards since the last call, catch-ups included: (tokens, seconds) each."""
        out, self._forwards = self._forwards, []
        return out

    def _step(self, ids: list[list[int]], starts: list[int], blocks: list[list[int]]) -> list[int]:
        """One draft forward: request i computes tokens `ids[i]` from position `starts[i]`; the
        greedy next token of each."""
        start = time.perf_counter()
        q_lens = [len(t) for t in ids]
        meta = AttentionMetadata.build(
            q_lens, [s + q for s, q in zip(starts, q_lens)], blocks, self.block_size, self.device
        )
        flat = [t for toks in ids for t in toks]
        positions = [p for s, q in zip(starts, q_lens) for p in range(s, s + q)]
        hidden = self.forward(
            torch.tensor(flat, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_caches,
            meta,
        )
        last = [end - 1 for end in meta.query_start_loc_cpu[1:]]
        picks = self.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
        self._forwards.append((len(flat), time.perf_counter() - start))
        return picks

    def propose(self, jobs: list[DraftJob]) -> list[list[int]]:
        """Up to `job.k` greedy tokens after each job's last token."""
        out: list[list[int]] = [[] for _ in jobs]
        limits = [
            min(
                j.k,
                self.k,
                len(j.block_ids) * self.block_size - j.num_tokens + 1,
                self.max_model_len - j.num_tokens + 1,
            )
            for j in jobs
        ]
        active = [i for i, n in enumerate(limits) if n > 0]
        if not active:
            return out
        starts = [jobs[i].state.settle(jobs[i].token, jobs[i].num_tokens) for i in active]
        ids = [[jobs[i].token(p) for p in range(s, jobs[i].num_tokens)] for i, s in zip(active, starts)]
        picks = self._step(ids, starts, [jobs[i].block_ids for i in active])
        pos = {}
        for i, token in zip(active, picks):
            out[i].append(token)
            jobs[i].state.computed = pos[i] = jobs[i].num_tokens  # the catch-up's KV is written
        for step in range(1, self.k):
            active = [i for i in active if limits[i] > step]
            if not active:
                break
            picks = self._step(
                [[out[i][-1]] for i in active], [pos[i] for i in active], [jobs[i].block_ids for i in active]
            )
            for i, token in zip(active, picks):
                jobs[i].state.pending.append(out[i][-1])  # its KV now sits at pos[i]
                out[i].append(token)
                pos[i] += 1
        return out
