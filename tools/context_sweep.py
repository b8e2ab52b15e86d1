"""Decode speed as the context grows: Ember beside llama.cpp on one GGUF file, batch 1 and 8.

Usage: `python -m tools.context_sweep --gguf FILE [--contexts 512,2048,8192,16384] [--batches 1,8]
[--steps 32] [--kv auto,fp8] [--llamacpp BIN] [--threads 2]`. Prints a markdown table of decode
tokens/s (batch x steps / seconds of the decode steps) per context length.

- **Ember**: the worker's decode step as the engine runs it (the one-call native layers, the native
  decode attention, logits, greedy pick, the step's metadata built on the host), over a paged cache
  whose blocks for every sequence hold random keys and values. That skips the prefill, which on two
  cores would take ~20 minutes for 8 x 16k tokens, and keeps every sequence's KV apart, as distinct
  requests have it. The scheduler's own share of a step (~1 ms) is not in it.
- **llama.cpp**: `llama-batched-bench -pps` (one shared prompt prefilled, then copied into each
  sequence's own KV stream, since the cache is not unified) with its default flash attention; its
  S_TG column is the same decode-only figure.
Both run on `--threads` threads. Run the two at different times from anything else: they are
bandwidth-bound and share the memory bus.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

from kernels import AttentionMetadata
from tools.peers.run_llamacpp import parse_batched_bench
from tools.teacher_forced import load
from workers.kv_scales import kv_cache_dtype
from workers.models.fused_decode import select_forward
from workers.models.ops import install_ops, select_ops

BLOCK = 16
WARMUP = 2


def ember_decode_tps(model, forward, ctx: int, batch: int, steps: int, kv_dtype: torch.dtype) -> float:
    """Decode tokens/s of `steps` greedy steps of `batch` sequences that each hold `ctx` tokens."""
    attn = model.model.layers[0].self_attn
    per_seq = -(-(ctx + WARMUP + steps) // BLOCK)
    gen = torch.Generator().manual_seed(ctx)
    shape = (2, batch * per_seq, BLOCK, attn.num_kv_heads, attn.head_dim)
    caches = [torch.randn(shape, generator=gen).to(kv_dtype) for _ in model.model.layers]
    for layer in model.model.layers:
        ones = torch.ones(2, attn.num_kv_heads)
        layer.self_attn.attn.kv_scales = ones if kv_dtype.itemsize == 1 else None
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    ids = torch.randint(model.config.vocab_size, (batch,), generator=gen)
    start = 0.0
    with torch.inference_mode():
        for step in range(WARMUP + steps):
            if step == WARMUP:
                start = time.perf_counter()
            lens = [ctx + step + 1] * batch
            meta = AttentionMetadata.build([1] * batch, lens, tables, BLOCK, "cpu")
            positions = torch.full((batch,), ctx + step, dtype=torch.long)
            ids = model.compute_logits(forward(ids, positions, caches, meta)).argmax(-1)
    return batch * steps / (time.perf_counter() - start)


def ember_rows(args: argparse.Namespace) -> dict[tuple[str, int, int], float]:
    torch.set_num_threads(args.threads)
    longest = max(args.contexts) + WARMUP + args.steps + 1
    model = load(args.gguf, None, torch.bfloat16, longest, "cpu_bf16")
    install_ops(model, select_ops(True))
    forward = select_forward(model)
    rows = {}
    for kv in args.kv:
        for batch in args.batches:
            for ctx in args.contexts:
                dtype = kv_cache_dtype(kv, torch.bfloat16)
                tps = ember_decode_tps(model, forward, ctx, batch, args.steps, dtype)
                rows[(f"Ember, KV {'bf16' if kv == 'auto' else kv}", batch, ctx)] = tps
                print(f"ember kv={kv} batch={batch} ctx={ctx}: {tps:.1f} tok/s", file=sys.stderr, flush=True)
    return rows


def llamacpp_rows(args: argparse.Namespace) -> dict[tuple[str, int, int], float]:
    kv_tokens = max(args.batches) * (max(args.contexts) + args.steps) + 256
    cmd = [args.llamacpp, "-m", args.gguf, "-c", str(kv_tokens), "-b", "2048", "-ub", "512", "-pps"]
    cmd += ["-npp", ",".join(map(str, args.contexts)), "-ntg", str(args.steps)]
    cmd += ["-npl", ",".join(map(str, args.batches)), "-t", str(args.threads), "-tb", str(args.threads)]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"llama-batched-bench exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    table = parse_batched_bench(proc.stdout + "\n" + proc.stderr)
    return {("llama.cpp, KV f16", int(r["b"]), int(r["pp"])): r["s_tg"] for r in table}


def render(rows: dict[tuple[str, int, int], float], contexts: list[int], batches: list[int]) -> list[str]:
    engines = list(dict.fromkeys(name for name, _, _ in rows))
    head = "| engine | batch | " + " | ".join(f"{c} ctx" for c in contexts) + " |"
    lines = [head, "|" + "---|" * (2 + len(contexts))]
    for batch in batches:
        for name in engines:
            cells = [f"{rows[(name, batch, c)]:.1f}" if (name, batch, c) in rows else "-" for c in contexts]
            lines.append(f"| {name} | {batch} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--contexts", default="512,2048,8192,16384")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--kv", default="auto,fp8", help="Ember's KV cache dtypes")
    p.add_argument("--llamacpp", help="llama-batched-bench binary (omit to run Ember only)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    args.kv = args.kv.split(",")
    if min(args.contexts + args.batches + [args.steps, args.threads]) < 1:
        p.error("contexts, batches, --steps and --threads must be >= 1")
    rows = ember_rows(args)
    if args.llamacpp:
        rows |= llamacpp_rows(args)
    print("\n".join(render(rows, args.contexts, args.batches)))


if __name__ == "__main__":
    main()
