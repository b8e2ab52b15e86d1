"""The batched multi-LoRA op on the CPU: what mixing adapters in a batch costs (kernels/lora.py).

A repository script (not installed): `python -m tools.bench_lora_op [--tokens 256] [--dim 2048]
[--rank 16] [--dtype bfloat16]` times `lora_delta_grouped` (best of 5 calls) on one batch three ways:
4 adapters mixed (tokens shuffled), every token on one adapter, no adapter (all -1), and the mixed
batch's tokens run apart, one call per adapter (the cost mixing should match). Beside it, in the
same run: the gather + bmm reference on the same batch, and the base model's own [dim, dim]
linear on the same tokens (the product the delta is added to: its GFLOP/s is the ceiling here).
Prints one summary line, then a table.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable

import torch

from kernels.lora import LoraOp, lora_delta_grouped, lora_delta_reference

OPS = (lora_delta_grouped, lora_delta_reference)


def best_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    """Best of `repeats` calls after one warm-up, in ms."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def call_all(
    op: LoraOp,
    calls: list[tuple[torch.Tensor, torch.Tensor]],
    a: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    for x, slots in calls:
        op(x, a, b, scales, slots)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench_lora_op", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--dim", type=int, default=2048, help="IN = OUT")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args(argv)
    dtype, t, d, r, s = getattr(torch, args.dtype), args.tokens, args.dim, args.rank, args.adapters
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(t, d, generator=gen).to(dtype)
    a = (torch.randn(s, r, d, generator=gen) / d**0.5).to(dtype)
    b = (torch.randn(s, d, r, generator=gen) / r**0.5).to(dtype)
    scales = torch.full((s,), 2.0)
    weight = (torch.randn(d, d, generator=gen) / d**0.5).to(dtype)
    mixed = (torch.arange(t) % s)[torch.randperm(t, generator=gen)]
    batches: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {  # name -> the (x, slots) of its calls
        f"{s} adapters mixed": [(x, mixed)],
        "one adapter": [(x, torch.zeros(t, dtype=torch.int64))],
        "no adapter": [(x, torch.full((t,), -1, dtype=torch.int64))],
        f"{s} adapters apart (sum)": [(x[mixed == k].contiguous(), mixed[mixed == k]) for k in range(s)],
    }
    base = best_ms(lambda: torch.nn.functional.linear(x, weight))
    base_gflops = 2 * t * d * d / (base * 1e-3) / 1e9
    rows, grouped = [], []
    for name, calls in batches.items():
        ours, ref = (best_ms(functools.partial(call_all, op, calls, a, b, scales)) for op in OPS)
        flops = 2 * sum(int((sc >= 0).sum()) for _, sc in calls) * r * (d + d)
        rows.append(
            f"| {name} | {ours:.3f} | {ref:.3f} | {flops / (ours * 1e-3) / 1e9:.1f} | {ours / base:.1%} |"
        )
        grouped.append(ours)
    mixed_ms, one, none, apart = grouped
    print(
        f"lora_delta_grouped {args.dtype} T={t} IN=OUT={d} R={r}: {s} adapters mixed {mixed_ms:.3f} ms "
        f"({mixed_ms / apart:.2f}x their tokens run apart, {mixed_ms / one:.2f}x one adapter), one adapter "
        f"{one:.3f} ms, no adapter {none:.3f} ms; base linear {base:.3f} ms "
        f"({base_gflops:.0f} GFLOP/s), {torch.get_num_threads()} threads"
    )
    print("| batch | grouped ms | reference ms | grouped GFLOP/s | of base linear |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
