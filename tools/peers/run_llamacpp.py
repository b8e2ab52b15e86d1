"""compare_peers runner for llama.cpp: runs `llama-batched-bench` on a GGUF file and parses its table.

Usage: `python run_llamacpp.py JOB.json --bin llama-batched-bench --gguf X.gguf [--version TEXT]`. One
run with `-npl 1,N -npp IN -ntg OUT`: per batch size B, llama-batched-bench processes B prompts of IN
(random) tokens and then OUT decode steps, timing both (T_PP, T_TG). Output tokens/s = B*OUT / (T_PP +
T_TG), the same definition as the other peers'; batch-1 decode tok/s is its S_TG. Start-to-ready is the
process's wall time less the timed batches (load, context creation, its warm-up). A second run with one
prompt of the job's prefill length gives prompt processing tok/s (S_PP). Prints one JSON line prefixed
`PEER_RESULT `.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

COLUMNS = ("pp", "tg", "b", "n_kv", "t_pp", "s_pp", "t_tg", "s_tg", "t", "s")
ROW = re.compile(
    r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 6 + r"\s*$"
)


def parse_batched_bench(text: str) -> list[dict[str, float]]:
    """The rows of llama-batched-bench's markdown table: pp, tg, b (batch size), n_kv, t_pp, s_pp, t_tg,
    s_tg, t, s (seconds and tokens/s, as printed). Other lines (logs, header, separator) are skipped."""
    rows = []
    for line in text.splitlines():
        m = ROW.match(line.strip())
        if m:
            rows.append(
                {k: (int(v) if i < 4 else float(v)) for i, (k, v) in enumerate(zip(COLUMNS, m.groups()))}
            )
    return rows


def throughput(row: dict[str, float]) -> tuple[float, int]:
    """(seconds, output tokens) of one row: the whole batch, prompt processing plus generation."""
    return row["t_pp"] + row["t_tg"], int(row["b"] * row["tg"])


def bench_command(binary: str, gguf: str, job: dict, prefill: bool = False) -> list[str]:
    """The timed workloads (batch sizes 1 and N), or with `prefill` one long prompt and one token."""
    n, in_len, out_len = job["num_prompts"], job["input_len"], job["output_len"]
    if prefill:
        n, in_len, out_len = 1, len(job["prefill_prompt"]), 1
    ctx = max(n, 1) * (in_len + out_len)
    batches = "1" if n == 1 else f"1,{n}"
    threads = job["threads"]
    flags = f"-c {ctx} -b 2048 -ub 512 -npp {in_len} -ntg {out_len} -npl {batches} -t {threads} -tb {threads}"
    return [binary, "-m", gguf, *flags.split()]


def run_bench(cmd: list[str]) -> tuple[dict[int, dict[str, float]], float]:
    """(rows by batch size, wall seconds) of one llama-batched-bench run; exits on failure."""
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - start
    sys.stderr.write(proc.stderr)
    sys.stderr.write(proc.stdout)
    if proc.returncode != 0:
        tail = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        sys.exit(f"llama-batched-bench exited {proc.returncode}: {tail[-1] if tail else ''}")
    return {int(r["b"]): r for r in parse_batched_bench(proc.stdout + "\n" + proc.stderr)}, wall


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("job")
    p.add_argument("--bin", required=True)
    p.add_argument("--gguf", required=True)
    p.add_argument("--version", default="llama.cpp")
    args = p.parse_args(argv)
    job = json.loads(Path(args.job).read_text())
    cmd = bench_command(args.bin, args.gguf, job)
    start = time.time()
    rows, wall = run_bench(cmd)
    prefill_rows, _ = run_bench(bench_command(args.bin, args.gguf, job, prefill=True))
    n = job["num_prompts"]
    if 1 not in rows or n not in rows:
        sys.exit(f"no table rows for batch sizes 1 and {n} in llama-batched-bench's output")
    batch_s, batch_tokens = throughput(rows[n])
    single_s, single_tokens = throughput(rows[1])
    timed = sum(throughput(r)[0] for r in rows.values())
    result = {
        "version": args.version,
        "ready_at": start + max(0.0, wall - timed),
        "batch_seconds": batch_s,
        "batch_output_tokens": batch_tokens,
        "single_seconds": single_s,
        "single_output_tokens": single_tokens,
        "single_decode_tps": rows[1]["s_tg"],
        "prefill_tps": prefill_rows[1]["s_pp"] if 1 in prefill_rows else None,
        # a request alone: its prompt, then its first decode step
        "first_token_after_ready_s": rows[1]["t_pp"] + rows[1]["t_tg"] / max(1, rows[1]["tg"]),
        "threads": job["threads"],
        "rows": list(rows.values()),
        "command": " ".join(cmd),
        "pid": os.getpid(),
    }
    print("PEER_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
