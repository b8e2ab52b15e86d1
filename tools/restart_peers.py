"""Restarts of Ember against llama.cpp's start on the same model, in one run: launch to a served token.

Runs in its own process (a repo script). Ember: `ember bench restart MODEL --runs N [--mode snapshot]`
(cold, warm from `ember preload`, snapshot restore; launch to /health 200, then one completion token).
llama.cpp: `llama-server -m FILE` of the build `tools/compare_peers` uses (its server target built on
first use), the same definition: launch to /health 200, then one token from /completion; its default
settings but the threads. Best of --runs each, one engine after the other. For a Hugging Face folder
give llama.cpp's file with --gguf.

    python -m tools.restart_peers Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf --runs 3 [--snapshot] [-- FLAGS]
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from frontend.bench.restart import wait_healthy
from tools.peers.install import PeerError, llamacpp_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llamacpp_start(binary: Path, gguf: str, threads: int, timeout: float = 600.0) -> tuple[float, float]:
    """(seconds to /health 200, seconds to the first token) of one `llama-server` launch."""
    port = free_port()
    cmd = [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads)]
    http = httpx.Client(timeout=60)  # built before the clock starts, as Ember's bench does
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(http, url, start + timeout, proc)
        healthy = time.perf_counter() - start
        body = {"prompt": "def", "n_predict": 1, "temperature": 0}
        http.post(f"{url}/completion", json=body).raise_for_status()
        return healthy, time.perf_counter() - start
    finally:
        http.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def against_llamacpp(table: str, first: float) -> list[str]:
    """Each Ember start of `bench restart`'s table (cold, warm, snapshot; not "warm 1st") against
    llama.cpp's launch to a first token (`first` seconds)."""
    out = []
    for kind in ("cold", "warm", "snapshot"):
        row = re.search(rf"^{kind}\s+(\d+\.\d+)\s", table, re.M)
        if row:
            ember = float(row.group(1))
            ratio = ember / first
            out.append(f"Ember's {kind} start to a first token: {ember:.2f} s, {ratio:.2f}x llama.cpp's")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.restart_peers", description=__doc__.split("\n")[0])
    p.add_argument("model", help="a GGUF file or a Hugging Face folder (then --gguf)")
    p.add_argument("--gguf", default=None, help="llama.cpp's file (default: the model, when it is GGUF)")
    p.add_argument("--runs", type=int, default=3, help="starts of each kind (the best is kept)")
    p.add_argument("--snapshot", action="store_true", help="also time Ember's snapshot restore (CRIU)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "ember-peers"))
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []  # after --: more `ember bench restart` flags
    args = p.parse_args(argv[: len(argv) - len(extra) - (1 if "--" in argv else 0)])
    gguf = args.gguf or (args.model if args.model.endswith(".gguf") else None)
    if gguf is None:
        p.error("a Hugging Face folder needs --gguf (llama.cpp's file of the same model)")
    mode = ["--mode", "snapshot"] if args.snapshot else []
    cmd = [sys.executable, "-m", "frontend.launch", "bench", "restart", args.model, "--runs", str(args.runs)]
    done = subprocess.run([*cmd, *mode, *extra], capture_output=True, text=True)
    print(done.stdout, end="")
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr, end="")
        return done.returncode
    try:
        binary = llamacpp_server(Path(args.work_dir), True, 2)
    except PeerError as e:
        print(f"llama.cpp {e}")
        return 1
    starts = [llamacpp_start(binary, gguf, args.threads) for _ in range(args.runs)]
    healthy, first = min(starts, key=lambda s: s[1])
    row = f"{'llama.cpp':<10}{first:>18.2f}{healthy:>22.2f}{first - healthy:>17.2f}"
    print(f"{row}   (llama-server -m FILE -t {args.threads}, best of {args.runs})")
    for line in against_llamacpp(done.stdout, first):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
