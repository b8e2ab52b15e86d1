"""Continuous-batching scheduler: the two-call contract `schedule()` then `update_from_output()`.

Runs in the scheduler process (coreproc); pure CPU, no tensors. There are no prefill or decode phases:
each step gives every request enough tokens for its computed count to catch up with its token count,
under a token budget, running requests first, then waiting ones (FCFS or priority), at most
`max_num_active_seqs` running. While several prefills wait, a long one (over
`long_prefill_token_threshold`) gets a fair share of the budget, floor(budget / prefills); a lone one
gets all of it. When blocks run out a running request is preempted by recompute (all its blocks freed,
queued again at the front), so a waiting request never holds blocks and none waits behind a request
that holds none. New requests beyond `max_num_queued_*` raise `QueueFull`.
`update_from_output` appends sampled tokens, applies stop conditions and frees finished requests.
With speculative decoding, a decoding request also carries proposed tokens
(`SchedulerOutput.spec_token_ids`); blocks and computed tokens cover them until the workers report
how many were kept, and the rest are rolled back; `coreproc/core/speculation.py` chooses the proposals.
With pipeline stages, requests in a step still in flight are left alone and steps are micro-batches
(`coreproc/core/micro_batches.py`).
"""

from __future__ import annotations

import time

from coreproc.base.config import EngineConfig
from coreproc.base.errors import InvalidParam
from coreproc.base.kv_layout import KVLayout
from coreproc.base.logits_processors import ProcessorContext, engine_specs, load_processors
from coreproc.base.protocol import (
    CachedRequestData,
    EngineOutput,
    EngineRequest,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from coreproc.core.expert_load import ExpertLoad
from coreproc.core.kv_cache import KVCacheManager
from coreproc.core.lora_registry import LoRARegistry
from coreproc.core.micro_batches import MicroBatches
from coreproc.core.mm_store import MediaStore
from coreproc.core.request import Request, RequestStatus
from coreproc.core.scheduler_stats import StepCounters, describe, scheduler_stats
from coreproc.core.speculation import SpecControl
from coreproc.core.step_plan import StepPlan, chunk, prefill_share
from coreproc.core.waiting import WaitingQueue, validate


class Scheduler:
    """Owns requests, the waiting queue, the running list and the KV block manager."""

    def __init__(self, config: EngineConfig, num_kv_blocks: int, layout: KVLayout | None = None) -> None:
        self.config = config
        self.max_model_len = config.model.max_model_len
        self.vocab_size = config.model.vocab_size
        sc = config.scheduler
        self.max_running = sc.max_running
        self.token_budget = sc.max_num_batched_tokens
        self.long_prefill = sc.long_prefill_token_threshold
        self.policy = sc.policy
        self.limits = config.limits
        self.kv = KVCacheManager(
            num_kv_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            config.cache.prefix_hash_seed,
            layout,
        )
        ctx = ProcessorContext(config.model.vocab_size, config.model.max_model_len)
        self.processors = load_processors(engine_specs(config.logits_processors), ctx)
        self.image_token_id = config.model.image_token_id
        self.loras = LoRARegistry(config.lora)
        self.media = MediaStore(config.cache.mm_cache_bytes)
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(self.policy)
        self.running: list[Request] = []
        self._forget: list[str] = []  # requests workers must drop at the next step
        self._arrivals = 0
        self.micro = MicroBatches(config.parallel.pipeline_parallel_size)
        self.spec = config.speculative
        self.speculation = None if self.spec is None else SpecControl(self.spec, self.max_model_len)
        self.lookahead = 0 if self.speculation is None else self.speculation.lookahead
        self.counters = StepCounters()
        self.expert_load = ExpertLoad()

    # ------------------------------------------------------------------ intake

    def add_request(self, er: EngineRequest) -> None:
        """Validate and queue one request (see `add_requests`)."""
        self.add_requests([er])

    def add_requests(self, ers: list[EngineRequest]) -> None:
        """Validate and queue the sequences of one API request, all or none: raises InvalidParam for
        requests that can never run, QueueFull when the queue limits refuse them now."""
        if not ers:
            raise InvalidParam("a submission needs at least one request", "prompt")
        most = self.limits.max_seqs_per_request
        if most is not None and len(ers) > most:
            raise InvalidParam(
                f"the request has {len(ers)} sequences; this engine takes at most {most} in one request", "n"
            )
        if len({er.request_id for er in ers}) < len(ers):
            raise InvalidParam("request ids must differ within one submission", "request_id")
        for er in ers:
            if er.request_id in self.requests:
                raise InvalidParam(f"request id {er.request_id!r} is already in use", "request_id")
            validate(
                er, self.max_model_len, self.vocab_size, self.limits, self.processors, self.image_token_id
            )
        sc = self.config.scheduler
        self.waiting.admit(ers, sc.max_num_queued_requests, sc.max_num_queued_tokens)
        adapters = [self.loras.resolve(er.lora) if er.lora is not None else None for er in ers]
        images = self.media.resolve(ers) if any(er.mm_refs for er in ers) else [[] for _ in ers]
        for er, items, adapter in zip(ers, images, adapters):
            req = Request(er, self._arrivals, items, adapter)
            self._arrivals += 1
            self.requests[req.request_id] = req
            self.waiting.add(req)

    def abort_requests(self, request_ids: list[str]) -> list[EngineOutput]:
        """Abort at once: blocks freed, workers told to forget; unknown ids are ignored."""
        outputs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            outputs.append(
                EngineOutput(rid, finish_reason="abort", num_cached_tokens=max(0, req.num_cached_tokens))
            )
        return outputs

    def fail_all(self, reason: str) -> list[EngineOutput]:
        """Finish every queued or running request with an error (the engine cannot serve them)."""
        outputs = []
        for req in list(self.running) + list(self.waiting):
            (self.running.remove if req.status == RequestStatus.RUNNING else self.waiting.remove)(req)
            self._finish(req, RequestStatus.FINISHED_ERROR)
            outputs.append(EngineOutput(req.request_id, finish_reason="error", error=reason))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    # ------------------------------------------------------------------ schedule

    def _victim(self) -> Request:
        candidates = [r for r in self.running if not self.micro.busy(r)]
        if self.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time, r.arrival_seq))
        return candidates[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0  # the in-flight token, if any, is dropped and re-sampled
        req.num_preemptions += 1
        self.counters.num_preemptions += 1
        if req.in_workers:
            self._forget.append(req.request_id)
            req.in_workers = False
        self.waiting.add(req)

    def _schedule_spec(self, req: Request, plan: StepPlan) -> int:
        """Add a decoding request's proposed tokens to its step if budget, length limits and blocks
        allow (never past max_tokens or max_model_len); returns the tokens added."""
        params = req.sampling_params
        room = self.max_model_len - req.num_tokens - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - req.num_output_tokens - 1)
        k = min(len(req.spec_token_ids), plan.budget, room)
        if k <= 0:
            return 0
        extra = self.kv.allocate_slots(req, 1 + k + self.lookahead)  # last token, proposals, lookahead
        if extra is None and self.lookahead:
            extra = self.kv.allocate_slots(req, 1 + k)
        if extra is None:
            return 0
        plan.spec_tokens[req.request_id] = req.spec_token_ids[:k]
        plan.scheduled[req.request_id] += k
        plan.add_blocks(req.request_id, extra)
        return k

    def _samples(self, req: Request, n: int) -> bool:
        """Whether computing `n` more tokens (proposals excluded) reaches the request's end."""
        return req.num_computed_tokens + n >= req.num_tokens + req.num_output_placeholders

    def _reserve_lookahead(self, req: Request, n: int, plan: StepPlan) -> None:
        """Slots for the draft's proposals if this step samples the request (best effort: without
        them the draft proposes fewer tokens)."""
        if not self._samples(req, n):
            return  # a prefill chunk that samples nothing
        ids = self.kv.allocate_slots(req, n + self.lookahead)
        if ids is not None:
            plan.add_blocks(req.request_id, ids)

    def _prefill_share(self) -> int | None:
        waiting = min(len(self.waiting), max(0, self.max_running - len(self.running)))
        return prefill_share(self.running, waiting, self.token_budget, self.long_prefill)

    def _chunk(self, req: Request, computed: int, budget: int, share: int | None) -> int:
        return chunk(req, computed, budget, share, self.long_prefill, self.max_model_len)

    def schedule(self) -> SchedulerOutput:
        start = time.perf_counter()
        out = self._schedule()
        self.counters.schedule_seconds += time.perf_counter() - start
        return out

    def _schedule(self) -> SchedulerOutput:
        """One step, in phases: the running requests (preempting when the cache is full), then the
        waiting ones admitted into what is left, then the step's message to the workers."""
        plan = StepPlan(
            budget=self.token_budget,
            share=self._prefill_share(),
            most=self.micro.step_seqs(len(self.running) + len(self.waiting)),
        )
        self._schedule_running(plan)
        if not plan.preempted:  # a step that preempts admits nobody
            self._admit_waiting(plan)
        return self._emit(plan)

    def _schedule_running(self, plan: StepPlan) -> None:
        """Each running request's next chunk (a decode token, a prefill chunk, proposals to verify),
        in order, while the budget lasts; a full cache preempts the victim policy's choice."""
        i = 0
        while i < len(self.running) and plan.budget > 0 and len(plan.scheduled) < plan.most:
            req = self.running[i]
            n = (
                0
                if self.micro.busy(req)
                else self._chunk(req, req.num_computed_tokens, plan.budget, plan.share)
            )
            if n == 0:
                i += 1
                continue
            ids = self.kv.allocate_slots(req, n)
            while ids is None:
                victim = self._victim()
                index = self.running.index(victim)
                self._preempt(victim)
                plan.preempted = True
                if victim is req:
                    break
                if index < i:  # undo a request already scheduled in this step
                    i -= 1
                    plan.drop(victim.request_id)
                ids = self.kv.allocate_slots(req, n)
            if ids is None:
                continue
            plan.scheduled[req.request_id] = n
            plan.add_blocks(req.request_id, ids)
            plan.budget -= n
            i += 1
            if req.spec_token_ids and n == 1:
                plan.budget -= self._schedule_spec(req, plan)
            elif self.lookahead:
                self._reserve_lookahead(req, n, plan)

    def _admit_waiting(self, plan: StepPlan) -> None:
        """Waiting requests, in the queue's order, while the budget, the running limit, the KV cache
        and the step's adapter limit allow (their cached prefix counted as computed)."""
        adapters = {r.lora.identity for r in self.running if r.lora is not None}  # weights, not names
        while (
            self.waiting
            and plan.budget > 0
            and len(self.running) < self.max_running
            and len(plan.scheduled) < plan.most
        ):
            req = self.waiting.peek()
            if req.lora is not None and req.lora.identity not in adapters:
                if len(adapters) >= self.loras.max_loras:
                    break  # a step mixes at most --max-loras adapters; it waits for one to finish
                adapters.add(req.lora.identity)
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            n = self._chunk(req, num_hit, plan.budget, plan.share)
            ids = self.kv.allocate_slots(req, n, hit_blocks) if n > 0 else None
            if ids is None:
                break
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            self.running.append(req)
            plan.scheduled[req.request_id] = n
            plan.budget -= n
            if self.lookahead:
                self._reserve_lookahead(req, n, plan)

    def _emit(self, plan: StepPlan) -> SchedulerOutput:
        """The step's `SchedulerOutput`: a new request whole, one the workers hold as its new blocks
        and tokens; each scheduled request's progress advanced, its sampled token counted as pending."""
        scheduled, spec_tokens = plan.scheduled, plan.spec_tokens
        out = SchedulerOutput(
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            finished_req_ids=self._forget,
            spec_token_ids=spec_tokens,
        )
        self._forget = []
        drafting: list[Request] = []  # decoding requests this step samples, with a draft model
        for req in self.running:
            num = scheduled.get(req.request_id)
            if num is None:
                continue
            if req.in_workers:
                out.cached_requests.append(
                    CachedRequestData(
                        req.request_id,
                        plan.new_blocks[req.request_id],
                        req.num_computed_tokens,
                        self.micro.new_tokens(req),
                    )
                )
            else:
                out.new_requests.append(
                    NewRequestData(
                        req.request_id,
                        req.prompt_token_ids,
                        req.sampling_params,
                        self.kv.block_ids(req),
                        req.num_computed_tokens,
                        req.output_token_ids,
                        req.eos_token_ids,
                        req.mm_refs,
                        req.lora,
                    )
                )
                req.in_workers = True
                self.micro.sent_in_full(req)
                if req.proposal_length is not None:
                    req.proposal_length.drafted = 0  # fresh worker state: the draft's KV holds none of it
            num_spec = len(spec_tokens.get(req.request_id, ()))
            if self._samples(req, num - num_spec):
                req.num_output_placeholders += 1  # this step samples a token the scheduler has not seen
                if self.lookahead:
                    drafting.append(req)
            req.num_computed_tokens += num  # with proposals: rejected ones roll back in update_from_output
        if drafting and self.speculation is not None:
            plain = out.total_num_scheduled_tokens - sum(len(t) for t in spec_tokens.values())
            self.speculation.plan(drafting, plain, out.draft_lengths)
        self.micro.started(out)
        self.counters.num_steps += 1
        return out

    # ------------------------------------------------------------------ update

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req)
        self.micro.forget(req)
        if req.in_workers:
            self._forget.append(req.request_id)
            req.in_workers = False
        del self.requests[req.request_id]

    def update_from_output(self, sched: SchedulerOutput, out: RunnerOutput) -> list[EngineOutput]:
        start = time.perf_counter()
        self.micro.done(sched)
        self.counters.add_runner_output(out)
        self.expert_load.add(out.expert_load)
        if self.speculation is not None:
            self.speculation.time_step(sched, out)
        outputs = self._take_output(sched, out)
        self.counters.schedule_seconds += time.perf_counter() - start
        return outputs

    def _take_output(self, sched: SchedulerOutput, out: RunnerOutput) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        for rid, reason in out.failed.items():  # refused by the workers (a constraint that won't compile)
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                self.running.remove(req)
                self._finish(req, RequestStatus.FINISHED_ERROR)
                outputs.append(
                    EngineOutput(
                        rid,
                        finish_reason="error",
                        error=reason,
                        error_code="invalid_request",
                        error_param="response_format",
                    )
                )
        for rid, tokens, logprobs in zip(out.req_ids, out.sampled_token_ids, out.logprobs):
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            prompt_lps = out.prompt_logprobs.get(rid)
            if prompt_lps is not None:
                start = req.num_computed_tokens - sched.num_scheduled_tokens[rid]
                prompt_lps = req.unsent_prompt_logprobs(prompt_lps, start)
            status = None
            accepted = 0
            if self.speculation is not None:  # rejected proposals' KV positions are computed again
                proposed = len(sched.spec_token_ids.get(rid, ()))
                req.num_computed_tokens -= self.speculation.verified(req, proposed, tokens)
            req.num_output_placeholders = max(0, req.num_output_placeholders - min(1, len(tokens)))
            for token in tokens:
                req.append_output_token(token)
                accepted += 1
                status = req.stop_status(token, self.max_model_len)
                if status is not None:
                    break
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
            elif tokens and self.speculation is not None:
                self.speculation.propose(req, out.spec_token_ids.get(rid, []))
            if accepted or status is not None or prompt_lps:
                outputs.append(
                    EngineOutput(
                        rid,
                        new_token_ids=list(tokens[:accepted]),
                        new_logprobs=list(logprobs[:accepted]),
                        new_prompt_logprobs=prompt_lps or [],
                        finish_reason=None if status is None else status.finish_reason,
                        stop_reason=req.stop_reason,
                        num_cached_tokens=req.num_cached_tokens,
                    )
                )
        return outputs

    # ------------------------------------------------------------------ introspection

    def stats(self) -> SchedulerStats:
        return scheduler_stats(self)

    def describe(self, limit: int = 8) -> dict:
        """The scheduler's state for a stall report (see `scheduler_stats.describe`)."""
        return describe(self, limit)
