"""Speculative decoding on a real target / draft pair: `ember bench latency` rows side by side.

A repository script (not installed): `python -m tools.bench_spec --target DIR_OR_GGUF --draft GGUF
--out DIR` runs, one after the other on this machine, `ember bench latency` for each workload
(`rewrite`, `complete`; `--workloads random` for one where proposals mostly fail) and batch size
(1, 8): plain decoding, n-gram (adaptive and fixed k) and the draft model (adaptive and fixed k;
fixed rows at batch 1 only; batch 1 times two requests after a warm-up one, batch 8 one batch), each
writing DIR/<row>.json, then prints one Markdown table: decode tok/s, the speed-up over the plain row
of the same workload and batch, acceptance by position, tokens per step and each step's cost split.
`--render DIR` prints the table from an earlier run's files without running anything.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

K_NGRAM, K_DRAFT = 5, 4


def rows(
    draft: str, batches: list[int], workloads: tuple[str, ...] = ("rewrite", "complete")
) -> list[tuple[str, list[str]]]:
    """(name, extra `ember bench latency` arguments) of every row, plain first in each group."""
    ngram = {"method": "ngram", "num_speculative_tokens": K_NGRAM}
    drafted = {"method": "draft_model", "model": draft, "num_speculative_tokens": K_DRAFT}
    methods = [("plain", None), ("ngram", ngram), ("ngram_fixed", {**ngram, "adaptive": False})]
    methods += [("draft", drafted), ("draft_fixed", {**drafted, "adaptive": False})]
    out = []
    for batch in batches:
        for workload in workloads:
            for name, spec in methods:
                if batch > 1 and name.endswith("_fixed"):
                    continue
                args = ["--workload", workload, "--batch-size", str(batch)]
                args += (
                    ["--num-iters", "2", "--num-iters-warmup", "1"] if batch == 1 else ["--num-iters", "1"]
                )
                if spec is not None:
                    args += ["--speculative-config", json.dumps(spec)]
                out.append((f"b{batch}_{workload}_{name}", args))
    return out


def render(folder: Path) -> str:
    """The Markdown table of the rows found in `folder`."""
    lines = [
        "| batch | workload | method | decode tok/s | speed-up | tokens/step | acceptance by position "
        "| step ms: forward / draft / sample / schedule |",
        "|---|---|---|---|---|---|---|---|",
    ]
    found = [(path.stem.split("_", 2)[2], json.loads(path.read_text())) for path in folder.glob("b*_*.json")]
    order = {"rewrite": 0, "complete": 1}
    found.sort(key=lambda m: (m[1]["batch_size"], order.get(m[1]["workload"], 2), m[0] != "plain", m[0]))
    plain = {(r["batch_size"], r["workload"]): r["decode_tps"] for method, r in found if method == "plain"}
    for method, r in found:
        base = plain.get((r["batch_size"], r["workload"]))
        speed = f"{r['decode_tps'] / base:.2f}x" if base else "-"
        spec = r.get("speculation") or {}
        accept = " ".join(f"{a:.0%}" for a in spec.get("acceptance_per_position", [])) or "-"
        split = " / ".join(f"{v:.1f}" for v in r["step_split_ms"].values())
        lines.append(
            f"| {r['batch_size']} | {r['workload']} | {method} | {r['decode_tps']:.1f} | {speed} "
            f"| {r['tokens_per_step']:.2f} | {accept} | {split} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench_spec", description=__doc__.splitlines()[0])
    p.add_argument("--target", help="the target model (folder or GGUF)")
    p.add_argument("--draft", help="the draft model (folder or GGUF)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--workloads", default="rewrite,complete", help="also random: proposals mostly rejected")
    p.add_argument("--out", type=Path, default=Path("spec-bench"))
    p.add_argument("--render", type=Path, help="only print the table of this folder's rows")
    p.add_argument("--only", help="run only the rows whose name matches this regular expression")
    args = p.parse_args(argv)
    if args.render:
        print(render(args.render))
        return 0
    if not args.target or not args.draft:
        p.error("--target and --draft are needed (or --render DIR)")
    args.out.mkdir(parents=True, exist_ok=True)
    base = ["ember", "bench", "latency", "--model", args.target, "--dtype", args.dtype]
    base += ["--max-model-len", "4096", "--output-len", str(args.output_len), "--num-iters-warmup", "0"]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    for name, extra in rows(args.draft, batches, tuple(args.workloads.split(","))):
        if args.only and not re.search(args.only, name):
            continue
        print(f"== {name}", flush=True)
        cmd = [*base, *extra, "--result-json", str(args.out / f"{name}.json")]
        if subprocess.run(cmd).returncode != 0:
            print(f"{name} failed", file=sys.stderr)
            return 1
    print(render(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
