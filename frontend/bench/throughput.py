"""`ember bench throughput`: offline throughput through the real engine, in-process vs multiprocess.

Runs the same token-id prompts (random ids, fixed seed, greedy, ignore_eos) through the in-process
engine (`LLM`) and through `ember-core` + worker processes reached with the ZMQ SDK, and prints one
summary line plus a table: output and total tokens/s, engine steps, time per step, and the per-step
cost of the process boundary (multiprocess minus in-process time, divided by the steps).

With `--structured KIND` each engine runs the workload twice, free and then with every request
constrained (fresh prompts of the same lengths, so the prefix cache favours neither run), and reports
the constraint's per-step cost: constrained minus free ms/step, and as a % of the free step. Warm-ups
with the same spec compile its grammar before the timing. json-schema and regex cannot complete within
`--output-len` tokens, so every step masks every row; choice ends after a word or two and measures
mostly admission (a matcher per request and its first masks).

With `--lora` (and `--enable-lora --lora-modules ...`) the in-process engine runs the workload twice,
the base model alone and then every request with an adapter, round robin over the loaded ones (fresh
prompts of the same lengths), and reports the mixed batch's throughput as a share of the base's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from coreproc.base.config import EngineConfig
from coreproc.base.protocol import SamplingParams, SchedulerStats, StructuredSpec
from frontend.bench.workloads import add_workload_arguments, workload_prompts

STRUCTURED = ("none", "json-schema", "regex", "choice")


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
    structured: str = "none"  # the constraint every request carried (one of STRUCTURED)
    free_ms_per_step: float | None = None  # a constrained row: the same engine's unconstrained run
    mask_seconds: float = 0.0  # the workers' time in grammar matchers and masks (SchedulerStats)
    lora: str = "base"  # "base", or "mixed:K" (requests round robin over K adapters)

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
        figures = {"output_tps": self.output_tps, "ms_per_step": self.ms_per_step}
        overhead = {
            "overhead_ms_per_step": self.overhead_ms_per_step,
            "overhead_pct": self.overhead_pct,
            "mask_ms_per_step": self.mask_ms_per_step,
        }
        return fields | {"spec": spec} | figures | overhead

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.seconds / max(1, self.steps)

    @property
    def overhead_ms_per_step(self) -> float | None:
        """What the constraint adds to a step (None on an unconstrained row)."""
        return None if self.free_ms_per_step is None else self.ms_per_step - self.free_ms_per_step

    @property
    def mask_ms_per_step(self) -> float:
        """The constraint's own cost per step, measured in the workers (matchers, bitmask, masking)."""
        return self.mask_seconds * 1000 / max(1, self.steps)

    @property
    def overhead_pct(self) -> float | None:
        extra = self.overhead_ms_per_step
        return None if extra is None or not self.free_ms_per_step else 100 * extra / self.free_ms_per_step


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
    p.add_argument(
        "--structured",
        choices=STRUCTURED,
        default="none",
        help="also run every request under this constraint and report its per-step cost; json-schema "
        "and regex mask every step, choice ends early and measures mostly admission",
    )
    p.add_argument(
        "--lora",
        action="store_true",
        help="in-process: the base model alone, then every request with one of the --lora-modules "
        "adapters (round robin); needs --enable-lora",
    )


def structured_spec(kind: str, output_len: int) -> StructuredSpec | None:
    """The constraint of a `--structured` run. json-schema and regex need `output_len` integers, each
    at least one token with a comma after it, so they cannot complete (and stop masking) in time."""
    n = output_len
    if kind == "json-schema":
        schema = {"type": "array", "items": {"type": "integer"}, "minItems": n}
        return StructuredSpec(kind="json", spec=json.dumps(schema))
    if kind == "regex":
        return StructuredSpec(kind="regex", spec=rf"(\d+,){{{n},}}\d+")
    if kind == "choice":
        return StructuredSpec(kind="choice", spec=json.dumps(["yes", "no", "maybe"]))
    assert kind == "none", kind
    return None


@dataclass
class Workload:
    """One timed run of an engine: its prompts, their parameters, and the constraint's name. Its
    warm-up runs other prompts (the prefix cache would skip the timed ones' prefill) at the same batch,
    for a few tokens with the same parameters, so the same grammar gets compiled and cached."""

    structured: str
    prompts: list[list[int]]
    warmup_prompts: list[list[int]]
    params: SamplingParams
    loras: list[str | None] | None = None  # an adapter per prompt (None: all on the base model)

    @property
    def lora_label(self) -> str:
        return "base" if not self.loras else f"mixed:{len(set(self.loras))}"

    @property
    def warmup(self) -> SamplingParams:
        return msgspec.structs.replace(self.params, max_tokens=4)


