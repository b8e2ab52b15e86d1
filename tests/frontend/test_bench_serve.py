"""`ember bench serve` (frontend/bench/serve.py): metric math on synthetic timings, then real runs.

The unit tests feed hand-made `RequestRecord`s to `compute_metrics` and check TPOT, percentiles (against
numpy), goodput and peak concurrency. The e2e tests start one real `ember serve` on the bundled model
(port 0, address read from its start-up line) and run the benchmark against it through `main`: random
and shared-prefix token-id prompts, chat text prompts, an unreachable server, and the optional plot.
Run: `pytest -q tests/frontend/test_bench_serve.py`.
"""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path

import numpy as np
import pytest

from frontend.bench import serve as bench_serve
from frontend.bench.serve import BenchServeConfig, RequestRecord, compute_metrics, make_requests
from frontend.bench.serve_report import LATENCY_METRICS, parse_counters
from tests.paths import ASSETS
from tests.server_util import start_server, stop_server

BUNDLED_MODEL = ASSETS / "default_model"
VOCAB = 8192  # the bundled model's vocabulary
NUM_PROMPTS, OUTPUT_LEN = 12, 8


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    return p.parse_args(list(argv))


# ---------------------------------------------------------------- unit: metric math


def record(start: float, ttft: float, gaps: list[float], out: int, prompt: int = 10) -> RequestRecord:
    return RequestRecord(start, ttft + sum(gaps), ttft, gaps, out, prompt)


@pytest.mark.unit
def test_metrics_of_synthetic_timings() -> None:
    recs = [
        record(0.0, 0.100, [0.010, 0.020, 0.030], 4),
        record(0.05, 0.200, [0.040], 2),
        record(0.5, 0.050, [], 1),  # one token: no TPOT, no ITL
        RequestRecord(0.1, 0.3, error="HTTP 400: bad"),
    ]
    m = compute_metrics(recs, duration=2.0, percentiles=(50, 90, 99.5), goodput={"ttft": 150, "tpot": 25})
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_output_tokens"] == 7 and m["total_input_tokens"] == 30
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(18.5)
    tpots = [0.060 / 3 * 1000, 0.040 / 1 * 1000]  # (E2E - TTFT) / (out - 1), ms
    assert m["mean_tpot_ms"] == pytest.approx(np.mean(tpots))
    ttfts = np.array([100.0, 200.0, 50.0])
    itls = np.array([10.0, 20.0, 30.0, 40.0])
    e2els = np.array([160.0, 240.0, 50.0])
    for name, values in (("ttft", ttfts), ("itl", itls), ("e2el", e2els)):
        assert m[f"mean_{name}_ms"] == pytest.approx(values.mean())
        assert m[f"median_{name}_ms"] == pytest.approx(np.median(values))
        assert m[f"std_{name}_ms"] == pytest.approx(values.std())
        for q, key in ((50, "p50"), (90, "p90"), (99.5, "p99.5")):
            assert m[f"{key}_{name}_ms"] == pytest.approx(np.percentile(values, q))
    # ttft <= 150 and tpot <= 25: request 0 (100 ms, 20 ms) and request 2 (50 ms, no TPOT) meet both
    assert m["goodput"] == pytest.approx(2 / 2.0)
    assert m["max_concurrent_requests"] == 3  # 0.0-0.16, 0.05-0.29 and the failed 0.1-0.4 overlap


@pytest.mark.unit
def test_empty_series_and_no_goodput() -> None:
    m = compute_metrics([RequestRecord(0.0, 1.0, error="boom")], duration=1.0)
    assert m["completed"] == 0 and m["goodput"] is None
    assert m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0


@pytest.mark.unit
def test_prompts_and_prometheus_parsing() -> None:
    cfg = BenchServeConfig(
        "http://x", dataset="prefix", num_prompts=5, input_len=4, prefix_len=6, num_prefixes=2
    )
    reqs = make_requests(cfg)
    assert [r.prompt_len for r in reqs] == [10] * 5
    assert reqs[0].prompt[:6] == reqs[2].prompt[:6] == reqs[4].prompt[:6] != reqs[1].prompt[:6]
    assert all(10 <= t < cfg.vocab_size for r in reqs for t in r.prompt)
    assert make_requests(cfg) == reqs  # seeded
    page = (
        "# TYPE ember_prefix_cache_hits_total counter\n"
        'ember_prefix_cache_hits_total{model_name="a b"} 3.0\n'
        'ember_prefix_cache_hits_created{model_name="a b"} 1.7e9\n'
        "ember_prefix_cache_queries 8 1700000000\n"
    )
    assert parse_counters(page, bench_serve.PREFIX_COUNTERS) == {
        "ember_prefix_cache_hits": 3.0,
        "ember_prefix_cache_queries": 8.0,
    }
    chat = make_requests(BenchServeConfig("http://x", backend="openai-chat", num_prompts=2, input_len=5))
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 5 for r in chat)
    with pytest.raises(SystemExit):
        parse("--base-url", "http://x", "--goodput", "latency:5")


