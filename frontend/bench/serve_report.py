"""The pure half of `ember bench serve`: per-request records -> metrics, the printed table, the plot.

Runs in the benchmark's process and does no I/O besides writing the PNG. `compute_metrics` turns
`RequestRecord`s (one request's timeline) into the summary dict; `parse_counters` reads counters from
a Prometheus text page; `format_table` and `write_plot` render a result dict. numpy and matplotlib
are imported inside the functions that need them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
TITLES = {
    "ttft": "Time to first token",
    "tpot": "Time per output token",
    "itl": "Inter-token latency",
    "e2el": "End-to-end latency",
}


def percentile_name(q: float) -> str:
    """`p99` for 99.0, `p99.9` for 99.9: the column and key prefix of a percentile."""
    return f"p{int(q) if q == int(q) else q}"


@dataclass
class RequestRecord:
    """The measured timeline of one request; times in seconds, `start` relative to the run's start."""

    start: float = 0.0
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""

    @property
    def success(self) -> bool:
        return not self.error

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for fewer than two output tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def parse_counters(text: str, names: Sequence[str]) -> dict[str, float]:
    """Sum the samples of each counter in a Prometheus text page (with or without `_total`)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(None, 1)[0]
        base = name.removesuffix("_total")
        if base in names:
            rest = line.rsplit("}", 1)[1] if "{" in line else line.split(None, 1)[1]
            sums[base] = sums.get(base, 0.0) + float(rest.split()[0])
    return sums


def _max_overlap(records: Sequence[RequestRecord]) -> int:
    events = sorted([(r.start, 1) for r in records] + [(r.start + r.latency, -1) for r in records])
    peak = level = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    import numpy as np

    ms = np.asarray(values_s, dtype=float) * 1000.0 if len(values_s) else np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms))}
    out[f"std_{name}_ms"] = float(ms.std())
    for q in percentiles:
        out[f"{percentile_name(q)}_{name}_ms"] = float(np.percentile(ms, q))
    return out


def compute_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    percentiles: Sequence[float] = (50.0, 90.0, 99.0),
    goodput: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Summary metrics of finished requests (latencies in ms; empty series report 0).

    TPOT of a request is (E2E - TTFT) / (output tokens - 1), over requests with more than one output
    token; ITL pools every gap between successive token chunks. Goodput counts successful requests
    meeting every SLO in `goodput` (ms; a one-token request has TPOT 0) per second of `duration`.
    """
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2el": [r.latency for r in ok],
    }
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        "max_concurrent_requests": _max_overlap(records),
        "goodput": None,
    }
    if goodput:
        good = 0
        for r in ok:
            got = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
            good += all(got[k] * 1000.0 <= slo for k, slo in goodput.items())
        result["goodput"] = good / duration if duration > 0 else 0.0
    for name in LATENCY_METRICS:
        result.update(_stats(name, series[name], percentiles))
    return result


def format_table(result: Mapping[str, Any], percentiles: Sequence[float]) -> str:
    """One summary line, then the table of the run's figures."""
    rows: list[tuple[str, Any]] = [
        ("Requests completed / failed", f"{result['completed']} / {result['failed']}"),
        (
            "Max concurrency (cap / peak)",
            f"{result['max_concurrency'] or 'none'} / {result['max_concurrent_requests']}",
        ),
        ("Duration (s)", f"{result['duration']:.2f}"),
        ("Input / output tokens", f"{result['total_input_tokens']} / {result['total_output_tokens']}"),
        ("Requests/s", f"{result['request_throughput']:.2f}"),
        ("Output tokens/s", f"{result['output_throughput']:.2f}"),
        ("Total tokens/s", f"{result['total_token_throughput']:.2f}"),
    ]
    if result.get("goodput") is not None:
        rows.append(("Goodput (requests/s)", f"{result['goodput']:.2f}"))
    hit = result.get("prefix_hit_rate")
    rows.append(("Prefix-cache hit rate", "n/a" if hit is None else f"{100 * hit:.1f}%"))
    busy = result.get("worker_busy_share")
    rows.append(("Worker busy in steps", "n/a" if busy is None else f"{100 * busy:.1f}% of wall time"))
    if result.get("num_images"):
        rows.append(("Images sent", str(result["num_images"])))
        rows.append(("Images/s", f"{result['num_images'] / max(result['duration'], 1e-9):.2f}"))
        hits, misses = result.get("encoder_cache_hits"), result.get("encoder_cache_misses")
        if hits is not None and misses is not None:
            rows.append(("Encoder runs / cache hits", f"{misses:.0f} / {hits:.0f}"))
        if result.get("mm_cache_hits") is not None:
            rows.append(("Images sent as hash (engine held them)", f"{result['mm_cache_hits']:.0f}"))
    cols = ["mean", "median", "std"] + [percentile_name(q) for q in percentiles]
    width = 30 + 10 * len(cols)
    lines = [
        f"summary: {result['completed']}/{result['num_prompts']} ok in {result['duration']:.2f} s, "
        f"{result['output_throughput']:.1f} output tok/s, TTFT median {result['median_ttft_ms']:.1f} ms, "
        f"TPOT median {result['median_tpot_ms']:.2f} ms",
        f" Ember serve benchmark: {result['backend']} / {result['model']} / {result['dataset']} ".center(
            width, "="
        ),
    ]
    lines += [f"{name:<30}{value:>14}" for name, value in rows]
    lines.append(f"{'latency (ms)':<30}" + "".join(f"{c:>10}" for c in cols))
    for m in LATENCY_METRICS:
        lines.append(f"{TITLES[m]:<30}" + "".join(f"{result[f'{c}_{m}_ms']:>10.2f}" for c in cols))
    lines.append("=" * width)
    return "\n".join(lines)


def write_plot(result: Mapping[str, Any], path: str) -> None:
    """TTFT and E2E CDFs, the ITL histogram and output tokens/s over time, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [i for i, e in enumerate(result["errors"]) if not e]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    for key, label in (("ttfts", "TTFT"), ("e2els", "E2E latency")):
        ms = np.sort([result[key][i] * 1000 for i in ok])
        ax1.plot(ms, np.arange(1, len(ms) + 1) / max(1, len(ms)), label=label)
    ax1.set(xlabel="ms", ylabel="fraction of requests", title="Latency CDF")
    ax1.legend()
    ax2.hist([g * 1000 for i in ok for g in result["itls"][i]] or [0.0], bins=40)
    ax2.set(xlabel="ms", ylabel="chunk gaps", title="Inter-token latency")
    times, weights = [], []
    for i in ok:
        chunk_t = (
            result["start_times"][i]
            + result["ttfts"][i]
            + np.concatenate([[0.0], np.cumsum(result["itls"][i])])
        )
        times += list(chunk_t)
        weights += [result["output_lens"][i] / len(chunk_t)] * len(chunk_t)
    width = max(0.05, result["duration"] / 40)
    bins = np.arange(0.0, result["duration"] + width, width)
    counts, edges = np.histogram(times, bins=bins, weights=weights)
    ax3.step(edges[:-1], counts / width, where="post")
    ax3.set(xlabel="seconds since start", ylabel="output tokens/s", title="Output throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
