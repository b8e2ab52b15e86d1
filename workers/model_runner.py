"""Executes one scheduler step on one device: inputs from the step diff, one forward, sampling.

Runs in each worker process (in-process for the offline engine). It keeps a per-request state table
updated from `SchedulerOutput` diffs (new requests in full, then new blocks only) and appends the
tokens it samples itself, so token ids never need to travel back from the scheduler (except to the
pipeline stages before the last, which sample nothing: the diff carries them). The batch is
flattened: decodes (one query token) first, then prefill chunks, in a single varlen forward over the
paged KV cache, through the forward the worker chose for the model (its modules, or the one-call
decode layers of workers/models/fused_decode.py). Returns a `RunnerOutput`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from coreproc.base.kv_layout import KVLayout
from coreproc.base.logits_processors import LogitsProcessor, Row
from coreproc.base.protocol import LoRARef, RunnerOutput, SamplingParams, SchedulerOutput, TokenLogprobs
from kernels import AttentionMetadata
from workers.draft import DraftJob, DraftProposer, DraftState
from workers.mm_inputs import EncoderCache, ImageEncoder, RequestImages, StepImages, gather_step_images
from workers.models.fused_decode import Forward
from workers.models.llama import LlamaForCausalLM
from workers.models.moe import ExpertCounts
from workers.sampler import Sampler, SamplerResult, SamplingBatch
from workers.structured import StructuredOutputs

if TYPE_CHECKING:
    from workers.lora import LoRAManager


@dataclass
class RequestState:
    """What a worker remembers about one running request."""

    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    block_ids: list[list[int]]  # its block table per KV group
    num_computed_tokens: int = 0
    eos_ids: list[int] = field(default_factory=list)
    draft: DraftState = field(default_factory=DraftState)  # what the draft model's KV holds
    images: RequestImages | None = None  # a prompt with images: their pixels and encoder outputs
    lora: LoRARef | None = None  # its adapter

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token(self, i: int, spec: Sequence[int] = ()) -> int:
        """Token at position i; positions past the known tokens are proposed (speculative) ones."""
        n = len(self.prompt_ids)
        if i < n:
            return self.prompt_ids[i]
        i -= n
        return self.output_ids[i] if i < len(self.output_ids) else spec[i - len(self.output_ids)]


def _adapter(state: RequestState) -> str:
    return "" if state.lora is None else state.lora.identity


def _logprob_entries(
    ids: torch.Tensor,
    lps: torch.Tensor,
    chosen: list[int],
    chosen_lp: list[float],
    ranks: list[int],
    k: list[int],
) -> list[TokenLogprobs]:
    ids_l, lps_l = ids.tolist(), lps.tolist()
    return [
        TokenLogprobs([chosen[i], *ids_l[i][: k[i]]], [chosen_lp[i], *lps_l[i][: k[i]]], ranks[i])
        for i in range(len(chosen))
    ]


@dataclass
class StepBatch:
    """One step's requests in batch order and their inputs (`ModelRunner._prepare`)."""

    req_ids: list[str]
    states: list[RequestState]
    q_lens: list[int]  # tokens scheduled per request
    seq_lens: list[int]  # each request's length at the end of this step
    specs: list[list[int]]  # proposed tokens to verify, per request
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


@dataclasses.dataclass(frozen=True)
class RunnerParts:
    """What a worker gives its runner besides the model and its KV cache, each part by name."""

    seed: int = 0
    processors: list[LogitsProcessor] | None = None  # the engine's logits processors
    draft: DraftProposer | None = None  # a draft model's proposer (speculative decoding)
    # what runs the step: the model itself (None), or its one-call decode layers (select_forward)
    forward: Forward | None = None
    structured: StructuredOutputs | None = None  # xgrammar matchers of constrained requests
    encoder_cache: EncoderCache | None = None  # a vision-language model's encoder outputs by image hash
    lora: LoRAManager | None = None  # LoRA adapter slots (--enable-lora)
    # False on pipeline stages before the last: they run their layers and hand the hidden states on
    # (in `forward`); the scheduler tells them the tokens the last stage sampled
    samples: bool = True
    layout: KVLayout | None = None  # the model's KV groups (None: one group of every layer)


