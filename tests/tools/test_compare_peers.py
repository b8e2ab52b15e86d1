"""`tools/compare_peers.py`: one real run on the bundled model (Ember and transformers for real, vLLM and
llama.cpp reported as not installed, nothing downloaded), and the parser of llama-batched-bench's table
on output captured from a real build (llama.cpp of llama-cpp-python 0.3.36, the bundled model, bf16).

Run: `pytest -q tests/tools/test_compare_peers.py`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO
from tools import plot_peers
from tools.peers.run_llamacpp import bench_command, parse_batched_bench, throughput

# stdout of `llama-batched-bench -m default_model-bf16.gguf -c 96 -b 2048 -ub 512 -npp 16 -ntg 8 -npl 1,4
# -t 2 -tb 2` (llama.cpp 0.5.0-dev, commit 0c1e570, vendored in llama-cpp-python 0.3.36), as captured
BATCHED_BENCH_SAMPLE = """\

llama_batched_bench: n_kv_max = 1024, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |      8 |    1 |     24 |    0.012 |  1378.36 |    0.016 |   507.55 |    0.027 |   876.87 |
|    16 |      8 |    4 |     96 |    0.204 |   313.48 |    0.110 |   290.72 |    0.314 |   305.51 |

"""  # noqa: E501 (verbatim)


def table_rows(stdout: str) -> dict[str, list[str]]:
    """The table's data rows by peer (cells split on runs of 2+ spaces), after its dashed rule."""
    lines = stdout.splitlines()
    rule = next(i for i, ln in enumerate(lines) if re.fullmatch(r"-+(  -+)+", ln))
    header = re.split(r"\s{2,}", lines[rule - 1].strip())
    rows = {}
    for ln in lines[rule + 1 :]:
        cells = re.split(r"\s{2,}", ln.strip())
        assert len(cells) == len(header), (header, cells)
        rows[cells[0]] = cells
    return rows


@pytest.mark.e2e
def test_compare_peers_ember_and_transformers(tmp_path: Path) -> None:
    result_json = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "tools.compare_peers", "--model", "coreproc/assets/default_model",
        "--peers", "ember,transformers,vllm,llamacpp", "--no-install", "--work-dir", str(tmp_path / "work"),
        "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--prefill-len", "24",
        "--result-json", str(result_json),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(result_json.read_text())
    assert out["workload"] == {
        "num_prompts": 2,
        "input_len": 8,
        "output_len": 4,
        "prefill_len": 24,
        "gguf": None,
        "threads": 2,
        "dtype": "bfloat16",
        "seed": 0,
        "greedy": True,
        "ignore_eos": True,
    }
    assert out["model"]["params"] > 1_000_000 and out["machine"]["cores"] >= 1
    peers = {p["peer"]: p for p in out["peers"]}
    assert list(peers) == ["ember", "transformers", "vllm", "llamacpp"]
    for name in ("ember", "transformers"):
        p = peers[name]
        assert p["status"] == "ok", p
        assert p["batch_tps"] > 0 and p["single_tps"] > 0 and p["ready_s"] > 0
        assert p["detail"]["batch_output_tokens"] == 2 * 4 and p["detail"]["single_output_tokens"] == 4
    ember = peers["ember"]
    assert ember["detail"]["prefill_tps"] > 0 and ember["detail"]["single_decode_tps"] > 0
    assert 0 < ember["detail"]["first_token_after_ready_s"] < 60
    for name in ("vllm", "llamacpp"):
        assert peers[name]["status"] == "not installed (--no-install)"
        assert peers[name]["batch_tps"] is None
    assert not (tmp_path / "work" / "vllm").exists() and not (tmp_path / "work" / "llamacpp").exists()

    rows = table_rows(proc.stdout)
    assert "model:" in proc.stdout and "workload:" in proc.stdout and "machine:" in proc.stdout
    # peer, version, batch, single, b1 decode, prefill, ready, first token, 3 ratios, status
    for name, p in peers.items():
        cells = rows[name]
        if p["status"] != "ok":
            assert cells[2:11] == ["-"] * 9 and cells[11] == "not installed (--no-install)"
            continue
        assert cells[11] == "ok"
        assert float(cells[2]) == pytest.approx(p["batch_tps"], abs=0.051)
        assert cells[8] == f"{ember['batch_tps'] / p['batch_tps']:.2f}"
        assert p["ember_over_peer"]["batch"] == pytest.approx(ember["batch_tps"] / p["batch_tps"])
    assert rows["ember"][8] == rows["ember"][9] == rows["ember"][10] == "1.00"
    assert float(rows["ember"][7]) >= float(rows["ember"][6])  # first token after ready

    # the plot of this run: one bar per peer with figures (ember, transformers on the folder's dtype)
    assert [name for name, _ in plot_peers.bars([out])] == ["ember bfloat16", "transformers bfloat16"]
    png = tmp_path / "plot.png"
    assert plot_peers.main([str(result_json), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert plot_peers.main([str(tmp_path / "missing.json"), "--out", str(png)]) == 2


@pytest.mark.unit
def test_parse_batched_bench_sample() -> None:
    rows = parse_batched_bench(BATCHED_BENCH_SAMPLE)
    assert [r["b"] for r in rows] == [1, 4]
    for r in rows:
        assert (r["pp"], r["tg"]) == (16, 8) and r["n_kv"] == r["b"] * 24
        seconds, tokens = throughput(r)
        assert tokens == r["b"] * 8
        assert seconds == pytest.approx(r["t"], abs=0.002)  # T = T_PP + T_TG, as printed to 3 places
        assert r["s_tg"] == pytest.approx(r["b"] * 8 / r["t_tg"], rel=0.05)


@pytest.mark.unit
def test_batched_bench_command() -> None:
    job = {"num_prompts": 32, "input_len": 128, "output_len": 128, "threads": 2}
    cmd = bench_command("llama-batched-bench", "m.gguf", job)
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert flags == {"-m": "m.gguf", "-c": str(32 * 256), "-b": "2048", "-ub": "512", "-npp": "128",
                     "-ntg": "128", "-npl": "1,32", "-t": "2", "-tb": "2"}  # fmt: skip
    prefill = bench_command(
        "llama-batched-bench", "m.gguf", job | {"prefill_prompt": [5] * 512}, prefill=True
    )
    flags = dict(zip(prefill[1::2], prefill[2::2]))
    assert (flags["-npp"], flags["-ntg"], flags["-npl"], flags["-c"]) == ("512", "1", "1", "513")


@pytest.mark.unit
def test_failures_become_one_line_reasons(tmp_path: Path) -> None:
    from tools.compare_peers import run_runner
    from tools.peers.install import PeerError, run_step

    with pytest.raises(PeerError, match=r"^not installed: pip install x failed: no such package x$"):
        cmd = [sys.executable, "-c", "print('resolving'); raise SystemExit('no such package x')"]
        run_step("pip install x", cmd, tmp_path / "install.log", "not installed: ")
    code = "import sys; print('PEER_RESULT {}'); raise ValueError('bad checkpoint')"
    with pytest.raises(PeerError, match=r"^failed: exit 1: ValueError: bad checkpoint$"):
        run_runner("x", [sys.executable, "-c", code], {}, tmp_path, timeout=60)
    with pytest.raises(PeerError, match=r"^failed: timed out after 1 s"):
        run_runner("y", [sys.executable, "-c", "import time; time.sleep(30)"], {}, tmp_path, timeout=1)
