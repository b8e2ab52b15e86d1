"""`ember bench latency` (frontend/bench/latency.py): the bandwidth microbenchmark, the figures' math, and
one real run of `run()` through the in-process engine on a tiny checkpoint, checked via --result-json.

Run: `pytest -q tests/test_bench_latency.py`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from coreproc.config import ConfigError, EngineConfig
from frontend.bench import latency as bench_latency
from frontend.bench.latency import Iteration, measure_bandwidth, percentile, summarize


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_latency.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.unit
def test_bandwidth_microbenchmark_is_positive() -> None:
    bw = measure_bandwidth("cpu", nbytes=8 * 2**20, reps=2)
    assert bw["read_gbps"] > 0 and bw["copy_gbps"] > 0
    assert bw["ceiling_gbps"] == max(bw["read_gbps"], bw["copy_gbps"])


@pytest.mark.unit
@pytest.mark.parametrize("values", [[3.0], [2.0, 1.0], [5.0, 1.0, 4.0, 2.5], [0.1 * i for i in range(11)]])
@pytest.mark.parametrize("q", [0, 50, 90, 100])
def test_percentile_matches_numpy(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


@pytest.mark.unit
def test_summarize_math() -> None:
    # 11 tokens each, the first after 0.5 s; decode times 1, 1 and 3 s: 30 tokens in 5 s
    iters = [Iteration(1.5, 0.5, 11, 10), Iteration(1.5, 0.5, 11, 10), Iteration(3.5, 0.5, 11, 5)]
    bw = {"read_gbps": 2.0, "copy_gbps": 1.0, "ceiling_gbps": 2.0}
    r = summarize(iters, weight_bytes=10**8, kv_bytes_per_token=1000.0, input_len=100, bandwidth=bw)
    assert r["mean_latency_s"] == pytest.approx(6.5 / 3)
    assert r["median_latency_s"] == pytest.approx(1.5)
    assert r["p90_latency_s"] == pytest.approx(1.5 + 0.8 * 2.0)  # numpy's linear interpolation
    assert r["decode_tps"] == pytest.approx(30 / 5.0)
    assert r["tpot_ms"] == pytest.approx(1000 / 6.0)
    assert r["mean_context"] == pytest.approx(105.5)
    assert r["bytes_per_step"] == pytest.approx(10**8 + 105_500)
    # 25 steps in 5 s (the last iteration speculated: 10 tokens in 5 steps); weights read once a step
    assert r["tokens_per_step"] == pytest.approx(30 / 25)
    assert r["achieved_gbps"] == pytest.approx(r["bytes_per_step"] * 5.0 / 1e9)
    assert r["roofline_tps"] == pytest.approx(2e9 / r["bytes_per_step"] * 1.2)
    assert r["bandwidth_fraction"] == pytest.approx(r["achieved_gbps"] / 2.0)


@pytest.mark.e2e
def test_run_writes_sane_figures(make_ckpt, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = EngineConfig.create(make_ckpt("llama"), device="cpu", num_kv_blocks=64)
    out = tmp_path / "latency.json"
    args = parse(
        "--input-len", "16", "--output-len", "8", "--num-iters", "3", "--num-iters-warmup", "1",
        "--bandwidth-mib", "16", "--result-json", str(out),
    )  # fmt: skip
    assert bench_latency.run(args, config) == 0
    r = json.loads(out.read_text())
    assert (r["input_len"], r["output_len"], r["num_iters"]) == (16, 8, 3)
    assert len(r["latencies_s"]) == len(r["iterations"]) == 3
    assert all(it["output_tokens"] == 8 and it["decode_steps"] == 7 for it in r["iterations"])
    assert r["tokens_per_step"] == 1.0
    assert all(0 < t < lat for t, lat in zip(r["ttfts_s"], r["latencies_s"]))
    assert r["mean_latency_s"] == pytest.approx(sum(r["latencies_s"]) / 3)
    assert min(r["latencies_s"]) <= r["median_latency_s"] <= r["p90_latency_s"] <= max(r["latencies_s"])
    # decode speed agrees with the per-iteration times: 7 tokens after the first, per iteration
    decode_s = sum(lat - t for t, lat in zip(r["ttfts_s"], r["latencies_s"]))
    assert r["decode_tps"] == pytest.approx(3 * 7 / decode_s)
    assert r["tpot_ms"] == pytest.approx(1000 / r["decode_tps"])
    assert r["weight_bytes"] > 0 and r["kv_bytes_per_token"] > 0
    assert r["bytes_per_step"] == pytest.approx(r["weight_bytes"] + r["kv_bytes_per_token"] * (16 + 4))
    assert r["ceiling_gbps"] > 0 and 0 < r["bandwidth_fraction"]
    assert r["device"] == "cpu" and r["tensor_parallel_size"] == 1
    text = capsys.readouterr().out
    assert "summary:" in text and "median" in text and "p90" in text


@pytest.mark.unit
def test_rejects_lengths_beyond_the_context(make_ckpt) -> None:
    config = EngineConfig.create(make_ckpt("llama"), device="cpu", max_model_len=32, num_kv_blocks=8)
    with pytest.raises(ConfigError, match="max_model_len"):
        bench_latency.run(parse("--input-len", "30", "--output-len", "8"), config)
