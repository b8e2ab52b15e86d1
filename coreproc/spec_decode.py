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

`ProposalLength` adapts each request's k to its recent acceptance (`"adaptive": true`, the default),
weighed against what a proposed token costs (`StepCost`, measured from the steps themselves): at
batch 1 on a CPU one more verified token costs a few percent of a step and a draft token more, and
a large batch pays more per token, so a request proposes as far as it pays and stops where it
does not.
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


MAX_PAUSE = 32  # a draft model that stopped proposing tries one token again after at most this many steps
DECAY = 0.9  # weight of older verifications in a request's acceptance estimate
RIDGE = 4.0  # sizes squared: a fitted slope's shrinkage, strong below a spread of about 2
PRIOR_COST = 0.05  # one more verified token's share of a step until steps of several sizes were timed


@dataclass
class Line:
    """An exponentially weighted least-squares line of seconds against a size (tokens, rows)."""

    decay: float = 0.95
    n: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0

    def record(self, x: float, y: float) -> None:
        d = self.decay
        self.n, self.sum_x, self.sum_y = d * self.n + 1, d * self.sum_x + x, d * self.sum_y + y
        self.sum_xx, self.sum_xy = d * self.sum_xx + x * x, d * self.sum_xy + x * y

    def fit(self) -> tuple[float, float, float | None]:
        """(mean size, mean seconds, slope: None until sizes of more than one value were seen)."""
        mean_x, mean_y = self.sum_x / self.n, self.sum_y / self.n
        var = self.sum_xx / self.n - mean_x * mean_x
        if var <= 0.25:
            return mean_x, mean_y, None
        # shrunk toward zero while the sizes seen are close together: an overestimate there stops
        # every proposal and so keeps the sizes close (it never corrects), an underestimate widens
        # them (and is measured away)
        slope = (self.sum_xy / self.n - mean_x * mean_y) / (var + RIDGE)
        return mean_x, mean_y, max(0.0, slope)

    def at(self, x: float) -> float:
        """Seconds at size x (flat where only one size was seen: a CPU's few-row forwards are bound
        by reading the weights, whatever the rows)."""
        mean_x, mean_y, slope = self.fit()
        return max(1e-9, mean_y + (slope or 0.0) * (x - mean_x))


@dataclass
class StepCost:
    """What one more token costs, as a share of a step: a line through the recent decode steps'
    forward seconds against their token counts, and one through the draft model's short forwards
    (one or two tokens a request; a prompt's catch-up is paid once per request, whatever it
    proposes) against their rows."""

    steps: Line = field(default_factory=Line)
    draft: Line = field(default_factory=Line)

    def record(self, tokens: int, seconds: float) -> None:
        """A step that only decoded (and verified): its token count and forward seconds."""
        self.steps.record(tokens, seconds)

    def record_draft(self, forwards: list[tuple[int, float]]) -> None:
        """A step's short draft forwards: (rows, seconds) each."""
        for rows, seconds in forwards:
            self.draft.record(rows, seconds)

    def shares(self, requests: int = 1) -> tuple[float, float]:
        """(verify, draft): one more verified token and one more drafted token of one request, as
        shares of that request's part of a plain decode step of `requests` requests (its time
        divided by them). Against the plain step, not the step as speculation already made it: a
        batch whose every request speculates pays all their tokens, and on a CPU past a few rows
        each one can cost nearly as much as a request's whole share. A drafted token's cost is the
        request's part of a draft forward over the whole batch (the forward runs once for all the
        requests that propose; pricing it by the rows of forwards where few proposed would keep
        every request from proposing)."""
        requests = max(1, requests)
        drafted = self.draft.at(requests) / requests if self.draft.n >= 1 else 0.0
        if self.steps.n < 1:
            return PRIOR_COST * requests, 0.0
        mean_t, mean_f, slope = self.steps.fit()
        if slope is None:  # one step size so far: the prior share, and the draft against that step
            return PRIOR_COST * requests, drafted * requests / mean_f if mean_f > 0 else 0.0
        share = max(1e-9, mean_f + slope * (requests - mean_t)) / requests
        return min(1.0, slope / share), drafted / share


@dataclass
class ProposalLength:
    """How many tokens one request proposes next: the k (0 to `k_max`) that maximizes expected tokens
    per unit of step time, (1 + a + a^2 + ... + a^k) / (1 + k * (verify + draft)), where a is the
    request's recent acceptance rate per proposed token (decayed counts, a prior of one in two) and the
    costs come from `StepCost`. A request whose proposals keep failing stops proposing; an n-gram
    request (its proposals cost nothing to make) still checks its would-be proposal's first token
    against the token produced (`observe`), and a draft model, which learns only by proposing, tries
    one token again after 1, 2, 4 ... `MAX_PAUSE` steps without."""

    k_max: int
    adaptive: bool = True
    kept: float = 1.0
    trials: float = 2.0
    idle: int = 0
    backoff: int = 1
    guess: int | None = None

    @property
    def acceptance(self) -> float:
        return self.kept / self.trials

    def _count(self, kept: int, trials: int) -> None:
        self.kept, self.trials = DECAY * self.kept + kept, DECAY * self.trials + trials

    def update(self, proposed: int, accepted: int) -> None:
        """After a verification: each kept token was a trial that held, the first rejected one (if
        any) a trial that failed; tokens after it were never tried."""
        if proposed:
            self._count(accepted, accepted + (accepted < proposed))

    def choose(self, verify: float, draft: float, free: bool) -> int:
        """The proposal length for the next step (`free`: proposals cost nothing to make)."""
        if not self.adaptive:
            return self.k_max
        best, k, gain, term = 1.0, 0, 1.0, 1.0
        for j in range(1, self.k_max + 1):
            term *= self.acceptance
            gain += term
            rate = gain / (1 + j * (verify + draft))
            if rate > best:
                best, k = rate, j
        if k or free:
            self.idle, self.backoff = 0, 1
            return k
        self.idle += 1
        if self.idle < self.backoff:
            return 0
        self.idle, self.backoff = 0, min(MAX_PAUSE, 2 * self.backoff)
        return 1

    def observe(self, token: int) -> None:
        """The token a request produced without verifying proposals: was its would-be proposal right?"""
        if self.guess is not None:
            self._count(int(self.guess == token), 1)
        self.guess = None

    def take(self, proposal: list[int], verify: float) -> list[int]:
        """The part of an n-gram proposal to verify next (its first token is kept as the guess when
        none is)."""
        k = self.choose(verify, 0.0, free=True)
        self.guess = proposal[0] if not k and proposal else None
        return proposal[:k]
