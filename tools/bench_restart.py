"""`ember bench restart`: time to ready of a cold start from disk and of a warm restart from the cache.

Runs in the user's shell. Time to ready is measured from launching `ember serve` until `/health`
answers 200 *and* a first token has come back from `/v1/completions` (not until the process starts).
Cold: the server loads (and quantizes) the checkpoint itself. Warm: an `ember preload` daemon holds the
processed weights and the server starts with `--load-format ipc_cache`. Prints both, and the ratio.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from coreproc.config import EngineConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: bundled model)")
    p.add_argument("--runs", type=int, default=1, help="measurements of each kind (the best is kept)")


def engine_flags(config: EngineConfig) -> list[str]:
    m = config.model
    flags = [m.model, "--dtype", m.dtype, "--max-model-len", str(m.max_model_len)]
    if m.quantization:
        flags += ["--quantization", m.quantization]
    return flags


def time_to_ready(cmd: list[str], timeout: float = 900.0) -> tuple[float, float, str]:
    """Seconds from launch to /health 200 plus one generated token, and to /health 200 alone;
    returns (ready seconds, healthy seconds, start-up lines)."""
    import httpx

    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        url = None
        while url is None:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the server exited ({proc.wait()}) before listening")
            lines.append(line.strip())
            found = re.search(r"listening on (http://\S+)", line)
            url = found.group(1) if found else None
        deadline = start + timeout
        with httpx.Client(timeout=60) as http:
            while True:
                try:
                    if http.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() > deadline:
                    raise RuntimeError("the server did not become healthy")
                time.sleep(0.01)
            healthy = time.perf_counter() - start
            body = {"prompt": "def", "max_tokens": 1, "temperature": 0}
            reply = http.post(f"{url}/v1/completions", json=body)
            reply.raise_for_status()
        return time.perf_counter() - start, healthy, "\n".join(lines)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    serve = [sys.executable, "-m", "frontend.cli", "serve", *engine_flags(config), "--port", "0"]
    cold, cold_healthy, _ = min(time_to_ready(serve) for _ in range(args.runs))
    with tempfile.TemporaryDirectory(prefix="ember-bench-") as tmp:
        sockets = Path(tmp) / "sockets"
        sockets.mkdir(mode=0o700)
        preload_cmd = [sys.executable, "-m", "frontend.cli", "preload", *engine_flags(config)]
        daemon = subprocess.Popen(
            [*preload_cmd, "--socket-dir", str(sockets)], stdout=subprocess.PIPE, text=True
        )
        try:
            for line in daemon.stdout:
                if "ember preload: ready:" in line:
                    break
            else:
                raise RuntimeError("ember preload failed to start")
            warm_cmd = [*serve, "--load-format", "ipc_cache", "--socket-dir", str(sockets)]
            warm, warm_healthy, lines = min(time_to_ready(warm_cmd) for _ in range(args.runs))
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
    if "from ipc_cache" not in lines:
        print(f"warning: the warm server did not use the cache:\n{lines}", file=sys.stderr)
    size = sum(f.stat().st_size for f in Path(config.model.model).glob("*.safetensors"))
    print(
        f"model {config.model.model} ({size / 2**30:.2f} GiB on disk, dtype {config.model.dtype}, "
        f"quantization {config.model.quantization or 'none'}), {os.cpu_count()} CPUs"
    )
    print(f"{'start':<8}{'time to ready (s)':>20}{'of which healthy (s)':>22}{'first token (s)':>17}")
    print(f"{'cold':<8}{cold:>20.2f}{cold_healthy:>22.2f}{cold - cold_healthy:>17.2f}")
    print(f"{'warm':<8}{warm:>20.2f}{warm_healthy:>22.2f}{warm - warm_healthy:>17.2f}")
    print(f"summary: warm restart is {cold / warm:.1f}x faster than cold ({cold:.2f}s -> {warm:.2f}s)")
    return 0
