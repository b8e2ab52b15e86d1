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
batch 1 on a CPU one more verified token costs a few percent of a step, and a large batch pays more
per token. An n-gram request proposes as far as it pays on its own. A draft model's forward costs
much the same for one request as for several (it reads the draft's weights), and a request it skipped
must be caught up over the tokens it missed before it proposes again, so `plan_drafts` chooses for the
requests of a step together: which of them propose, and how far, or none.
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


DECAY = 0.9  # weight of older verifications in a request's acceptance estimate
RELAX = 0.98  # per step left out of a draft plan: the acceptance estimate drifts back to the prior
RIDGE = 4.0  # sizes squared: a fitted slope's shrinkage, strong below a spread of about 2
PRIOR_COST = 0.05  # one more verified token's share of a step until steps of several sizes were timed
MAX_HORIZON = 32  # steps a draft's catch-up over a paused request's tokens is spread over, at most
MAX_PAUSE = 32  # steps without a draft forward before one request probes again, at most
WARMUP = 2  # first timings of each kind left out: a process's first forwards pay one-off set-up
TRUSTED = 2.5  # decayed timings a line needs before plan_drafts weighs the batch with it


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
    """What speculation costs, in seconds: a line through the recent decode steps' forward and
    sampling seconds against their token counts, and one through the draft model's forwards against
    their tokens (on a CPU a draft forward costs a large fixed part, reading the weights, plus a part
    per token)."""

    steps: Line = field(default_factory=Line)
    draft: Line = field(default_factory=Line)
    skipped: list[int] = field(default_factory=lambda: [0, 0])  # warm-up timings left out: steps, draft

    def record(self, tokens: int, seconds: float) -> None:
        """A step that only decoded (and verified): its token count and forward + sampling seconds."""
        if self.skipped[0] < WARMUP:
            self.skipped[0] += 1
        else:
            self.steps.record(tokens, seconds)

    def record_draft(self, forwards: list[tuple[int, float]]) -> None:
        """A step's draft forwards: (tokens, seconds) each."""
        for tokens, seconds in forwards:
            if self.skipped[1] < WARMUP:
                self.skipped[1] += 1
            else:
                self.draft.record(tokens, seconds)

    @property
    def trusted(self) -> bool:
        """Whether both lines have enough timings to plan with."""
        return self.steps.n >= TRUSTED and self.draft.n >= TRUSTED

    def step(self, tokens: float) -> float:
        """Seconds of a decode step of `tokens` tokens (0 before any was timed)."""
        return self.steps.at(tokens) if self.steps.n >= 1 else 0.0

    def verify(self, tokens: float) -> float:
        """Seconds one more verified token adds to a step of `tokens` tokens: the fitted slope, or the
        prior share of the step while one size was seen."""
        if self.steps.n < 1:
            return 0.0
        slope = self.steps.fit()[2]
        return PRIOR_COST * self.step(tokens) if slope is None else slope

    def verify_share(self, requests: int = 1) -> float:
        """One more verified token of one request as a share of that request's part of a plain
        decode step of `requests` requests (against the plain step, not the step as speculation made
        it: on a CPU past a few rows each verified token can cost nearly a request's whole share)."""
        requests = max(1, requests)
        if self.steps.n < 1:
            return PRIOR_COST * requests
        return min(1.0, self.verify(requests) * requests / self.step(requests))


@dataclass
class ProposalLength:
    """How many tokens one request proposes next. For n-gram proposals (`choose`): the k (0 to
    `k_max`) that maximizes expected tokens per unit of step time, (1 + a + ... + a^k) / (1 + k *
    verify), where a is the request's recent acceptance rate per proposed token (decayed counts, a
    prior of one in two) and verify the cost of a verified token (`StepCost`); a request whose
    proposals keep failing stops and still checks its would-be proposal's first token against the
    token produced (`observe`). Draft-model requests are chosen together (`plan_drafts`): a draft
    forward costs the batch the same whichever requests take part. `drafted` is how many of the
    request's tokens the draft's KV holds (the scheduler's estimate)."""

    k_max: int
    adaptive: bool = True
    kept: float = 1.0
    trials: float = 2.0
    guess: int | None = None
    drafted: int = 0

    @property
    def acceptance(self) -> float:
        return self.kept / self.trials

    def _count(self, kept: float, trials: float) -> None:
        self.kept, self.trials = DECAY * self.kept + kept, DECAY * self.trials + trials

    def update(self, proposed: int, accepted: int) -> None:
        """After a verification: each kept token was a trial that held, the first rejected one (if
        any) a trial that failed; tokens after it were never tried."""
        if proposed:
            self._count(accepted, accepted + (accepted < proposed))

    def relax(self) -> None:
        """A step without drafting: the estimate drifts back toward the prior (one in two), so a
        request paused long enough is weighed again (a draft model learns only by proposing)."""
        self.kept, self.trials = RELAX * self.kept + (1 - RELAX), RELAX * self.trials + 2 * (1 - RELAX)

    def expected(self, k: int) -> float:
        """Expected tokens a step gives with k proposals: 1 + a + ... + a^k."""
        a = self.acceptance
        return sum(a**j for j in range(k + 1))

    def choose(self, verify: float) -> int:
        """The proposal length for the next step (`verify`: a verified token's share of a step)."""
        if not self.adaptive:
            return self.k_max
        rates = [self.expected(k) / (1 + k * verify) for k in range(self.k_max + 1)]
        return max(range(self.k_max + 1), key=lambda k: (rates[k], -k))

    def observe(self, token: int) -> None:
        """The token a request produced without verifying proposals: was its would-be proposal right?"""
        if self.guess is not None:
            self._count(int(self.guess == token), 1)
        self.guess = None

    def take(self, proposal: list[int], verify: float) -> list[int]:
        """The part of an n-gram proposal to verify next (its first token is kept as the guess when
        none is)."""
        k = self.choose(verify)
        self.guess = proposal[0] if not k and proposal else None
        return proposal[:k]


@dataclass(frozen=True)
class DraftCandidate:
    """A request that samples this step, as `plan_drafts` weighs it."""

    length: ProposalLength
    lag: int  # tokens the draft's KV lacks for it (caught up in the draft's first forward)
    horizon: float  # steps a catch-up is spread over (those the request has left, at most MAX_HORIZON)


def plan_drafts(cands: list[DraftCandidate], plain_tokens: int, cost: StepCost) -> list[int]:
    """How many tokens the draft proposes for each candidate: the plan of most expected tokens per
    second among "the m requests of highest acceptance, k each" (and "none"), with the batch's
    costs: the draft's first forward (every chosen request's catch-up plus its newest token; a
    catch-up is spread over the request's horizon), k - 1 more forwards of m tokens, and the k * m
    tokens the next step verifies. Until the draft's forwards and the steps were timed a few times,
    each request takes its own n-gram-style choice at the prior cost (the first steps measure it).
    A plan of none costs nothing and teaches nothing: the caller probes now and then
    (`DraftPause`)."""
    if not cands:
        return []
    k_max = cands[0].length.k_max
    if not cands[0].length.adaptive:
        return [k_max] * len(cands)
    if not cost.trusted:
        return [c.length.choose(PRIOR_COST) for c in cands]
    plain = cost.step(plain_tokens)
    verify = cost.verify(plain_tokens)
    mean_x, mean_y, slope = cost.draft.fit()  # the draft line, read once: the loops below are per request
    slope = slope or 0.0
    produced = len(cands)
    best_rate, best_m, best_k = produced / plain, 0, 0
    order = sorted(range(len(cands)), key=lambda i: (-cands[i].length.acceptance, cands[i].lag))
    firsts, gains = [], []  # per request in that order: its part of the first forward, its gain by k
    for i in order:
        c, a = cands[i], cands[i].length.acceptance
        firsts.append(1 + c.lag / max(1.0, c.horizon))
        gains.append([sum(a**j for j in range(1, k + 1)) for k in range(k_max + 1)])
    for k in range(1, k_max + 1):
        gain, first = 0.0, 0.0
        for m in range(1, len(order) + 1):
            gain += gains[m - 1][k]
            first += firsts[m - 1]
            drafting = max(1e-9, mean_y + slope * (first - mean_x))
            drafting += (k - 1) * max(1e-9, mean_y + slope * (m - mean_x))
            rate = (produced + gain) / (plain + drafting + verify * m * k)
            if rate > best_rate:
                best_rate, best_m, best_k = rate, m, k
    ks = [0] * len(cands)
    for i in order[:best_m]:
        ks[i] = best_k
    return ks


@dataclass
class DraftPause:
    """While no request drafts, one request probes a token after 1, 2, 4 ... `MAX_PAUSE` steps: the
    one the draft holds most of (its catch-up is the shortest), so the timings and its acceptance stay
    current at a small cost, and a plan that pays again is found."""

    idle: int = 0
    backoff: int = 1

    def probe(self, cands: list[DraftCandidate], ks: list[int]) -> list[int]:
        """`ks` as planned, or with one probe where none drafts and the pause is over."""
        if any(ks) or not cands:
            self.idle, self.backoff = 0, 1
            return ks
        self.idle += 1
        if self.idle < self.backoff:
            return ks
        self.idle, self.backoff = 0, min(MAX_PAUSE, 2 * self.backoff)
        pick = min(range(len(cands)), key=lambda i: (cands[i].lag, -cands[i].length.acceptance))
        return [int(i == pick) for i in range(len(cands))]
