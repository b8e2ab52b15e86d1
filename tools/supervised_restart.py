"""Time to recover under a supervisor: kill the engine core of a live `ember serve` and time the way back.

Runs in its own process and plays systemd's `Restart=always`: it starts `ember serve MODEL ...`,
restarts it whenever it exits, and measures, per round (a stream running for --uptime seconds, then
the core killed), (1) from SIGKILL of the `ember-core` process
to the end of a running stream (its error event), (2) to the exit of `ember serve`, (3) to
`/health` answering 200 again from the restarted server and (4) to its first served token. Run it
with `--load-format ipc_cache` and an `ember preload MODEL` daemon running to measure the warm
restart, and without them for the cold one.

    python -m tools.supervised_restart MODEL --rounds 3 [--serve-args --load-format ipc_cache]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "frontend.launch", "serve", model, "--port", str(port), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def healthy(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def processes() -> list[tuple[int, int, str, int]]:
    """(pid, parent pid, title, start time in clock ticks) of every process."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            out.append((int(entry.name), int(fields[1]), cmd, int(fields[19])))
    return out


def core_of(pid: int) -> int:
    """The `ember-core` of the server launched as `pid`: its child, or, when the preload zygote forked
    the server (`ember serve --load-format ipc_cache` beside `ember preload`), the one core the
    zygote forked since that launch (this tool runs one server at a time)."""
    procs = processes()
    mine = [p for p, parent, cmd, _ in procs if parent == pid and cmd.startswith("ember-core")]
    if mine:
        return mine[0]
    launched = next(start for p, _, _, start in procs if p == pid)
    zygotes = {p for p, _, cmd, _ in procs if cmd.startswith("ember-zygote")}
    forked = [
        p
        for p, parent, cmd, start in procs
        if parent in zygotes and cmd.startswith("ember-core") and start >= launched
    ]
    if len(forked) != 1:
        raise RuntimeError(f"no single ember-core for the server {pid} (found {forked})")
    return forked[0]


def stream_until_end(url: str, ended: list[float]) -> None:
    body = {"model": "m", "prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as reply:
            for _ in reply.iter_lines():
                pass
    except httpx.HTTPError:
        pass
    ended.append(time.monotonic())


def one_round(
    model: str, port: int, extra: list[str], proc: subprocess.Popen, uptime: float, http: httpx.Client
) -> tuple[dict, subprocess.Popen]:
    """`http`: built once, before any timing (a client's set-up takes ~0.1 s on a slow host)."""
    url = f"http://127.0.0.1:{port}"
    ended: list[float] = []
    reader = threading.Thread(target=stream_until_end, args=(url, ended), daemon=True)
    reader.start()
    time.sleep(uptime)  # the stream is running
    killed = time.monotonic()
    os.kill(core_of(proc.pid), 9)
    code = proc.wait(60)
    exited = time.monotonic()
    proc = serve(model, port, extra)  # the supervisor's restart
    while not healthy(http, url):
        time.sleep(0.01)
    back = time.monotonic()
    body = {"model": "m", "prompt": "def", "max_tokens": 1, "temperature": 0}
    http.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status()
    token = time.monotonic()
    reader.join(10)
    row = {
        "stream_error_s": round(ended[0] - killed, 2) if ended else None,
        "serve_exit_s": round(exited - killed, 2),
        "exit_code": code,
        "healthy_again_s": round(back - killed, 2),
        "token_again_s": round(token - killed, 2),
        "restart_to_token_s": round(token - exited, 2),
    }
    return row, proc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.supervised_restart", description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--uptime",
        type=float,
        default=3.0,
        help="seconds each server streams before its core is killed (the preload zygote prepares the "
        "next restart's worker a second after a start)",
    )
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args(argv)
    port = free_port()
    extra = ["--served-model-name", "m", *args.serve_args]
    proc = serve(args.model, port, extra)
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    http = httpx.Client()
    while not healthy(http, url):
        if proc.poll() is not None:
            raise SystemExit(f"ember serve exited with {proc.returncode}")
        time.sleep(0.05)
    print(f"first start: healthy after {time.monotonic() - start:.2f} s")
    rows = []
    try:
        for _ in range(args.rounds):
            row, proc = one_round(args.model, port, extra, proc, args.uptime, http)
            rows.append(row)
            print(json.dumps(row))
    finally:
        http.close()
        proc.terminate()
        proc.wait(60)
    back = [r["healthy_again_s"] for r in rows]
    token = [r["token_again_s"] for r in rows]
    restart = [r["restart_to_token_s"] for r in rows]
    print(
        f"summary: healthy again {statistics.median(back):.2f} s and a served token "
        f"{statistics.median(token):.2f} s after SIGKILL of the core, of which the restart (launch to "
        f"a token) {statistics.median(restart):.2f} s (medians of {len(back)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
