"""The scheduler's side of speculative decoding: proposals, their lengths, the step cost model.

Runs in the scheduler process, without torch; the `Scheduler` owns one `SpecControl` when the engine
speculates and keeps the block and token bookkeeping itself. After each step it feeds the step cost
model with the workers' timings (`StepCost`), counts what the target kept (`SpecStats`, each request's
`ProposalLength`) and gives each request its next proposals: an n-gram lookup cut to the length that
pays, or the tokens the draft model proposed. Before a step it chooses the draft model's proposal
lengths for the requests the step samples, together (`plan_drafts`, with `DraftPause`'s probes).
"""

from __future__ import annotations

from coreproc.base.config import SpeculativeConfig
from coreproc.base.protocol import RunnerOutput, SchedulerOutput
from coreproc.core.ngram import (
    MAX_HORIZON,
    DraftCandidate,
    DraftPause,
    ProposalLength,
    SpecStats,
    StepCost,
    plan_drafts,
    propose_ngram,
)
from coreproc.core.request import Request


class SpecControl:
    """Proposal lengths, acceptance counters and the step cost model of one engine."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int) -> None:
        self.spec = spec
        self.max_model_len = max_model_len
        self.stats = SpecStats()
        self.cost = StepCost()  # what a proposed token costs, from the steps' own timings
        self.pause = DraftPause()  # a draft model's probes while no request drafts
        self.verify_share = 0.0  # StepCost.verify_share of the step whose output is being taken in
        # a draft model writes KV for its proposals right after sampling: the scheduler reserves them
        self.lookahead = spec.num_speculative_tokens if spec.method == "draft_model" else 0

    def length(self, req: Request) -> ProposalLength:
        if req.proposal_length is None:
            req.proposal_length = ProposalLength(self.spec.num_speculative_tokens, self.spec.adaptive)
        return req.proposal_length

    def time_step(self, sched: SchedulerOutput, out: RunnerOutput) -> None:
        """Feed the cost model: decode-only steps' forward and sampling time by token count, and the
        draft's forwards."""
        total = sched.total_num_scheduled_tokens
        spec = sched.spec_token_ids
        if total and all(n == 1 + len(spec.get(r, ())) for r, n in sched.num_scheduled_tokens.items()):
            self.cost.record(total, out.forward_seconds + out.sample_seconds)
        self.cost.record_draft(out.draft_forwards)
        self.verify_share = self.cost.verify_share(len(sched.num_scheduled_tokens))

    def verified(self, req: Request, proposed: int, tokens: list[int]) -> int:
        """Count a step's outcome for one request; returns how many of its proposals were rejected
        (their KV positions are recomputed from the right tokens)."""
        if proposed:
            kept = max(0, len(tokens) - 1)
            self.stats.record(proposed, kept)
            self.length(req).update(proposed, kept)
            return proposed - kept
        if tokens and req.proposal_length is not None:
            req.proposal_length.observe(tokens[0])
        return 0

    def propose(self, req: Request, drafted: list[int]) -> None:
        """The request's proposals for its next step: the draft's (as long as the plan said) or an
        n-gram lookup's, cut to the length that pays."""
        spec = self.spec
        if spec.method == "draft_model":
            req.spec_token_ids = drafted
            return
        guess = propose_ngram(
            req.all_token_ids, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
        req.spec_token_ids = self.length(req).take(guess, self.verify_share)

    def plan(self, reqs: list[Request], plain_tokens: int, lengths: dict[str, int]) -> None:
        """The draft's proposal lengths for the requests a step samples, chosen together, into
        `lengths` (only those below the lookahead: the workers' default)."""
        cands = []
        for req in reqs:
            length = self.length(req)
            left = self.max_model_len - req.num_tokens
            if req.sampling_params.max_tokens is not None:
                left = min(left, req.sampling_params.max_tokens - req.num_output_tokens)
            lag = max(0, req.num_tokens - length.drafted)
            cands.append(DraftCandidate(length, lag, min(MAX_HORIZON, max(1.0, left / 2))))
        ks = self.pause.probe(cands, plan_drafts(cands, plain_tokens, self.cost))
        for req, cand, k in zip(reqs, cands, ks):
            if k:  # after this step samples, the draft holds its tokens, the new one and (if kept) the k
                cand.length.drafted = req.num_tokens + 1 + k
            else:
                cand.length.relax()
            if k < self.lookahead:
                lengths[req.request_id] = k
