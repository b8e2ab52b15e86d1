"""Load and soak test of a live `ember serve`: many concurrent streaming clients, a mix of behaviours.

Runs in its own process against a server it starts (`--model`, extra `--serve-args`) or one already
running (`--base-url` and `--pid` for memory sampling). Every request must complete or be refused
with 503 (the queue limits); the mix has plain streams, clients that hang up after two chunks, `n > 1`,
stop strings, shared prefixes (prefix-cache hits) and non-streamed requests. It reports TTFT and
inter-token latency percentiles, outcome counts, and afterwards checks that the server is idle with
no state left: no KV block in use, nothing running or waiting, no request held by the core or mapped
to a client, no stream open in the frontend. The resident memory of every server process is sampled
through the run; growth is the median of the last fifth against the median of the second fifth
(the first is warm-up). `--plot F.png` draws the RSS curves (matplotlib).

    python -m tools.soak --model ~/.cache/ember/real-models/smollm2-135m --concurrency 500 \\
        --requests 20000 --plot docs/plots/soak_rss.png --result-json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

BEHAVIOURS = {"stream": 4, "disconnect": 1, "n2": 1, "stop": 1, "prefix": 2, "plain": 1}
IDLE_GAUGES = (
    "ember_kv_cache_usage_ratio",
    "ember_num_requests_running",
    "ember_num_requests_waiting",
    "ember_num_requests_held",
    "ember_num_client_requests",
    "ember_frontend_open_requests",
)
WORDS = "the quick brown fox jumps over a lazy dog while seven tired cats watch from the old wall".split()


@dataclass
class Outcome:
    behaviour: str
    result: str  # ok, refused (503), hung-up (ours), error
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    detail: str = ""


def prompt_for(k: int, behaviour: str, rng: random.Random) -> str:
    if behaviour == "prefix":  # eight families sharing a 200-word prefix: prefix-cache hits
        family = k % 8
        head = " ".join(WORDS[(family + i) % len(WORDS)] for i in range(200))
        return f"{head} question {k}:"
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 64)))


def body_for(k: int, behaviour: str, rng: random.Random, model: str, max_tokens: int) -> dict:
    body: dict = {"model": model, "prompt": prompt_for(k, behaviour, rng), "max_tokens": max_tokens}
    body["stream"] = behaviour not in ("plain", "n2")
    if behaviour == "n2":
        body |= {"n": 2, "temperature": 0.8, "seed": k}
    if behaviour == "stop":
        body["stop"] = [" the", "."]
    return body


async def one(http: httpx.AsyncClient, k: int, behaviour: str, body: dict) -> Outcome:
    start = time.perf_counter()
    try:
        if not body["stream"]:
            reply = await http.post("/v1/completions", json=body)
            if reply.status_code == 503:
                return Outcome(behaviour, "refused")
            ok = reply.status_code == 200 and len(reply.json()["choices"]) == body.get("n", 1)
            return Outcome(behaviour, "ok" if ok else "error", detail="" if ok else reply.text[:200])
        out = Outcome(behaviour, "ok")
        last = start
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code == 503:
                return Outcome(behaviour, "refused")
            if reply.status_code != 200:
                return Outcome(behaviour, "error", detail=(await reply.aread()).decode()[:200])
            chunks = 0
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Outcome(behaviour, "error", detail=event["error"]["message"][:200])
                now = time.perf_counter()
                if out.ttft is None:
                    out.ttft = now - start
                else:
                    out.itls.append(now - last)
                last, chunks = now, chunks + 1
                if behaviour == "disconnect" and chunks == 2:
                    return Outcome(behaviour, "hung-up", out.ttft, out.itls)
        return out
    except httpx.HTTPError as e:
        return Outcome(behaviour, "error", detail=f"{type(e).__name__}: {e}"[:200])


async def drive(args: argparse.Namespace, url: str, sampler: RssSampler) -> tuple[list[Outcome], float]:
    rng = random.Random(args.seed)
    names, weights = zip(*BEHAVIOURS.items())
    # idle connections are dropped before the server's keep-alive timeout (uvicorn's 5 s, httpx's default
    # expiry too): reusing one the server is closing at that moment fails with a reset (ReadError)
    limits = httpx.Limits(
        max_connections=args.concurrency, max_keepalive_connections=args.concurrency, keepalive_expiry=2.0
    )
    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as http:

        async def gated(k: int) -> Outcome:
            behaviour = rng.choices(names, weights)[0]
            body = body_for(k, behaviour, rng, args.served_model_name, args.max_tokens)
            async with gate:
                outcome = await one(http, k, behaviour, body)
            sampler.finished += 1
            return outcome

        start = time.perf_counter()
        outcomes = await asyncio.gather(*(gated(k) for k in range(args.requests)))
        return list(outcomes), time.perf_counter() - start


# ---------------------------------------------------------------------------------------- the server


def process_tree(root: int) -> dict[int, str]:
    """pid -> process title of `root` and all its descendants (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, frontier = {root}, [root]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier and p not in tree]
        tree.update(kids)
        frontier = kids
    return {pid: title(pid) for pid in tree}


def title(pid: int) -> str:
    """The process title (`ember-core`, `ember-worker-0`, ...); the frontend keeps its interpreter's."""
    try:
        name = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")[0].decode()[:40]
    except OSError:
        return "?"
    return "ember serve (frontend)" if "/" in name else name