class ModelRunner:
    """Owns the model, the KV cache tensors and the sampler of one worker."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        parts: RunnerParts | None = None,
    ) -> None:
        parts = RunnerParts() if parts is None else parts
        self.model = model
        self.samples = parts.samples
        self.encoder_cache = parts.encoder_cache
        self.lora = parts.lora
        self.forward: Forward = model if parts.forward is None else parts.forward
        self.expert_counts = ExpertCounts.of(model)  # MoE layers' tokens per expert, sent each step
        self.draft = parts.draft
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        layout = parts.layout
        self.layer_group = () if layout is None or len(layout.groups) == 1 else layout.layer_groups()
        self.draft_group = 0 if layout is None else layout.full_group() or 0
        self.structured = parts.structured
        self.sampler = Sampler(device, parts.seed, parts.processors, parts.structured)
        self.requests: dict[str, RequestState] = {}

    def update_states(self, out: SchedulerOutput) -> None:
        """Apply the step diff to the request table."""
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        if self.structured is not None and out.finished_req_ids:
            self.structured.forget(out.finished_req_ids)
        for new in out.new_requests:
            self.requests[new.req_id] = RequestState(
                prompt_ids=list(new.prompt_token_ids),
                output_ids=list(new.output_token_ids),
                params=new.sampling_params,
                block_ids=[list(ids) for ids in new.block_ids],
                num_computed_tokens=new.num_computed_tokens,
                eos_ids=list(new.eos_token_ids),
                images=RequestImages(list(new.mm_items)) if new.mm_items else None,
                lora=new.lora,
            )
        for cached in out.cached_requests:
            state = self.requests[cached.req_id]
            for table, ids in zip(state.block_ids, cached.new_block_ids, strict=True):
                table.extend(ids)
            state.num_computed_tokens = cached.num_computed_tokens
            if not self.samples:
                state.output_ids.extend(cached.new_token_ids)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """One step, in phases: the batch's inputs, the forward pass, sampling (and verifying
        proposals), the draft's next proposals, each request's progress."""
        self.update_states(out)
        if out.total_num_scheduled_tokens == 0:
            return RunnerOutput()
        batch = self._prepare(out)
        began = time.perf_counter()
        hidden, failed, images = self._forward(batch)
        if not self.samples:
            return RunnerOutput(forward_seconds=time.perf_counter() - began)
        output, sample_rows = self._sample(batch, hidden, began)
        output.expert_load = self.expert_counts.take() if self.expert_counts is not None else {}
        self._gather_failures(output, failed, images)
        if self.draft is not None and sample_rows:
            self._propose(batch, sample_rows, out.draft_lengths, output)
        output.prompt_logprobs = self._prompt_logprobs(
            batch.req_ids, batch.states, batch.q_lens, batch.seq_lens, hidden, batch.meta
        )
        self._advance(batch, output)
        return output

    def _prepare(self, out: SchedulerOutput) -> StepBatch:
        """The step's requests in batch order (decodes first: the attention backend runs them with
        the decode kernel; with adapters, each adapter's requests together), their tokens, positions
        and attention metadata."""
        req_ids = sorted(out.num_scheduled_tokens, key=lambda r: out.num_scheduled_tokens[r] != 1)
        if self.lora is not None:
            req_ids.sort(key=lambda r: (out.num_scheduled_tokens[r] != 1, _adapter(self.requests[r])))
        states = [self.requests[r] for r in req_ids]
        q_lens = [out.num_scheduled_tokens[r] for r in req_ids]
        seq_lens = [s.num_computed_tokens + q for s, q in zip(states, q_lens)]
        specs = [out.spec_token_ids.get(r, []) for r in req_ids]
        input_ids: list[int] = []
        positions: list[int] = []
        for s, q, end, spec in zip(states, q_lens, seq_lens, specs):
            start = end - q
            input_ids.extend(s.token(i, spec) for i in range(start, end))
            positions.extend(range(start, end))
        tables = [[s.block_ids[g] for s in states] for g in range(len(states[0].block_ids))]
        meta = AttentionMetadata.build_grouped(
            q_lens, seq_lens, tables, self.layer_group, self.block_size, self.device
        )
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        return StepBatch(req_ids, states, q_lens, seq_lens, specs, ids_t, pos_t, meta)

    def _forward(self, batch: StepBatch) -> tuple[torch.Tensor, dict[str, str], StepImages | None]:
        """The hidden states of every scheduled token; the requests whose adapter failed, the step's
        images (their embeddings replace the placeholders' first)."""
        failed = (
            {}
            if self.lora is None
            else self.lora.prepare([s.lora for s in batch.states], batch.q_lens, batch.req_ids)
        )
        images = self._step_images(batch.req_ids, batch.states, batch.q_lens, batch.seq_lens, batch.meta)
        ids_t, pos_t, meta = batch.input_ids, batch.positions, batch.meta
        if images is not None and images.rows:
            embeds = self.model.model.embed_tokens(ids_t)
            for row, rows in images.rows:
                embeds[row : row + rows.shape[0]] = rows.to(embeds.dtype)
            return self.model(ids_t, pos_t, self.kv_caches, meta, inputs_embeds=embeds), failed, images
        if self.lora is not None and self.lora.step.slots is not None:  # deltas live in the modules
            return self.model(ids_t, pos_t, self.kv_caches, meta), failed, images
        return self.forward(ids_t, pos_t, self.kv_caches, meta), failed, images

    def _sample(self, batch: StepBatch, hidden: torch.Tensor, began: float) -> tuple[RunnerOutput, list[int]]:
        """Sampled tokens of the requests whose chunk reaches their last token (one row for that
        position, plus one per proposed token to verify: row j sees the output as if proposals < j
        were accepted); the rows' batch indices."""
        states, specs, req_ids = batch.states, batch.specs, batch.req_ids
        ends = batch.meta.query_start_loc_cpu[1:]
        sample_rows = [
            i for i, (s, end) in enumerate(zip(states, batch.seq_lens)) if end == s.num_tokens + len(specs[i])
        ]
        positions_at = [
            ends[i] - 1 - len(specs[i]) + j for i in sample_rows for j in range(len(specs[i]) + 1)
        ]
        views = [(req_ids[i], states[i], specs[i][:j]) for i in sample_rows for j in range(len(specs[i]) + 1)]
        logits = self.model.compute_logits(hidden[positions_at]) if sample_rows else None
        forwarded = time.perf_counter()
        result = None if logits is None else self.sampler(logits, self._sampling_batch(views))
        output = self._collect(req_ids, states, specs, sample_rows, result)
        output.forward_seconds = forwarded - began  # on CUDA without a sync: launches, the rest lands below
        output.sample_seconds = time.perf_counter() - forwarded
        return output, sample_rows

    def _gather_failures(
        self, output: RunnerOutput, failed: dict[str, str], images: StepImages | None
    ) -> None:
        """Requests failed by structured outputs, adapters or images, and those phases' figures."""
        if self.structured is not None:
            output.failed = self.structured.pop_failed()
            output.structured_seconds = self.structured.pop_seconds()
        if failed:
            output.failed = {**output.failed, **failed}
        if images is not None:
            output.failed = {**output.failed, **images.failed}
            output.encoder_hits, output.encoder_misses = images.hits, images.misses

    def _propose(
        self, batch: StepBatch, sample_rows: list[int], lengths: dict[str, int], output: RunnerOutput
    ) -> None:
        """The draft model's next proposals for the requests that sampled (`lengths`: the
        scheduler's per-request proposal length, else the draft's k)."""
        assert self.draft is not None, "called with a draft model"
        drafting = time.perf_counter()
        jobs = []
        for i in sample_rows:
            s, k = batch.states[i], lengths.get(batch.req_ids[i], self.draft.k)
            jobs.append(DraftJob(s.token, s.num_tokens, s.block_ids[self.draft_group], s.draft, k))
        proposals = self.draft.propose(jobs)
        output.spec_token_ids = {batch.req_ids[i]: p for i, p in zip(sample_rows, proposals) if p}
        output.draft_seconds = time.perf_counter() - drafting
        output.draft_forwards = self.draft.pop_forwards()

    def _advance(self, batch: StepBatch, output: RunnerOutput) -> None:
        """Each request's computed tokens (rejected proposals not counted); images no longer needed
        released."""
        for s, q, spec, tokens in zip(batch.states, batch.q_lens, batch.specs, output.sampled_token_ids):
            s.num_computed_tokens += q - (len(spec) - max(0, len(tokens) - 1) if spec else 0)
            if s.images is not None:
                s.images.release(s.num_computed_tokens)

    def _step_images(
        self,
        req_ids: list[str],
        states: list[RequestState],
        q_lens: list[int],
        seq_lens: list[int],
        meta: AttentionMetadata,
    ) -> StepImages | None:
        """The image embeddings this step's positions take (None: no request of the step has images)."""
        if self.encoder_cache is None or not any(s.images for s in states):
            return None
        spans = [
            (rid, s.images, meta.query_start_loc_cpu[i], end - q, end)
            for i, (rid, s, q, end) in enumerate(zip(req_ids, states, q_lens, seq_lens))
        ]
        encoder = cast(ImageEncoder, self.model)  # a model with images has embed_images (the worker checks)
        return gather_step_images(encoder, self.encoder_cache, spans, self.device)

    def _sampling_batch(self, views: list[tuple[str, RequestState, list[int]]]) -> SamplingBatch:
        """One row per (request, accepted proposals before this position)."""
        outs = [s.output_ids + extra if extra else s.output_ids for _, s, extra in views]
        states = [s for _, s, _ in views]
        return SamplingBatch(
            temperature=[s.params.temperature for s in states],
            top_k=[s.params.top_k for s in states],
            top_p=[s.params.top_p for s in states],
            min_p=[s.params.min_p for s in states],
            seeds=[s.params.seed for s in states],
            output_positions=[len(o) for o in outs],
            presence_penalty=[s.params.presence_penalty for s in states],
            frequency_penalty=[s.params.frequency_penalty for s in states],
            repetition_penalty=[s.params.repetition_penalty for s in states],
            prompt_ids=[s.prompt_ids for s in states],
            output_ids=outs,
            rows=[
                Row(i, s.params, s.prompt_ids, o, s.eos_ids, rid)
                for i, ((rid, s, _), o) in enumerate(zip(views, outs))
            ],
            max_num_logprobs=max((s.params.logprobs or 0) for s in states),
            ranks=any(s.params.logprobs is not None for s in states),
        )

    def _collect(
        self,
        req_ids: list[str],
        states: list[RequestState],
        specs: list[list[int]],
        sample_rows: list[int],
        result: SamplerResult | None,
    ) -> RunnerOutput:
        """Per request: the sampled token, or with proposals, those equal to the target's own sample
        at their position, then the target's token at the first difference (or after the last)."""
        sampled: list[list[int]] = [[] for _ in req_ids]
        logprobs: list[list[TokenLogprobs]] = [[] for _ in req_ids]
        if result is not None:
            tokens = result.sampled.tolist()
            entries = _logprob_entries(
                result.top_ids,
                result.top_logprobs,
                tokens,
                result.sampled_logprob.tolist(),
                result.sampled_rank.tolist(),
                [states[i].params.logprobs or 0 for i in sample_rows for _ in range(len(specs[i]) + 1)],
            )
            row = 0
            for i in sample_rows:
                spec = specs[i]
                kept = 0
                while kept < len(spec) and tokens[row + kept] == spec[kept]:
                    kept += 1
                sampled[i] = tokens[row : row + kept + 1]
                logprobs[i] = entries[row : row + kept + 1]
                states[i].output_ids.extend(sampled[i])
                row += len(spec) + 1
        return RunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs)

    def _prompt_logprobs(
        self,
        req_ids: list[str],
        states: list[RequestState],
        q_lens: list[int],
        seq_lens: list[int],
        hidden: torch.Tensor,
        meta: AttentionMetadata,
    ) -> dict[str, list[TokenLogprobs | None]]:
        """Logprobs of each prompt token given its prefix, for the prompt positions in this chunk."""
        found: dict[str, list[TokenLogprobs | None]] = {}
        for i, (req_id, s) in enumerate(zip(req_ids, states)):
            k = s.params.prompt_logprobs
            start = seq_lens[i] - q_lens[i]
            n_prompt = len(s.prompt_ids)
            if k is None or start >= n_prompt:
                continue
            # row p of this chunk predicts token p + 1; only prompt tokens count
            last = min(seq_lens[i], n_prompt - 1)
            entries: list[TokenLogprobs | None] = [None] if start == 0 else []
            if last > start:
                base = meta.query_start_loc_cpu[i]
                logits = self.model.compute_logits(hidden[base : base + last - start])
                raw = torch.log_softmax(logits, dim=-1)
                targets = torch.tensor(s.prompt_ids[start + 1 : last + 1], device=raw.device)
                chosen = raw.gather(1, targets.unsqueeze(1)).squeeze(1)
                ranks = (raw > chosen.unsqueeze(1)).sum(dim=1) + 1
                top_lp, top_ids = raw.topk(k, dim=-1) if k > 0 else (raw[:, :0], targets[:, None][:, :0])
                entries += _logprob_entries(
                    top_ids, top_lp, targets.tolist(), chosen.tolist(), ranks.tolist(), [k] * len(targets)
                )
            found[req_id] = entries
        return found
