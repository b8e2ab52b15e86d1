"""`ember bench latency`: batch-1 decode latency through the real in-process engine, against memory bandwidth.

Streams one random token-id prompt at a time (fixed seed, greedy, ignore_eos, a fresh prompt per
iteration so the prefix cache never hits) through `LLM.stream` and times each request end to end and
to its first token. Decode at batch 1 is memory-bound: every engine step reads all weights plus the KV
cache written so far (with speculative decoding one step may yield several tokens, so steps are
counted), and the figures are set against a torch copy/sum microbenchmark of the device's memory
bandwidth. Prints one readable table and a summary line; `--result-json` writes the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import msgspec

from coreproc.base.config import ConfigError, EngineConfig
from coreproc.base.protocol import SamplingParams, SchedulerStats, WorkerReady
from frontend.bench.workloads import add_workload_arguments, honors_eos, workload_prompts

if TYPE_CHECKING:
    from coreproc.client.llm import LLM


SPLIT = ("forward_seconds", "draft_seconds", "sample_seconds", "schedule_seconds")


@dataclass(frozen=True)
class Iteration:
    """One timed batch (one request at --batch-size 1): wall time end to end, time until every request
    has its first output token, tokens produced, and engine steps after that point."""

    latency_s: float
    ttft_s: float
    output_tokens: int
    decode_steps: int
    requests: int = 1
    prompt_tokens: int = 0
    split_s: dict[str, float] = field(default_factory=dict)  # the decode steps' `SPLIT` seconds

    @property
    def decode_s(self) -> float:
        return self.latency_s - self.ttft_s

    @property
    def decode_tokens(self) -> int:
        """Tokens after each request's first (those come from the prefill steps)."""
        return self.output_tokens - self.requests

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tpot_ms(self) -> float:
        """Time per output token of one request: batch decode time over its mean token count."""
        return 1000 * self.decode_s * self.requests / max(1, self.decode_tokens)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3, help="timed requests")
    p.add_argument("--num-iters-warmup", type=int, default=1, help="untimed requests first")
    p.add_argument("--batch-size", type=int, default=1, help="requests decoded together per iteration")
    add_workload_arguments(p)
    p.add_argument("--bandwidth-mib", type=int, default=512, help="buffer size of the bandwidth test")
    p.add_argument("--result-json", default=None, help="also write the figures to this file")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def measure_bandwidth(device: str = "cpu", nbytes: int = 512 * 2**20, reps: int = 5) -> dict[str, float]:
    """Best-of-``reps`` memory bandwidth of ``device`` in GB/s (1e9 bytes/s) over a float32 buffer.

    ``read_gbps`` times a sum (reads ``nbytes``), ``copy_gbps`` a copy (reads and writes ``nbytes``);
    ``ceiling_gbps`` is the larger, the figure a memory-bound decode step is compared against.
    """
    import torch

    src = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    size = src.numel() * src.element_size()
    src.sum()  # first touch: page in and warm up
    dst.copy_(src)
    read_s = copy_s = float("inf")
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        src.sum()
        _sync(device)
        read_s = min(read_s, time.perf_counter() - start)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        copy_s = min(copy_s, time.perf_counter() - start)
    read, copy = size / read_s / 1e9, 2 * size / copy_s / 1e9
    return {"read_gbps": read, "copy_gbps": copy, "ceiling_gbps": max(read, copy)}


def time_request(
    llm: LLM, prompts: list[list[int]] | list[int], params: SamplingParams, device: str
) -> Iteration:
    """Stream ``prompts`` (token-id lists, or one) through ``llm`` (an `LLM`) together, timing the
    point where each has its first token and the end."""
    if prompts and isinstance(prompts[0], int):
        prompts = [prompts]  # type: ignore[list-item]
    _sync(device)
    start = time.perf_counter()
    ttft, produced, started = None, 0, set()
    before = llm.stats()
    for delta in llm.stream(prompts, params):
        if delta.token_ids:
            started.add(delta.request_id)
            if ttft is None and len(started) == len(prompts):
                ttft = time.perf_counter() - start
                before = llm.stats()
        produced += len(delta.token_ids)
    _sync(device)
    latency = time.perf_counter() - start
    after = llm.stats()
    split = {k: getattr(after, k) - getattr(before, k) for k in SPLIT}
    first = ttft if ttft is not None else latency
    steps = after.num_steps - before.num_steps
    return Iteration(latency, first, produced, steps, len(prompts), sum(map(len, prompts)), split)


def step_weight_bytes(ready: list[WorkerReady], batch: int) -> int:
    """The weight bytes a decode step of `batch` requests reads: all of them, but of a mixture of
    experts' routed experts only those chosen: top-k of E for one token, and for a batch the share a
    uniform routing touches, 1 - (1 - k / E) ** batch."""
    total = sum(r.weight_bytes for r in ready)
    experts, share = sum(r.expert_bytes for r in ready), ready[0].expert_share
    return round(total - experts * (1 - share) ** batch) if experts else total


