"""bf16 matrix products on the CPU: Ember's native kernel against torch's own, per row count.

A repository script (not installed): `python -m tools.bench_gemm [--shapes N:K,...] [--rows 1,8,...]`
times, for each weight shape (default: the linears of Qwen2.5-1.5B: fused q/k/v, o, gate/up, down,
the head) and row count, `gemm_bf16` on the native build's layout (`bf16_layout`: "amx32" on AMX
tiles, "packed16" on the FMA kernels; `EMBER_CPU_MARCH=icelake-server` builds the AVX-512 FMA
kernels on an AMX machine, `haswell` the 256-bit ones) beside torch's oneDNN matmul on a weight
prepacked for it (`torch.ops.mkldnn._linear_pointwise`, where this torch has it) and plain
`torch.nn.functional.linear`, and prints ms per product and GB/s of weights read. One process, one
product at a time, on torch's threads (`--threads`, default all cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

QWEN_1_5B = "2048:1536,1536:1536,17920:1536,1536:8960,151936:1536"


def timed(fn: Callable[..., object], *args: object, budget: float = 0.5) -> float:
    """Median ms of `fn(*args)` over repeats filling about `budget` seconds (at least 3, after a
    warm-up)."""
    fn(*args)
    start = time.perf_counter()
    fn(*args)
    once = time.perf_counter() - start
    times = []
    for _ in range(max(3, min(50, int(budget / max(once, 1e-6))))):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def onednn(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """torch's oneDNN linear on a prepacked weight, or None where this torch lacks the ops."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench_gemm", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=QWEN_1_5B, help="N:K weight shapes, comma-separated")
    p.add_argument("--rows", default="1,4,8,16,32,48,64,512")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kernels.cpu_gemm import bf16_layout, gemm_bf16, pack_bf16
    from kernels.native import use_native

    if not use_native("cpu"):
        print("bench_gemm: the native CPU ops are not available here", file=sys.stderr)
        return 1
    layout = bf16_layout()
    print(f"native layout {layout}, {args.threads} threads, torch {torch.__version__}")
    print(f"| N x K | rows | ember {layout} ms | oneDNN prepacked ms | F.linear ms | ember GB/s |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split(":"))
        weight = torch.randn(n, k, generator=gen).bfloat16()
        packed, theirs = pack_bf16(weight), onednn(weight)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=gen).bfloat16()
            ours = timed(gemm_bf16, x, packed, n)
            dnn = f"{timed(theirs, x):.3f}" if theirs is not None else "-"
            plain = timed(torch.nn.functional.linear, x, weight)
            gbps = n * k * 2 / (ours * 1e-3) / 1e9
            print(f"| {n} x {k} | {rows} | {ours:.3f} | {dnn} | {plain:.3f} | {gbps:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
