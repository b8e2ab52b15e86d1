"""Shared pieces of the scheduler tests: a tiny config, a fake worker step, invariants and a driver.

`run_workload` plays the engine loop over a drawn workload (arrivals, prompt and output lengths,
priorities, shared prefixes, tenant salts, aborts) with every admission control on or off, checking
the invariants after each call and, at the end, that every request finished, was aborted or was
refused with a reason, and that no block is left in use.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from coreproc.base.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from coreproc.base.errors import QueueFull
from coreproc.base.kv_layout import KVGroup, KVLayout
from coreproc.base.protocol import (
    EngineRequest,
    RunnerOutput,
    SamplingParams,
    SchedulerOutput,
    TokenLogprobs,
    WorkerReady,
)
from coreproc.core.request import RequestStatus
from coreproc.core.scheduler import Scheduler

EOS = 1
VOCAB = 50


def make_config(**kw) -> EngineConfig:
    spec_k = kw.pop("spec_k", 0)
    spec_method = kw.pop("spec_method", "ngram")
    processors = tuple(kw.pop("logits_processors", ()))
    model = ModelConfig(
        model="none",
        architecture="LlamaForCausalLM",
        dtype="float32",
        max_model_len=kw.pop("max_model_len", 128),
        vocab_size=VOCAB,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        hidden_size=8,
        tokenizer="none",
    )
    cache = CacheConfig(block_size=kw.pop("block_size", 4), enable_prefix_caching=kw.pop("prefix", True))
    sched = SchedulerConfig(
        max_num_seqs=kw.pop("max_num_seqs", 8),
        max_num_batched_tokens=kw.pop("budget", 32),
        policy=kw.pop("policy", "fcfs"),
        long_prefill_token_threshold=kw.pop("long_prefill_token_threshold", 0),
        **kw,
    )
    spec = None
    if spec_k:  # a draft model's proposals come from the (fake) workers; the scheduler needs no weights
        model_dir = "draft" if spec_method == "draft_model" else None
        spec = SpeculativeConfig(
            spec_method, num_speculative_tokens=spec_k, prompt_lookup_max=3, model=model_dir
        )
    return EngineConfig(
        model=model, cache=cache, scheduler=sched, speculative=spec, logits_processors=processors
    )


def fake_runner_output(sched: Scheduler, out, rng: random.Random) -> RunnerOutput:
    """What workers would return for a step just scheduled: a token for each request whose chunk
    reached the end of its tokens (the scheduler then holds a placeholder for it); with proposals, a
    random number of them kept, then the target's own token."""
    ids, tokens, lps = [], [], []
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        ids.append(rid)
        pending = req.num_output_placeholders
        spec = out.spec_token_ids.get(rid, [])
        if pending and req.num_computed_tokens - len(spec) == req.num_tokens + pending - 1:
            kept = spec[: rng.randrange(len(spec) + 1)]
            t = EOS if rng.random() < 0.05 else rng.randrange(2, VOCAB)
            tokens.append([*kept, t])
            lps.append([TokenLogprobs([x], [-1.0], 1) for x in tokens[-1]])
        else:
            tokens.append([])
            lps.append([])
    drafted = {}
    if sched.spec is not None and sched.spec.method == "draft_model":
        k = sched.spec.num_speculative_tokens
        drafted = {
            rid: [rng.randrange(2, VOCAB) for _ in range(rng.randrange(k + 1))]
            for rid, toks in zip(ids, tokens)
            if toks
        }
    return RunnerOutput(req_ids=ids, sampled_token_ids=tokens, logprobs=lps, spec_token_ids=drafted)


def check_invariants(sched: Scheduler, out) -> None:
    cfg = sched.config
    assert out.total_num_scheduled_tokens <= cfg.scheduler.max_num_batched_tokens
    assert len(sched.running) <= cfg.scheduler.max_running
    assert set(out.spec_token_ids) <= set(out.num_scheduled_tokens), "proposals of an unscheduled request"
    for rid, spec in out.spec_token_ids.items():
        assert out.num_scheduled_tokens[rid] == 1 + len(spec)
    kv = sched.kv
    refs: dict[int, int] = {}
    for rid, groups in kv.req_blocks.items():
        req = sched.requests[rid]
        assert req.status == RequestStatus.RUNNING, f"{req} holds blocks while not running"
        for blocks in groups:
            assert len(blocks) * kv.block_size >= req.num_computed_tokens
            for b in blocks:
                if b is not kv.null:
                    refs[b.block_id] = refs.get(b.block_id, 0) + 1
    for block in kv.pool.blocks:
        if block is kv.null:
            continue
        assert block.ref_cnt == refs.get(block.block_id, 0), f"{block} refcount drifted"
        assert (block.ref_cnt == 0) == (block.block_id in kv.pool.free)
    for req in sched.requests.values():
        proposals = len(out.spec_token_ids.get(req.request_id, ()))  # in flight, verified next update
        assert req.num_computed_tokens <= req.num_tokens + req.num_output_placeholders + proposals
        if req.status != RequestStatus.RUNNING:
            assert req.request_id not in kv.req_blocks
    waiting = list(sched.waiting)
    assert sched.waiting.num_tokens == sum(r.num_tokens for r in waiting)
    if sched.policy == "fcfs":  # resumed requests are served before any that never ran
        started = [r.num_preemptions > 0 for r in waiting]
        assert started == sorted(started, reverse=True), "a preempted request queued behind a new one"