def summarize(iters: list[Iteration], weight_bytes: int, kv_bytes_per_token: float, bandwidth: dict) -> dict:
    """The reported figures: latency statistics, decode speed and the achieved memory bandwidth.

    A decode step that produces a request's token j (j >= 2) reads the weights (`step_weight_bytes`:
    of a mixture of experts, the chosen experts') and the KV of its prompt + j - 1 earlier positions;
    averaged over the decode steps that is prompt + output / 2
    positions per request (means over the iterations), times the batch. Achieved bandwidth counts
    engine steps, so a speculative step that yields several tokens reads the weights once.
    """
    latencies = [it.latency_s for it in iters]
    requests = sum(it.requests for it in iters)
    batch = iters[0].requests
    decode_tokens = sum(it.decode_tokens for it in iters)
    decode_s = sum(it.decode_s for it in iters)
    decode_tps = decode_tokens / decode_s if decode_s > 0 else 0.0
    decode_steps = sum(it.decode_steps for it in iters)
    steps_per_s = decode_steps / decode_s if decode_s > 0 else 0.0
    mean_context = (
        sum(it.prompt_tokens for it in iters) + sum(it.output_tokens for it in iters) / 2
    ) / requests
    kv_bytes_per_step = kv_bytes_per_token * mean_context * batch
    bytes_per_step = weight_bytes + kv_bytes_per_step
    achieved = bytes_per_step * steps_per_s / 1e9
    tokens_per_step = decode_tokens / max(1, decode_steps)
    return dict(
        latencies_s=latencies,
        ttfts_s=[it.ttft_s for it in iters],
        mean_latency_s=statistics.fmean(latencies),
        median_latency_s=statistics.median(latencies),
        p90_latency_s=percentile(latencies, 90),
        mean_ttft_s=statistics.fmean(it.ttft_s for it in iters),
        decode_tps=decode_tps,
        tpot_ms=1000 / decode_tps if decode_tps > 0 else 0.0,
        decode_steps=decode_steps,
        tokens_per_step=tokens_per_step,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_bytes_per_token,
        mean_context=mean_context,
        kv_bytes_per_step=kv_bytes_per_step,
        bytes_per_step=bytes_per_step,
        achieved_gbps=achieved,
        **bandwidth,
        bandwidth_fraction=achieved / bandwidth["ceiling_gbps"],
        roofline_tps=bandwidth["ceiling_gbps"] * 1e9 / bytes_per_step * tokens_per_step,
    )


def print_report(head: str, iters: list[Iteration], r: dict, buffer_mib: int) -> None:
    """One table (a row per iteration, then mean/median/p90) and the bandwidth and summary lines."""
    print(head)
    print(f"{'iter':<8}{'latency s':>11}{'TTFT ms':>10}{'decode tok/s':>14}{'ms/token':>10}{'steps':>8}")
    for i, it in enumerate(iters, 1):
        print(
            f"{i:<8}{it.latency_s:>11.3f}{1000 * it.ttft_s:>10.2f}{it.decode_tps:>14.1f}{it.tpot_ms:>10.2f}"
            f"{it.decode_steps:>8}"
        )
    columns = [
        [it.latency_s for it in iters],
        [1000 * it.ttft_s for it in iters],
        [it.decode_tps for it in iters],
        [it.tpot_ms for it in iters],
        [it.decode_steps for it in iters],
    ]
    for name, fn in (
        ("mean", statistics.fmean),
        ("median", statistics.median),
        ("p90", lambda v: percentile(v, 90)),
    ):
        a, b, c, d, e = (float(fn(col)) for col in columns)
        print(f"{name:<8}{a:>11.3f}{b:>10.2f}{c:>14.1f}{d:>10.2f}{e:>8.1f}")
    mib = 2**20
    print(
        f"bytes per decode step: weights {r['weight_bytes'] / mib:.2f} MiB + "
        f"KV {r['kv_bytes_per_step'] / mib:.2f} MiB (mean context {r['mean_context']:.0f} tokens) "
        f"= {r['bytes_per_step'] / mib:.2f} MiB; {r['tokens_per_step']:.2f} tokens per step"
    )
    print(
        f"memory bandwidth: achieved {r['achieved_gbps']:.2f} GB/s; ceiling {r['ceiling_gbps']:.2f} GB/s "
        f"(sum {r['read_gbps']:.2f}, copy {r['copy_gbps']:.2f}; {buffer_mib} MiB float32 buffer)"
    )
    print(
        f"summary: {r['decode_tps']:.1f} decode tok/s ({r['tpot_ms']:.2f} ms/token), "
        f"{r['mean_latency_s']:.3f} s per request, TTFT {1000 * r['mean_ttft_s']:.1f} ms; "
        f"{100 * r['bandwidth_fraction']:.1f}% of the memory ceiling (roofline {r['roofline_tps']:.0f} tok/s)"
    )