@dataclass
class Timed:
    workload: Workload
    output_tokens: int
    seconds: float
    stats: SchedulerStats  # after the run
    before: SchedulerStats

    @property
    def steps(self) -> int:
        return self.stats.num_steps - self.before.num_steps


def results_of(
    config: EngineConfig, mode: str, timed: list[Timed], weight_bytes: int, quantize_seconds: float
) -> list[Result]:
    """One row per timed run; a constrained row carries the free run's ms/step for its overhead."""
    results: list[Result] = []
    for t in timed:
        prompts = t.workload.prompts
        r = Result(
            mode,
            len(prompts),
            sum(map(len, prompts)),
            t.output_tokens,
            t.seconds,
            t.steps,
            config.model.quantization or "none",
            weight_bytes,
            quantize_seconds,
            t.stats if config.speculative is not None else None,
            t.workload.structured,
            lora=t.workload.lora_label,
        )
        r.mask_seconds = t.stats.structured_seconds - t.before.structured_seconds
        if r.structured != "none" and results:
            r.free_ms_per_step = results[0].ms_per_step
        results.append(r)
    return results


def run_inproc(config: EngineConfig, workloads: list[Workload]) -> list[Result]:
    from coreproc.client.llm import LLM

    timed = []
    with LLM(config=config, show_progress=False) as llm:
        for w in workloads:
            llm.generate(w.warmup_prompts, w.warmup, use_tqdm=False, lora_request=w.loras)
            before = llm.stats()
            start = time.perf_counter()
            outs = llm.generate(w.prompts, w.params, use_tqdm=False, lora_request=w.loras)
            seconds = time.perf_counter() - start
            stats = llm.stats()
            produced = sum(len(o.outputs[0].token_ids) for o in outs)
            timed.append(Timed(w, produced, seconds, stats, before))
        ready = llm.engine.executor.ready[0]
    return results_of(config, "inproc", timed, ready.weight_bytes, ready.quantize_seconds)


def run_multiproc(config: EngineConfig, workloads: list[Workload]) -> list[Result]:
    from coreproc.client.sdk import connect_engines
    from coreproc.startup.launcher import CoreGroup

    async def drive(addresses: list[str]) -> tuple[list[Timed], Any]:
        client = await connect_engines(addresses)  # one core, or one per data-parallel rank
        try:

            async def one(p: list[int], sp: SamplingParams) -> int:
                return sum([len(o.new_token_ids) async for o in client.generate(p, sp)])

            timed = []
            for w in workloads:
                await asyncio.gather(*(one(p, w.warmup) for p in w.warmup_prompts))
                before = await client.stats()
                start = time.perf_counter()
                produced = await asyncio.gather(*(one(p, w.params) for p in w.prompts))
                seconds = time.perf_counter() - start
                stats = await client.stats()
                timed.append(Timed(w, sum(produced), seconds, stats, before))
            return timed, client.info_cache
        finally:
            await client.aclose()

    with CoreGroup(config) as cores:
        timed, info = asyncio.run(drive(cores.addresses))
    par = config.parallel
    layout = [f"{k}{n}" for k, n in (("tp", par.tensor_parallel_size), ("pp", par.pipeline_parallel_size),
                                      ("dp", par.data_parallel_size)) if n > 1]  # fmt: skip
    mode = ("multiproc" if config.scheduler.async_scheduling else "multiproc-sync") + "".join(
        f" {x}" for x in layout
    )
    return results_of(config, mode, timed, sum(info.weight_bytes_by_dtype.values()), info.quantize_seconds)


