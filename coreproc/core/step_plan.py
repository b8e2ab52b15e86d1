"""How much of each request one step takes: the step's plan as the scheduler's phases build it, and the
token counts (a request's next chunk, a long prefill's fair share of the budget).

Runs in the core process (coreproc.core.scheduler). Pure functions of the requests and the limits they
are given, so the scheduler's phases stay short.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coreproc.core.request import Request


@dataclass
class StepPlan:
    """One step's schedule as its phases build it: tokens per request, new KV blocks, proposals to
    verify, the token budget left; `share`: a long prefill's cap (None: none), `most`: requests a step
    may hold, `preempted`: the step preempted (it then admits nobody)."""

    budget: int
    share: int | None
    most: int
    scheduled: dict[str, int] = field(default_factory=dict)
    new_blocks: dict[str, list[list[int]]] = field(default_factory=dict)  # per request and KV group
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted: bool = False

    def add_blocks(self, request_id: str, ids: list[list[int]]) -> None:
        """Blocks `request_id` gained in this step, per KV group, after those it gained before."""
        have = self.new_blocks.setdefault(request_id, [[] for _ in ids])
        for mine, more in zip(have, ids):
            mine.extend(more)

    def drop(self, request_id: str) -> None:
        """Undo a request scheduled earlier in this step (it was preempted): its tokens back."""
        self.budget += self.scheduled.pop(request_id, 0)
        self.new_blocks.pop(request_id, None)
        self.spec_tokens.pop(request_id, None)


def prefill_share(
    running: list[Request], admissible: int, token_budget: int, long_prefill: int
) -> int | None:
    """Tokens a long prefill may take this step when several prefills compete (None: no cap): the
    budget left by the decodes, split between the running prefills and the `admissible` waiting
    requests. `long_prefill`: the threshold above which a prefill is long (0: no cap ever)."""
    if not long_prefill:
        return None
    prefills = decodes = 0
    for req in running:
        if req.num_tokens + req.num_output_placeholders - req.num_computed_tokens > 1:
            prefills += 1
        else:
            decodes += 1
    prefills += admissible
    if prefills < 2:
        return None
    return max(1, (token_budget - decodes) // prefills)


def chunk(
    req: Request, computed: int, budget: int, share: int | None, long_prefill: int, max_model_len: int
) -> int:
    """The tokens `req` takes this step from `computed` on: what it has left, within the budget and the
    context; a long prefill no more than its `share`."""
    n = num_new_tokens(req, computed, budget, max_model_len)
    if share is not None and n > long_prefill:
        n = min(n, share)
    return n


def num_new_tokens(req: Request, computed: int, budget: int, max_model_len: int) -> int:
    """What `req` has left to compute from `computed` (its pending sampled token counted), within the
    budget and the context; 0 when the token a step in flight samples must be its last."""
    pending = req.num_output_placeholders
    if pending:
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None and req.num_output_tokens + pending >= max_tokens:
            return 0
        if req.num_tokens + pending >= max_model_len:
            return 0
    total = req.num_tokens + pending
    return max(0, min(total - computed, budget, max_model_len - computed))