class StuckExecutor:
    """An executor whose steps return nothing: the engine never completes a useful step."""

    ready = [
        WorkerReady(
            rank=0, num_kv_blocks=40, kv_bytes_per_block=1, weight_bytes=0, load_seconds=0, device="cpu"
        )
    ]

    def submit(self, out: SchedulerOutput) -> None:
        pass

    def wait(self) -> RunnerOutput:
        return RunnerOutput()

    def check_alive(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


@dataclass(frozen=True)
class Controls:
    """Scheduler settings a workload runs under."""

    budget: int = 32
    num_blocks: int = 40
    max_num_seqs: int = 8
    max_num_active_seqs: int | None = None
    long_prefill_token_threshold: int = 0
    max_num_queued_requests: int | None = None
    max_num_queued_tokens: int | None = None
    policy: str = "fcfs"
    prefix: bool = True
    spec_k: int = 0  # speculative decoding with this many proposals (0: off)
    spec_method: str = "ngram"  # or "draft_model": proposals come with each step's output
    layout: KVLayout | None = None  # KV groups (None: one full group); blocks scale with the groups


# KV layouts of the scheduler tests: every layer sliding (Mistral), and Gemma-like mixed groups
SLIDING = KVLayout((KVGroup(8, (0,)),))
MIXED = KVLayout((KVGroup(8, (0,)), KVGroup(None, (1,)), KVGroup(5, (2,)), KVGroup(8, (3,))))


@dataclass
class WorkloadResult:
    sched: Scheduler
    finished: set[str]
    aborted: set[str]
    refused: set[str]


def run_workload(reqs, controls: Controls, seed: int, overlap: bool = False) -> WorkloadResult:
    """Drive a scheduler through a workload, checking invariants after every call.

    Each request is (arrival step, prompt length, max tokens, priority, prefix family or None,
    abort step or None, cache salt or None). With `overlap`, step N+1 is scheduled before step N's
    output is applied (as the multiprocess core does while workers run step N)."""
    rng = random.Random(seed)
    c = controls
    cfg = make_config(
        budget=c.budget,
        max_num_seqs=c.max_num_seqs,
        policy=c.policy,
        prefix=c.prefix,
        max_model_len=64,
        max_num_active_seqs=c.max_num_active_seqs,
        long_prefill_token_threshold=c.long_prefill_token_threshold,
        max_num_queued_requests=c.max_num_queued_requests,
        max_num_queued_tokens=c.max_num_queued_tokens,
        spec_k=c.spec_k,
        spec_method=c.spec_method,
    )
    groups = 1 if c.layout is None else len(c.layout.groups)
    sched = Scheduler(cfg, c.num_blocks * groups + 1, c.layout)  # (+1: the null block)
    family = {f: [rng.randrange(2, VOCAB) for _ in range(12)] * 2 for f in (0, 1)}  # repeats: n-gram hits
    pending = sorted(enumerate(reqs), key=lambda x: x[1][0])
    finished: set[str] = set()
    aborted: set[str] = set()
    refused: set[str] = set()
    in_flight = None
    step = 0
    while pending or sched.has_unfinished_requests() or in_flight:
        while pending and pending[0][1][0] <= step:
            i, (_, plen, max_tokens, prio, fam, _, salt) = pending.pop(0)
            prompt = [rng.randrange(2, VOCAB) for _ in range(plen)]
            if fam is not None:
                prompt = (family[fam] + prompt)[:plen]
            try:
                sched.add_request(
                    EngineRequest(
                        request_id=f"r{i}",
                        prompt_token_ids=prompt,
                        sampling_params=SamplingParams(max_tokens=max_tokens),
                        eos_token_ids=[EOS],
                        priority=prio,
                        arrival_time=float(step),
                        cache_salt=salt,
                    )
                )
            except QueueFull as e:
                assert "queue is full" in str(e)
                assert len(sched.waiting) > 0, "an empty queue must take a request"
                refused.add(f"r{i}")
        for i, r in enumerate(reqs):
            if r[5] == step and f"r{i}" in sched.requests:
                for o in sched.abort_requests([f"r{i}"]):
                    assert o.finish_reason == "abort"
                    aborted.add(o.request_id)
        out = sched.schedule()
        check_invariants(sched, out)
        result = fake_runner_output(sched, out, rng)
        applied = (out, result)
        if overlap:
            applied, in_flight = in_flight, ((out, result) if out.total_num_scheduled_tokens else None)
        if applied is not None:
            out, result = applied
            for o in sched.update_from_output(out, result):
                if o.finished:
                    finished.add(o.request_id)
            check_invariants(sched, out)
        step += 1
        assert step < 5000, "scheduler made no progress"
    if overlap and in_flight:
        sched.update_from_output(*in_flight)
    assert finished | aborted | refused == {f"r{i}" for i in range(len(reqs))}
    assert sched.kv.num_blocks_in_use() == 0
    assert not sched.requests
    return WorkloadResult(sched, finished, aborted, refused)
