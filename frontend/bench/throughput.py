"""`ember bench throughput`: offline throughput through the real engine, in-process vs multiprocess.

Runs the same token-id prompts (random ids, fixed seed, greedy, ignore_eos) through the in-process
engine (`LLM`) and through `ember-core` + worker processes reached with the ZMQ SDK, and prints one
summary line plus a table: output and total tokens/s, engine steps, time per step, and the per-step
cost of the process boundary (multiprocess minus in-process time, divided by the steps).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from coreproc.config import EngineConfig
from coreproc.errors import EmberError
from coreproc.protocol import SamplingParams, SchedulerStats


@dataclass
class Result:
    mode: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    steps: int
    quantization: str = "none"
    weight_bytes: int = 0
    quantize_seconds: float = 0.0
    spec: SchedulerStats | None = None  # the engine's stats after the run, when it speculated

    def spec_line(self) -> str | None:
        s = self.spec
        if s is None or not s.spec_num_proposed:
            return None
        positions = zip(s.spec_accepted_per_position, s.spec_proposed_per_position)
        per_pos = ", ".join(f"{a / p:.0%}" for a, p in positions if p)
        return (
            f"{self.mode}: speculative acceptance {s.spec_acceptance_rate:.1%} "
            f"({s.spec_num_accepted}/{s.spec_num_proposed}), mean accepted length "
            f"{s.spec_mean_accepted_length:.2f}, by position {per_pos}"
        )

    def as_json(self) -> dict[str, Any]:
        """The figures for --result-json; `spec` holds the spec_* counters ({} without speculation)."""
        stats = msgspec.structs.asdict(self.spec) if self.spec is not None else {}
        spec = {k: v for k, v in stats.items() if k.startswith("spec_")}
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return fields | {"spec": spec, "output_tps": self.output_tps, "ms_per_step": self.ms_per_step}

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.seconds / max(1, self.steps)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["inproc", "multiproc", "both"], default="both")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    add_workload_arguments(p)
    p.add_argument("--result-json", default=None, help="also write the figures to this file")
    p.add_argument(
        "--quantization-methods",
        default=None,
        help="comma-separated methods to compare in-process, one row each (e.g. none,fp8,int8,int4)",
    )


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """Prompt flags shared by the offline benchmarks."""
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the prompts")
    p.add_argument(
        "--workload",
        choices=["random", "rewrite"],
        default="random",
        help="random token ids, or 'rewrite': a piece of Python source, a separator, and the start of "
        "the same piece again (an input-heavy, copy-like task where n-gram speculation shines)",
    )


def make_prompts(vocab_size: int, special: set[int], n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ids = [i for i in range(vocab_size) if i not in special]
    return [[rng.choice(ids) for _ in range(length)] for _ in range(n)]


REWRITE_SOURCES = ("textwrap", "heapq", "bisect", "fractions", "string", "shlex", "calendar", "colorsys")


def rewrite_prompts(tokenizer: Any, n: int, length: int, seed: int) -> list[list[int]]:
    """`length`-token prompts: a window of a stdlib module's source, a rewrite marker, and the
    window's first tokens again, so the continuation retraces the window."""
    import importlib
    import inspect

    rng = random.Random(seed)
    marker = tokenizer.encode("\n\n# the same code, rewritten:\n", add_special_tokens=False)
    restart = 8
    body = length - len(marker) - restart
    if body < restart:
        raise EmberError(f"--input-len {length} is too short for the rewrite workload")
    sources = [
        tokenizer.encode(inspect.getsource(importlib.import_module(m)), add_special_tokens=False)
        for m in REWRITE_SOURCES
    ]
    prompts = []
    for i in range(n):
        src = sources[i % len(sources)]
        start = rng.randrange(0, max(1, len(src) - body))
        window = src[start : start + body]
        prompts.append(window + marker + window[:restart])
    return prompts


def workload_prompts(args: argparse.Namespace, tokenizer: Any, vocab_size: int, n: int) -> list[list[int]]:
    if args.workload == "rewrite":
        return rewrite_prompts(tokenizer, n, args.input_len, args.bench_seed)
    return make_prompts(vocab_size, set(tokenizer.all_special_ids), n, args.input_len, args.bench_seed)


