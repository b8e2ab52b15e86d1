"""Fuzzing every route of a live `ember serve` from its own `/openapi.json` with schemathesis.

Schemathesis generates valid and invalid bodies for each operation (its coverage and fuzzing
phases); the server must never answer 5xx (`not_a_server_error`) and must answer each request within
`--max-response-time`, and afterwards it must be healthy with no KV block in use. The frontend's peak
RSS over the run is printed. CI runs a short profile with one seed; the long one by hand:
`EMBER_FUZZ_SEEDS=11,12,13 EMBER_FUZZ_EXAMPLES=100 \
  pytest -q -s -m reliability tests/e2e/test_fuzz_openapi.py`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server_util import start_server, stop_server, wait_idle

pytestmark = pytest.mark.reliability

SEEDS = [int(s) for s in os.environ.get("EMBER_FUZZ_SEEDS", "1").split(",")]
EXAMPLES = int(os.environ.get("EMBER_FUZZ_EXAMPLES", "20"))  # per operation, fuzzing phase
MAX_RESPONSE_S = 5.0


@pytest.fixture(scope="module")
def server(make_ckpt):
    proc, url = start_server(
        str(make_ckpt("llama")), "--max-model-len", "256", "--max-num-seqs", "64", name="llama"
    )
    yield proc, url
    stop_server(proc)


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


@pytest.mark.parametrize("seed", SEEDS)
def test_no_route_answers_5xx_or_slowly(server, seed, tmp_path):
    proc, url = server
    st = Path(sys.executable).with_name("st")
    assert st.exists() or shutil.which("st"), "schemathesis is a dev dependency"
    cmd = [
        str(st if st.exists() else "st"),
        "run",
        f"{url}/openapi.json",
        "--checks",
        "not_a_server_error",
        "--max-response-time",
        str(MAX_RESPONSE_S),
        "--max-examples",
        str(EXAMPLES),
        "--seed",
        str(seed),
        "--workers",
        "1",
        "--phases",
        "examples,coverage,fuzzing",
        "--no-color",
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "", "NO_COLOR": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=tmp_path, env=env)
    summary = [line for line in run.stdout.splitlines() if "generated" in line or "passed" in line]
    print(f"seed {seed}: {' | '.join(summary)}; frontend peak RSS {peak_rss_mib(proc.pid):.0f} MiB")
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    wait_idle(url)
