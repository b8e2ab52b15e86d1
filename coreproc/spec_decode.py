"""Speculative decoding on the scheduler side: the n-gram proposer and the acceptance counters.

Runs in the scheduler process, without torch. After each step, a decoding request gets up to k
proposed tokens (`propose_ngram`: the tokens that followed the most recent earlier occurrence of
its last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`). The next step computes the
request's last token plus the proposals in one target forward; the workers sample every position and
keep proposals while they equal the target's own sample, then add the target's token at the first
mismatch (or a bonus token when all are kept). With a deterministic proposal this is exactly
rejection sampling (accept x with probability p(x), else draw from p without x), so outputs follow
the target distribution — and seeded or greedy requests produce the very tokens they would without
speculation. `SpecStats` counts proposals and acceptances per position for stats and /metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest matching suffix."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n :]
        first = suffix[0]
        # scan backwards for an earlier occurrence that has at least one token after it
        for start in range(size - n - 1, -1, -1):
            if tokens[start] == first and tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@dataclass
class SpecStats:
    """Proposed and accepted tokens, in total and by position in the proposal."""

    num_drafts: int = 0  # verification steps that carried at least one proposed token
    num_proposed: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.num_drafts += 1
        self.num_proposed += proposed
        self.num_accepted += accepted
        grow = proposed - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(proposed):
            self.proposed_per_position[i] += 1
            self.accepted_per_position[i] += i < accepted

    def as_dict(self) -> dict:
        """Counters plus the acceptance rate and the mean accepted length (tokens per verification)."""
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_num_proposed": self.num_proposed,
            "spec_num_accepted": self.num_accepted,
            "spec_acceptance_rate": self.num_accepted / self.num_proposed if self.num_proposed else 0.0,
            "spec_mean_accepted_length": 1 + self.num_accepted / self.num_drafts if self.num_drafts else 0.0,
            "spec_accepted_per_position": list(self.accepted_per_position),
            "spec_proposed_per_position": list(self.proposed_per_position),
        }