def step_report(iters: list[Iteration], before: SchedulerStats, after: SchedulerStats) -> dict:
    """What the timed iterations' decode steps cost, split (ms per step: target forwards with their
    verification, draft forwards, sampling, the scheduler's own work), and with speculation the
    acceptance by position over those iterations (`before` / `after`: the engine's stats around them)."""
    steps = max(1, sum(it.decode_steps for it in iters))
    split = {k.replace("_seconds", "_ms"): 1000 * sum(it.split_s[k] for it in iters) / steps for k in SPLIT}
    proposed = [
        a - b
        for a, b in itertools.zip_longest(
            after.spec_proposed_per_position, before.spec_proposed_per_position, fillvalue=0
        )
    ]
    accepted = [
        a - b
        for a, b in itertools.zip_longest(
            after.spec_accepted_per_position, before.spec_accepted_per_position, fillvalue=0
        )
    ]
    drafts = after.spec_num_drafts - before.spec_num_drafts
    spec = dict(
        num_drafts=drafts,
        num_proposed=sum(proposed),
        num_accepted=sum(accepted),
        acceptance_rate=sum(accepted) / sum(proposed) if sum(proposed) else 0.0,
        mean_accepted_length=1 + sum(accepted) / drafts if drafts else 0.0,
        acceptance_per_position=[a / p if p else 0.0 for a, p in zip(accepted, proposed)],
        proposed_per_position=proposed,
    )
    return {"step_split_ms": split, "speculation": spec if drafts else {}}


def print_steps(r: dict) -> None:
    split = r["step_split_ms"]
    print("per decode step: " + ", ".join(f"{k.removesuffix('_ms')} {v:.1f} ms" for k, v in split.items()))
    spec = r["speculation"]
    if spec:
        per_pos = " ".join(f"{a:.0%}" for a in spec["acceptance_per_position"])
        print(
            f"speculation: {spec['num_drafts']} verifications, acceptance {spec['acceptance_rate']:.1%} "
            f"({spec['num_accepted']}/{spec['num_proposed']}), mean accepted length "
            f"{spec['mean_accepted_length']:.2f}; by position {per_pos} "
            f"(proposed {spec['proposed_per_position']})"
        )


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    from coreproc.client.llm import LLM

    if (
        min(args.input_len, args.batch_size, args.num_iters) < 1
        or args.output_len < 2
        or args.num_iters_warmup < 0
    ):
        raise ConfigError(
            "need --input-len, --batch-size, --num-iters >= 1, --output-len >= 2, --num-iters-warmup >= 0"
        )
    eos = honors_eos(args.workload)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=not eos)
    with LLM(config=config, show_progress=False) as llm:
        n = (args.num_iters_warmup + args.num_iters) * args.batch_size
        prompts = workload_prompts(args, llm.tokenizer, config.model.vocab_size, n)
        longest = max(map(len, prompts))
        if longest + args.output_len > config.model.max_model_len:
            raise ConfigError(
                f"prompt ({longest} tokens) + --output-len ({args.output_len}) exceeds max_model_len "
                f"{config.model.max_model_len}"
            )
        ready = llm.engine.executor.ready
        device = ready[0].device
        batches = [prompts[i : i + args.batch_size] for i in range(0, n, args.batch_size)]
        for batch in batches[: args.num_iters_warmup]:
            time_request(llm, batch, params, device)
        before = llm.stats()
        iters = [time_request(llm, batch, params, device) for batch in batches[args.num_iters_warmup :]]
        steps = step_report(iters, before, llm.stats())
        bandwidth = measure_bandwidth(device, args.bandwidth_mib * 2**20)
    if device.startswith("cuda"):  # each rank reads its own shard from its own memory
        bandwidth["ceiling_gbps"] *= len(ready)
    if not eos:
        assert all(it.output_tokens == args.output_len * it.requests for it in iters), (
            "ignore_eos run stopped early"
        )
    weight_bytes = step_weight_bytes(ready, args.batch_size)
    kv_per_token = sum(r.kv_bytes_per_block for r in ready) / config.cache.block_size
    result = summarize(iters, weight_bytes, kv_per_token, bandwidth)
    spec = config.speculative
    result = dict(
        model=config.model.model,
        dtype=config.model.dtype,
        device=device,
        tensor_parallel_size=len(ready),
        workload=args.workload,
        batch_size=args.batch_size,
        input_len=args.input_len,
        output_len=args.output_len,
        num_iters=args.num_iters,
        speculative_config=msgspec.to_builtins(dataclasses.replace(spec, draft=None)) if spec else None,
        iterations=[asdict(it) for it in iters],
        **result,
        **steps,
    )
    lengths = "stop at EOS" if eos else "ignore EOS"
    mean_prompt = sum(it.prompt_tokens for it in iters) / sum(it.requests for it in iters)
    head = (
        f"model {config.model.model} ({config.model.dtype} on {device}, tp {len(ready)}), "
        f"batch {args.batch_size}, workload {args.workload} (mean prompt {mean_prompt:.0f} tokens, up to "
        f"{args.output_len} out greedy, {lengths}), {args.num_iters} iterations after "
        f"{args.num_iters_warmup} warm-up"
    )
    print_report(head, iters, result, args.bandwidth_mib)
    print_steps(result)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    sys.stdout.flush()
    return 0