def workloads_of(args: argparse.Namespace, config: EngineConfig, tokenizer: Any) -> list[Workload]:
    """The free run, with --structured the constrained one, with --lora the mixed-adapter one; each
    has its own prompts."""
    from coreproc.base.config import ConfigError

    vocab_size = config.model.vocab_size
    n = args.num_prompts
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    spec = structured_spec(args.structured, args.output_len)
    runs = [("none", params)]
    if spec is not None:
        runs.append((args.structured, msgspec.structs.replace(params, structured=spec)))
    adapters = [name for name, _ in config.lora.modules()] if args.lora else []
    if args.lora and not adapters:
        raise ConfigError("--lora needs adapters: --enable-lora --lora-modules NAME=PATH ...")
    total = len(runs) + (1 if adapters else 0)
    prompts = workload_prompts(args, tokenizer, vocab_size, 2 * n * total)
    sets = [prompts[i * n : (i + 1) * n] for i in range(2 * total)]  # timed, warm-up, timed, ...
    out = [Workload(name, sets[2 * i], sets[2 * i + 1], sp) for i, (name, sp) in enumerate(runs)]
    if adapters:  # the same batch, each request with an adapter, round robin
        mix: list[str | None] = [adapters[i % len(adapters)] for i in range(n)]
        out.append(Workload("none", sets[-2], sets[-1], params, mix))
    return out


def print_report(args: argparse.Namespace, config: EngineConfig, results: list[Result]) -> None:
    print(
        f"model {config.model.model} ({config.model.dtype}), {args.num_prompts} prompts x "
        f"{args.input_len} in / {args.output_len} out, max_num_seqs {config.scheduler.max_num_seqs}"
    )
    head = f"{'mode':<22}{'quant':<16}{'structured':<13}{'lora':<10}{'out tok/s':>11}{'total tok/s':>13}"
    head += f"{'seconds':>9}"
    print(head + f"{'steps':>7}{'ms/step':>9}{'weights MiB':>13}{'quant s':>9}")
    for r in results:
        print(
            f"{r.mode:<22}{r.quantization:<16}{r.structured:<13}{r.lora:<10}{r.output_tps:>11.1f}"
            f"{r.total_tps:>13.1f}"
            f"{r.seconds:>9.2f}{r.steps:>7}{r.ms_per_step:>9.2f}{r.weight_bytes / 2**20:>13.1f}"
            f"{r.quantize_seconds:>9.2f}"
        )
    for r in results:
        if r.spec_line():
            print(r.spec_line())
    for r in results:
        base = next(
            (b for b in results if b.mode == r.mode and b.lora == "base" and b.structured == "none"), None
        )
        if r.lora != "base" and base is not None:
            print(
                f"summary: batch of {r.requests} over {r.lora.split(':')[1]} adapters ({r.mode}): "
                f"{r.output_tps:.1f} output tok/s, {100 * r.output_tps / base.output_tps:.1f}% of the base "
                f"model alone ({base.output_tps:.1f}); {r.ms_per_step:.2f} vs {base.ms_per_step:.2f} ms "
                "per step"
            )
    free = [r for r in results if r.structured == "none" and r.lora == "base"]
    if len(free) == 2 and not args.quantization_methods:
        a, b = free
        loss = 100.0 * (1 - b.output_tps / a.output_tps)
        overhead = (b.seconds - a.seconds) * 1000 / max(1, b.steps)
        print(f"summary: {b.mode} loses {loss:.1f}% output throughput vs inproc; {overhead:+.2f} ms per step")
    for r in results:
        if r.overhead_ms_per_step is not None and r.free_ms_per_step is not None:
            print(
                f"summary: {r.structured} constraint at batch {r.requests} ({r.mode}, {r.quantization}): "
                f"{r.overhead_ms_per_step:+.3f} ms per step, {r.overhead_pct:+.1f}% of the free "
                f"{r.free_ms_per_step:.3f} ms step; in the workers' matchers and mask: "
                f"{r.mask_ms_per_step:.3f} ms per step ({100 * r.mask_ms_per_step / r.free_ms_per_step:.1f}%)"
            )


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    from coreproc.base.tokenizer import load_tokenizer

    tok = load_tokenizer(config.model.tokenizer)
    workloads = workloads_of(args, config, tok)
    results = []
    if args.quantization_methods:
        from coreproc.base.config import ConfigError
        from workers.quant import resolve_name

        for name in args.quantization_methods.split(","):
            try:
                method = resolve_name(name.strip())
            except ValueError as e:
                raise ConfigError(str(e)) from None
            quantized = dataclasses.replace(
                config, model=dataclasses.replace(config.model, quantization=method)
            )
            results += run_inproc(quantized, workloads)
    else:
        if args.mode in ("inproc", "both"):
            results += run_inproc(config, workloads)
        if args.mode in ("multiproc", "both"):
            results += run_multiproc(config, [w for w in workloads if not w.loras])  # (in-process only)
    print_report(args, config, results)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump([r.as_json() for r in results], f)
    sys.stdout.flush()
    return 0