def rss_kib(pid: int) -> int | None:
    try:
        for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class RssSampler(threading.Thread):
    """Samples the RSS of every process of the server's tree every `interval` seconds."""

    def __init__(self, root: int, interval: float) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.root, self.interval = root, interval
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.finished_at: list[int] = []  # requests finished at each sample
        self.finished = 0  # bumped by the clients
        self.done = threading.Event()

    def run(self) -> None:
        start = time.perf_counter()
        while not self.done.wait(self.interval):
            row = {}
            for pid, name in process_tree(self.root).items():
                kib = rss_kib(pid)
                if kib is not None:
                    row[f"{name} ({pid})"] = kib
            self.samples.append((time.perf_counter() - start, row))
            self.finished_at.append(self.finished)

    def growth(self) -> dict[str, float]:
        """Per process: median RSS of the last fifth over that of the second fifth, minus one."""
        n = len(self.samples)
        if n < 10:
            return {}
        second = self.samples[n // 5 : 2 * n // 5]
        last = self.samples[4 * n // 5 :]
        out = {}
        for name in self.samples[-1][1]:
            a = [row[name] for _, row in second if name in row]
            b = [row[name] for _, row in last if name in row]
            if a and b:
                out[name] = statistics.median(b) / statistics.median(a) - 1
        return out


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    return sum(values)


def left_over(url: str, timeout: float = 30.0) -> dict[str, float]:
    """What the server still holds once idle (waits for the stats refresh); {} when nothing."""
    deadline = time.monotonic() + timeout
    while True:
        held = {g: v for g in IDLE_GAUGES if (v := metric(url, g)) != 0}
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, int]:
    cmd = [sys.executable, "-m", "frontend.cli", "serve", args.model, "--port", "0"]
    cmd += ["--served-model-name", args.served_model_name, *args.serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        match = re.search(r"listening on (https?://[\w.]+:\d+)", line)
        if match:
            return proc, match.group(1), proc.pid
    raise SystemExit(f"the server did not start (exit code {proc.wait()})")


# ---------------------------------------------------------------------------------------- the report


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def report(outcomes: list[Outcome], seconds: float, sampler: RssSampler, held: dict) -> dict:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.result] = counts.get(o.result, 0) + 1
    ttft = [o.ttft for o in outcomes if o.ttft is not None]
    itl = [x for o in outcomes for x in o.itls]
    growth = sampler.growth()
    summary = {
        "requests": len(outcomes),
        "seconds": round(seconds, 1),
        "outcomes": counts,
        "ttft_p50_ms": round(1000 * pct(ttft, 0.5), 1),
        "ttft_p99_ms": round(1000 * pct(ttft, 0.99), 1),
        "itl_p50_ms": round(1000 * pct(itl, 0.5), 2),
        "itl_p99_ms": round(1000 * pct(itl, 0.99), 2),
        "rss_growth": {k: round(v, 4) for k, v in growth.items()},
        "left_over": held,
        "errors": [asdict(o) for o in outcomes if o.result == "error"][:5],
    }
    print(
        f"soak: {len(outcomes)} requests in {seconds:.0f} s: {counts}; "
        f"TTFT p50 {summary['ttft_p50_ms']} ms p99 {summary['ttft_p99_ms']} ms; "
        f"ITL p50 {summary['itl_p50_ms']} ms p99 {summary['itl_p99_ms']} ms; left over: {held or 'nothing'}"
    )
    for name, g in sorted(growth.items()):
        print(f"  RSS {name:<48} {g:+.1%}")
    return summary


def plot(sampler: RssSampler, path: str, what: str) -> None:
    """One panel per process: its RSS against requests finished, on a linear scale of its own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({name for _, row in sampler.samples for name in row})
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 1.8 * len(names) + 0.6), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        pairs = zip(sampler.samples, sampler.finished_at)
        points = [(n, row[name] / 1024) for (_, row), n in pairs if name in row]
        ax.plot([p[0] for p in points], [p[1] for p in points])
        top = max(p[1] for p in points)
        ax.set_ylim(0, top * 1.15)
        ax.set_ylabel("MiB")
        ax.set_title(name, fontsize=8, loc="left")
    axes[-1, 0].set_xlabel("requests finished")
    fig.suptitle(f"Resident memory of each server process: {what}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.soak", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="start `ember serve MODEL` (else --base-url)")
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[], help="more `ember serve` flags")
    p.add_argument("--base-url", help="a running server")
    p.add_argument("--pid", type=int, help="with --base-url: the server's pid, for memory sampling")
    p.add_argument("--served-model-name", default="soak")
    p.add_argument("--concurrency", type=int, default=500)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=600.0, help="per request (s)")
    p.add_argument("--rss-interval", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    if bool(args.model) == bool(args.base_url):
        p.error("give --model (a server to start) or --base-url (a running one)")
    proc = None
    if args.model:
        proc, url, pid = start_server(args)
    else:
        url, pid = args.base_url, args.pid
    sampler = RssSampler(pid or 0, args.rss_interval)
    try:
        if pid:
            sampler.start()
        outcomes, seconds = asyncio.run(drive(args, url, sampler))
        held = left_over(url)
        sampler.done.set()
        summary = report(outcomes, seconds, sampler, held)
        if args.result_json:
            rows = [[t, n, row] for (t, row), n in zip(sampler.samples, sampler.finished_at)]
            Path(args.result_json).write_text(json.dumps(summary | {"rss_kib": rows}, indent=1))
        if args.plot and sampler.samples:
            plot(sampler, args.plot, f"{args.requests} requests, {args.concurrency} concurrent clients")
    finally:
        sampler.done.set()
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    bad = summary["outcomes"].get("error", 0)
    return 1 if bad or held else 0


if __name__ == "__main__":
    sys.exit(main())
