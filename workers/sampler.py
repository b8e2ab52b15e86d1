"""Turns a batch of next-token logits into sampled tokens and their logprobs.

Runs in worker processes, after the model's logits. Order: raw logprobs (what callers see) -> the
grammar mask of structured outputs (workers/structured.py) -> logits processors (built-ins:
logit_bias, allowed_token_ids, bad_words, min_tokens; then third-party ones) -> repetition /
frequency / presence penalties -> greedy argmax, or temperature, top-k, top-p, min-p and an
exponential race (Gumbel-max) draw. A seeded request draws its noise from a generator keyed by
(seed, output position), so its tokens do not depend on what else is in the batch or on preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from coreproc.base.logits_processors import LogitsProcessor, Row
from workers.structured import StructuredOutputs

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): a well-spread 63-bit generator seed per sampled token."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one step (rows = requests that sample a token this step)."""

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    seeds: list[int | None]
    output_positions: list[int]  # index of the token being sampled within the request's output
    presence_penalty: list[float]
    frequency_penalty: list[float]
    repetition_penalty: list[float]
    prompt_ids: list[list[int]]
    output_ids: list[list[int]]
    rows: list[Row]  # what logits processors see, one per row
    max_num_logprobs: int  # top-N alternatives wanted by the most demanding row (0: none)
    ranks: bool = True  # whether any row returns logprobs (the sampled token's rank: 0 when not)


@dataclass
class SamplerResult:
    sampled: torch.Tensor  # [N] int64
    sampled_logprob: torch.Tensor  # [N] float32
    sampled_rank: torch.Tensor  # [N] int64, 1 = most likely (0: not computed, no row returns logprobs)
    top_ids: torch.Tensor  # [N, K] int64
    top_logprobs: torch.Tensor  # [N, K] float32


class Sampler:
    """Stateless apart from the generator used for unseeded requests."""

    def __init__(
        self,
        device: torch.device,
        seed: int = 0,
        processors: list[LogitsProcessor] | None = None,
        structured: StructuredOutputs | None = None,
    ) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.processors = processors or []
        self.structured = structured

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerResult:
        raw = torch.log_softmax(logits.float(), dim=-1)
        logits = logits.float().clone()
        if self.structured is not None:
            logits = self.structured.apply(logits, batch.rows)
        logits = self.apply_processors(logits, batch.rows)
        logits = self._apply_penalties(logits, batch)
        sampled = self._sample(logits, batch)
        sampled_logprob = raw.gather(1, sampled.unsqueeze(1)).squeeze(1)
        if batch.ranks:  # a pass over the whole vocabulary: only when someone reads it
            rank = (raw > sampled_logprob.unsqueeze(1)).sum(dim=1) + 1
        else:
            rank = torch.zeros_like(sampled)
        k = batch.max_num_logprobs
        top_lp, top_ids = raw.topk(k, dim=-1) if k > 0 else (raw[:, :0], sampled.new_empty(len(sampled), 0))
        return SamplerResult(sampled, sampled_logprob, rank, top_ids, top_lp)

    def apply_processors(self, logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """Each processor over the rows whose request uses it (batched per processor)."""
        for proc in self.processors:
            active = [row for row in rows if proc.is_active(row.params)]
            if active:
                logits = proc.apply(logits, active)
        return logits

    def _apply_penalties(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        n, vocab = logits.shape
        if any(p != 1.0 for p in b.repetition_penalty):
            seen = torch.zeros(n, vocab, dtype=torch.bool, device=logits.device)
            for row in range(n):
                ids = b.prompt_ids[row] + b.output_ids[row]
                if ids:
                    seen[row, torch.tensor(ids, device=logits.device)] = True
            pen = torch.tensor(b.repetition_penalty, device=logits.device).unsqueeze(1)
            logits = torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits)
        if any(b.presence_penalty) or any(b.frequency_penalty):
            counts = torch.zeros(n, vocab, dtype=torch.float32, device=logits.device)
            for row in range(n):
                if b.output_ids[row]:
                    out_ids = torch.tensor(b.output_ids[row], device=logits.device)
                    counts[row].index_add_(0, out_ids, torch.ones(len(out_ids), device=logits.device))
            freq = torch.tensor(b.frequency_penalty, device=logits.device).unsqueeze(1)
            pres = torch.tensor(b.presence_penalty, device=logits.device).unsqueeze(1)
            logits = logits - freq * counts - pres * (counts > 0).float()
        return logits

    def _sample(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        greedy_ids = logits.argmax(dim=-1)
        random_rows = [i for i, t in enumerate(b.temperature) if t >= 1e-5]
        if not random_rows:
            return greedy_ids
        rows = torch.tensor(random_rows, device=logits.device)
        x = logits[rows] / torch.tensor(
            [b.temperature[i] for i in random_rows], device=logits.device
        ).unsqueeze(1)
        x = self._filter(x, [b.top_k[i] for i in random_rows], [b.top_p[i] for i in random_rows])
        probs = torch.softmax(x, dim=-1)
        min_p = torch.tensor([b.min_p[i] for i in random_rows], device=logits.device).unsqueeze(1)
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        noise = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            seed = b.seeds[i]
            if seed is None:
                noise[j].exponential_(generator=self.generator)
            else:
                gen = torch.Generator(device=logits.device)
                gen.manual_seed(mix_seed(seed, b.output_positions[i]))
                noise[j].exponential_(generator=gen)
        greedy_ids[rows] = (probs / noise).argmax(dim=-1)
        return greedy_ids

    @staticmethod
    def _filter(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        """Mask logits outside each row's top-k and nucleus (top-p); at least one token survives."""
        vocab = x.shape[-1]
        ks = [k if 0 < k < vocab else vocab for k in top_k]
        if all(k == vocab for k in ks) and all(p >= 1.0 for p in top_p):
            return x
        sorted_x, order = x.sort(dim=-1, descending=True)
        pos = torch.arange(vocab, device=x.device).unsqueeze(0)
        drop = pos >= torch.tensor(ks, device=x.device).unsqueeze(1)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_x, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        p = torch.tensor(top_p, device=x.device).unsqueeze(1)
        sorted_x = sorted_x.masked_fill((before >= p) & (pos > 0), float("-inf"))
        return torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)
