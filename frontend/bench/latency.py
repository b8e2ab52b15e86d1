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
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from coreproc.config import ConfigError, EngineConfig
from coreproc.protocol import SamplingParams
from frontend.bench.throughput import add_workload_arguments, workload_prompts

if TYPE_CHECKING:
    from coreproc.llm import LLM


@dataclass(frozen=True)
class Iteration:
    """One timed request: wall time end to end, time to its first output token, tokens produced, and
    engine steps after the one that produced the first token."""

    latency_s: float
    ttft_s: float
    output_tokens: int
    decode_steps: int

    @property
    def decode_s(self) -> float:
        return self.latency_s - self.ttft_s

    @property
    def decode_tps(self) -> float:
        """Tokens per second after the first (the first comes from the prefill step)."""
        return (self.output_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tpot_ms(self) -> float:
        return 1000 * self.decode_s / max(1, self.output_tokens - 1)


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


def time_request(llm: LLM, prompt: list[int], params: SamplingParams, device: str) -> Iteration:
    """Stream one request through ``llm`` (an `LLM`), timing its first token and its end."""
    _sync(device)
    start = time.perf_counter()
    ttft, produced, steps0 = None, 0, 0
    for delta in llm.stream(prompt, params):
        if delta.token_ids and ttft is None:
            ttft = time.perf_counter() - start
            steps0 = llm.stats().num_steps
        produced += len(delta.token_ids)
    _sync(device)
    latency = time.perf_counter() - start
    steps = llm.stats().num_steps - steps0
    return Iteration(latency, ttft if ttft is not None else latency, produced, steps)


def summarize(
    iters: list[Iteration], weight_bytes: int, kv_bytes_per_token: float, input_len: int, bandwidth: dict
) -> dict:
    """The reported figures: latency statistics, decode speed and the achieved memory bandwidth.

    A decode step that produces token j (j >= 2) reads all weights and the KV of input_len + j - 1
    earlier positions; averaged over the decode steps that is input_len + output_len / 2 positions.
    Achieved bandwidth counts engine steps, so a speculative step that yields several tokens reads
    the weights once.
    """
    latencies = [it.latency_s for it in iters]
    output_len = iters[0].output_tokens
    decode_tokens = sum(it.output_tokens - 1 for it in iters)
    decode_s = sum(it.decode_s for it in iters)
    decode_tps = decode_tokens / decode_s if decode_s > 0 else 0.0
    decode_steps = sum(it.decode_steps for it in iters)
    steps_per_s = decode_steps / decode_s if decode_s > 0 else 0.0
    mean_context = input_len + output_len / 2
    kv_bytes_per_step = kv_bytes_per_token * mean_context
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


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    from coreproc.llm import LLM

    if args.input_len < 1 or args.output_len < 2 or args.num_iters < 1 or args.num_iters_warmup < 0:
        raise ConfigError(
            "need --input-len >= 1, --output-len >= 2, --num-iters >= 1, --num-iters-warmup >= 0"
        )
    if args.input_len + args.output_len > config.model.max_model_len:
        raise ConfigError(
            f"--input-len + --output-len ({args.input_len + args.output_len}) exceeds max_model_len "
            f"{config.model.max_model_len}"
        )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    with LLM(config=config, show_progress=False) as llm:
        n = args.num_iters_warmup + args.num_iters
        prompts = workload_prompts(args, llm.tokenizer, config.model.vocab_size, n)
        ready = llm.engine.executor.ready
        device = ready[0].device
        timed = [time_request(llm, p, params, device) for p in prompts]
        iters = timed[args.num_iters_warmup :]
        bandwidth = measure_bandwidth(device, args.bandwidth_mib * 2**20)
    if device.startswith("cuda"):  # each rank reads its own shard from its own memory
        bandwidth["ceiling_gbps"] *= len(ready)
    assert all(it.output_tokens == args.output_len for it in iters), "ignore_eos run stopped early"
    weight_bytes = sum(r.weight_bytes for r in ready)
    kv_per_token = sum(r.kv_bytes_per_block for r in ready) / config.cache.block_size
    result = summarize(iters, weight_bytes, kv_per_token, args.input_len, bandwidth)
    result = dict(
        model=config.model.model,
        dtype=config.model.dtype,
        device=device,
        tensor_parallel_size=len(ready),
        input_len=args.input_len,
        output_len=args.output_len,
        num_iters=args.num_iters,
        iterations=[asdict(it) for it in iters],
        **result,
    )
    head = (
        f"model {config.model.model} ({config.model.dtype} on {device}, tp {len(ready)}), batch 1, "
        f"{args.input_len} in / {args.output_len} out greedy, {args.num_iters} iterations after "
        f"{args.num_iters_warmup} warm-up"
    )
    print_report(head, iters, result, args.bandwidth_mib)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    sys.stdout.flush()
    return 0