@pytest.mark.unit
def test_sharegpt_prompts(tmp_path: Path) -> None:
    convs = [
        {"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "hi"}]},
        {"conversations": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}]},
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    reqs = make_requests(
        BenchServeConfig("http://x", dataset="sharegpt", dataset_path=str(path), num_prompts=5)
    )
    assert len(reqs) == 5 and {r.prompt for r in reqs} == {"hello there", "why?"}
    assert all(r.prompt_len is None for r in reqs)
    with pytest.raises(bench_serve.BenchServeError):
        BenchServeConfig("http://x", dataset="sharegpt")


# ---------------------------------------------------------------- e2e: a live server


@pytest.fixture(scope="module")
def server_url():
    proc, url = start_server(str(BUNDLED_MODEL), name="default_model")
    yield url
    stop_server(proc)


def bench(url: str, out: Path, *extra: str) -> tuple[int, dict]:
    """Run `main` with small defaults (`extra` overrides them); its exit code and the result JSON."""
    argv = ["--base-url", url, "--num-prompts", str(NUM_PROMPTS), "--output-len", str(OUTPUT_LEN)]
    argv += ["--input-len", "32", "--vocab-size", str(VOCAB), "--result-json", str(out)]
    argv += ["--metrics-settle", "0", *extra]  # only the prefix test waits for /metrics to refresh
    code = bench_serve.main(parse(*argv))
    return code, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.e2e
def test_random_completions(server_url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, r = bench(server_url, tmp_path / "r.json", "--max-concurrency", "4", "--goodput", "e2el:60000")
    assert code == 0
    assert (r["completed"], r["failed"]) == (NUM_PROMPTS, 0), r["errors"]
    assert r["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS  # ignore_eos
    assert r["input_lens"] == [32] * NUM_PROMPTS  # token-id prompts are exact
    assert 1 <= r["max_concurrent_requests"] <= 4
    for ttft, itl, e2el in zip(r["ttfts"], r["itls"], r["e2els"]):
        assert 0 < ttft <= e2el
        assert 1 <= len(itl) <= OUTPUT_LEN - 1
        assert ttft + sum(itl) <= e2el + 1e-6
    for m in LATENCY_METRICS:
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert r[f"{stat}_{m}_ms"] >= 0
    assert r["median_ttft_ms"] <= r["median_e2el_ms"]
    assert r["goodput"] == pytest.approx(r["request_throughput"])
    assert r["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])
    printed = capsys.readouterr().out
    assert printed.startswith(f"summary: {NUM_PROMPTS}/{NUM_PROMPTS} ok") and "Time to first token" in printed


@pytest.mark.e2e
def test_shared_prefixes_hit_the_cache(server_url: str, tmp_path: Path) -> None:
    extra = ["--dataset", "prefix", "--num-prefixes", "2", "--prefix-len", "32", "--max-concurrency", "2"]
    code, r = bench(server_url, tmp_path / "p.json", *extra, "--seed", "7", "--metrics-settle", "1.5")
    assert code == 0 and r["completed"] == NUM_PROMPTS, r["errors"]
    assert r["input_lens"] == [64] * NUM_PROMPTS
    assert r["prefix_cache_queries"] >= NUM_PROMPTS * 64 - 16  # the engine may skip the last token
    assert r["prefix_hit_rate"] > 0
    # Ember's /metrics also says how long the worker spent in steps: a share of the run's wall time
    assert 0 < r["worker_busy_share"] <= 1.05


@pytest.mark.e2e
def test_chat_backend(server_url: str, tmp_path: Path) -> None:
    code, r = bench(server_url, tmp_path / "c.json", "--backend", "openai-chat", "--request-rate", "50")
    assert code == 0 and r["completed"] == NUM_PROMPTS, r["errors"]
    assert r["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert all(n > 16 for n in r["input_lens"])  # 32 words (plus the chat template), from the usage chunk


@pytest.mark.e2e
def test_failed_requests_exit_1(server_url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, r = bench(server_url, tmp_path / "f.json", "--num-prompts", "2", "--vocab-size", str(10 * VOCAB))
    assert code == 1 and r["failed"] == 2 and all(e.startswith("HTTP 400") for e in r["errors"])
    assert "requests failed" in capsys.readouterr().err


@pytest.mark.e2e
def test_unreachable_server_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, r = bench(f"http://127.0.0.1:{port}", tmp_path / "u.json")
    assert code == 2 and r == {}
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "unreachable" in err and "\n" not in err


@pytest.mark.e2e
def test_plot(server_url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    png = tmp_path / "bench.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # without matplotlib, --plot fails before sending any load
        code, r = bench(server_url, tmp_path / "n.json", "--plot", str(png))
        assert code == 2 and r == {} and "matplotlib" in capsys.readouterr().err
        pytest.skip("matplotlib is not installed")
    code, _ = bench(server_url, tmp_path / "g.json", "--plot", str(png), "--num-prompts", "4")
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
