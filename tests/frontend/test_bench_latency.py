"""`ember bench latency` (frontend/bench/latency.py): the bandwidth microbenchmark, the figures' math, and
one real run of `run()` through the in-process engine on a tiny checkpoint, checked via --result-json.

Run: `pytest -q tests/frontend/test_bench_latency.py`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

import coreproc
from coreproc.base.config import ConfigError, EngineConfig
from frontend.bench import latency as bench_latency
from frontend.bench.latency import Iteration, measure_bandwidth, percentile, summarize

BUNDLED = Path(coreproc.__file__).parent / "assets" / "default_model"


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
    iters = [
        Iteration(1.5, 0.5, 11, 10, 1, 100),
        Iteration(1.5, 0.5, 11, 10, 1, 100),
        Iteration(3.5, 0.5, 11, 5, 1, 100),
    ]
    bw = {"read_gbps": 2.0, "copy_gbps": 1.0, "ceiling_gbps": 2.0}
    r = summarize(iters, weight_bytes=10**8, kv_bytes_per_token=1000.0, bandwidth=bw)
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
def test_a_step_reads_only_the_chosen_experts() -> None:
    """Of a mixture of experts' weights a decode step counts the chosen experts only: top-k of E for
    one token, 1 - (1 - k / E) ** batch of them for a batch; a dense model's all."""
    from coreproc.base.protocol import WorkerReady
    from frontend.bench.latency import step_weight_bytes

    common = dict(rank=0, num_kv_blocks=1, kv_bytes_per_block=1, load_seconds=0.0, device="cpu")
    dense = WorkerReady(weight_bytes=1000, **common)
    moe = WorkerReady(weight_bytes=1000, expert_bytes=800, expert_share=0.25, **common)
    assert step_weight_bytes([dense], 1) == step_weight_bytes([dense], 32) == 1000
    assert step_weight_bytes([moe], 1) == 200 + 200  # the other weights and a quarter of the experts
    assert step_weight_bytes([moe], 2) == 200 + 800 - 450  # 1 - 0.75 ** 2 of the experts
    assert step_weight_bytes([moe, moe], 1) == 800  # each rank's own


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
    with pytest.raises(ConfigError, match="batch-size"):
        bench_latency.run(parse("--batch-size", "0"), config)


@pytest.mark.unit
def test_batched_iterations_count_every_request() -> None:
    """Two requests of 11 tokens decoded together in 1 s after 0.5 s: 20 decode tokens, and a step
    reads the KV of both."""
    it = Iteration(1.5, 0.5, 22, 10, requests=2, prompt_tokens=200)
    assert (
        it.decode_tokens == 20 and it.decode_tps == pytest.approx(20.0) and it.tpot_ms == pytest.approx(100.0)
    )
    bw = {"read_gbps": 2.0, "copy_gbps": 1.0, "ceiling_gbps": 2.0}
    r = summarize([it], weight_bytes=10**8, kv_bytes_per_token=1000.0, bandwidth=bw)
    assert r["mean_context"] == pytest.approx(105.5) and r["kv_bytes_per_step"] == pytest.approx(2 * 105_500)


@pytest.mark.e2e
@pytest.mark.parametrize("workload", ["copy", "rewrite", "complete"])
def test_speculative_batch_run_reports_acceptance_and_the_step_split(tmp_path: Path, workload: str) -> None:
    """The bundled (trained) model: it continues the copy workload's code, so n-gram proposals hold."""
    config = EngineConfig.create(
        str(BUNDLED), device="cpu", num_kv_blocks=256, max_model_len=1024,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}',
    )  # fmt: skip
    out = tmp_path / "latency.json"
    args = parse(
        "--workload", workload, "--input-len", "48", "--output-len", "12", "--num-iters", "1",
        "--num-iters-warmup", "0", "--batch-size", "2", "--bandwidth-mib", "16", "--result-json", str(out),
    )  # fmt: skip
    assert bench_latency.run(args, config) == 0
    r = json.loads(out.read_text())
    assert r["batch_size"] == 2 and r["workload"] == workload and r["iterations"][0]["requests"] == 2
    assert set(r["step_split_ms"]) == {"forward_ms", "draft_ms", "sample_ms", "schedule_ms"}
    assert r["step_split_ms"]["forward_ms"] > 0 and r["step_split_ms"]["draft_ms"] == 0
    assert r["speculative_config"]["method"] == "ngram"
    if workload == "copy":  # ignores EOS, and the copy is what n-gram proposals find
        assert r["iterations"][0]["output_tokens"] == 24
        spec = r["speculation"]
        assert spec["num_proposed"] > 0 and len(spec["acceptance_per_position"]) <= 3
        assert spec["num_proposed"] == sum(spec["proposed_per_position"])


@pytest.mark.unit
def test_spec_table_renders_speedups_over_plain(tmp_path: Path) -> None:
    from tools.bench_spec import render, rows

    names = [name for name, _ in rows("draft.gguf", [1, 8])]
    assert (
        names[0] == "b1_rewrite_plain"
        and "b8_complete_draft" in names
        and "b8_rewrite_ngram_fixed" not in names
    )
    base = {"batch_size": 1, "workload": "rewrite", "tokens_per_step": 1.0}
    split = {"forward_ms": 100.0, "draft_ms": 0.0, "sample_ms": 1.0, "schedule_ms": 0.1}
    (tmp_path / "b1_rewrite_plain.json").write_text(
        json.dumps({**base, "decode_tps": 8.0, "step_split_ms": split})
    )
    spec = {"acceptance_per_position": [0.9, 0.5]}
    row = {**base, "decode_tps": 20.0, "tokens_per_step": 2.5, "step_split_ms": split, "speculation": spec}
    (tmp_path / "b1_rewrite_ngram.json").write_text(json.dumps(row))
    table = render(tmp_path).splitlines()
    assert table[2].startswith("| 1 | rewrite | plain | 8.0 | 1.00x |")
    assert table[3].startswith(
        "| 1 | rewrite | ngram | 20.0 | 2.50x | 2.50 | 90% 50% | 100.0 / 0.0 / 1.0 / 0.1 |"
    )