def run_inproc(config: EngineConfig, prompts: list[list[int]], params: SamplingParams) -> Result:
    from coreproc.llm import LLM

    with LLM(config=config, show_progress=False) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        steps0 = llm.stats().num_steps
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        stats = llm.stats()
        steps = stats.num_steps - steps0
        ready = llm.engine.executor.ready[0]
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    method = config.model.quantization or "none"
    return Result(
        "inproc",
        len(prompts),
        sum(map(len, prompts)),
        produced,
        seconds,
        steps,
        method,
        ready.weight_bytes,
        ready.quantize_seconds,
        stats if config.speculative is not None else None,
    )


def run_multiproc(config: EngineConfig, prompts: list[list[int]], params: SamplingParams) -> Result:
    from coreproc.client import AsyncEngineClient
    from coreproc.startup.launcher import CoreProcess

    core_info = None
    stats = SchedulerStats()

    async def drive(address: str) -> tuple[int, float, int]:
        nonlocal core_info, stats
        client = await AsyncEngineClient.connect(address)
        core_info = client.info_cache
        try:

            async def one(p: list[int], sp: SamplingParams) -> int:
                return sum([len(o.new_token_ids) async for o in client.generate(p, sp)])

            await asyncio.gather(*(one(p, SamplingParams(max_tokens=4)) for p in prompts[:2]))  # warm-up
            steps0 = (await client.stats()).num_steps
            start = time.perf_counter()
            produced = await asyncio.gather(*(one(p, params) for p in prompts))
            seconds = time.perf_counter() - start
            stats = await client.stats()
            return sum(produced), seconds, stats.num_steps - steps0
        finally:
            await client.aclose()

    with CoreProcess(config) as core:
        produced, seconds, steps = asyncio.run(drive(core.address))
    mode = "multiproc" if config.scheduler.async_scheduling else "multiproc-sync"
    info = core_info
    return Result(
        mode,
        len(prompts),
        sum(map(len, prompts)),
        produced,
        seconds,
        steps,
        config.model.quantization or "none",
        sum(info.weight_bytes_by_dtype.values()),
        info.quantize_seconds,
        stats if config.speculative is not None else None,
    )


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    from coreproc.text.tokenizer import load_tokenizer

    tok = load_tokenizer(config.model.tokenizer)
    prompts = workload_prompts(args, tok, config.model.vocab_size, args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    results = []
    if args.quantization_methods:
        from coreproc.config import ConfigError
        from workers.quant import resolve_name

        for name in args.quantization_methods.split(","):
            try:
                method = resolve_name(name.strip())
            except ValueError as e:
                raise ConfigError(str(e)) from None
            quantized = dataclasses.replace(
                config, model=dataclasses.replace(config.model, quantization=method)
            )
            results.append(run_inproc(quantized, prompts, params))
    else:
        if args.mode in ("inproc", "both"):
            results.append(run_inproc(config, prompts, params))
        if args.mode in ("multiproc", "both"):
            results.append(run_multiproc(config, prompts, params))
    print(
        f"model {config.model.model} ({config.model.dtype}), {args.num_prompts} prompts x "
        f"{args.input_len} in / {args.output_len} out, max_num_seqs {config.scheduler.max_num_seqs}"
    )
    head = f"{'mode':<15}{'quant':<16}{'out tok/s':>11}{'total tok/s':>13}{'seconds':>9}{'steps':>7}"
    print(head + f"{'ms/step':>9}{'weights MiB':>13}{'quant s':>9}")
    for r in results:
        print(
            f"{r.mode:<15}{r.quantization:<16}{r.output_tps:>11.1f}{r.total_tps:>13.1f}{r.seconds:>9.2f}"
            f"{r.steps:>7}{r.ms_per_step:>9.2f}{r.weight_bytes / 2**20:>13.1f}{r.quantize_seconds:>9.2f}"
        )
    for r in results:
        if r.spec_line():
            print(r.spec_line())
    if len(results) == 2 and not args.quantization_methods:
        a, b = results
        loss = 100.0 * (1 - b.output_tps / a.output_tps)
        overhead = (b.seconds - a.seconds) * 1000 / max(1, b.steps)
        print(f"summary: {b.mode} loses {loss:.1f}% output throughput vs inproc; {overhead:+.2f} ms per step")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump([r.as_json() for r in results], f)
    sys.stdout.flush()
    return 0
