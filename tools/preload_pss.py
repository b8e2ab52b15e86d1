"""Many engines, one copy of the weights: the memory of N `ember serve` engines fed by one `ember preload`.

Runs in its own process. Starts an `ember preload MODEL` daemon, then N engines with `--load-format
ipc_cache` side by side (each answers one completion), and sums the proportional set size (PSS:
shared pages split between the processes that map them) of every process involved: the daemon's
tree (with the servers, cores and workers its zygote forks for the engines, and the worker it holds
prepared for the next restart, measured once it is ready) and each engine's own (its launcher, or
the frontend, core and workers it started itself). With the weights mapped once, N engines cost one
copy of the weights plus N times an engine's own memory. Prints a row per N, and the ratio of the
total to one engine's.

    python -m tools.preload_pss MODEL --engines 1 2 4 [--serve-args --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from coreproc.startup.spawn import wait_prepared
from coreproc.startup.zygote_link import ZYGOTE_SOCKET

EMBER = [sys.executable, "-m", "frontend.launch"]  # what the `ember` command runs


def pss_kib(pid: int) -> int:
    """PSS of one process in KiB (0 if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    return sum(int(line.split()[1]) for line in text.splitlines() if line.startswith("Pss:"))


def tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    out, frontier = [pid], [pid]
    while frontier:
        kids = []
        for p in frontier:
            try:
                kids += [int(k) for k in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
            except OSError:
                pass
        out += kids
        frontier = kids
    return out


def start_engine(model: str, sockets: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [*EMBER, "serve", model, "--port", "0", "--load-format", "ipc_cache", "--socket-dir", str(sockets)]
    proc = subprocess.Popen([*cmd, *extra], stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            return proc, found.group(1)
    raise RuntimeError(f"an engine exited ({proc.wait()}) before listening")


def measure(model: str, count: int, extra: list[str]) -> tuple[int, int, list[int]]:
    """(daemon PSS, engines' PSS, each engine's PSS) in KiB with `count` engines on one daemon."""
    with tempfile.TemporaryDirectory(prefix="ember-pss-") as tmp:
        sockets = Path(tmp) / "sockets"
        sockets.mkdir(mode=0o700)
        cmd = [*EMBER, "preload", model, "--socket-dir", str(sockets), *extra]
        daemon = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        engines: list[subprocess.Popen] = []
        try:
            if not any("ember preload: ready:" in line for line in daemon.stdout):
                raise RuntimeError("ember preload failed to start")
            for _ in range(count):
                proc, url = start_engine(model, sockets, extra)
                engines.append(proc)
                body = {"prompt": "def", "max_tokens": 4, "temperature": 0}
                httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
            if not wait_prepared(sockets / ZYGOTE_SOCKET, 120.0):  # the steady state holds one
                print("warning: the zygote prepared no worker for the next restart", file=sys.stderr)
            each = [sum(pss_kib(p) for p in tree(e.pid)) for e in engines]
            return sum(pss_kib(p) for p in tree(daemon.pid)), sum(each), each
        finally:
            for e in engines:
                e.send_signal(signal.SIGINT)
            for e in engines:
                e.wait(60)
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--engines", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[], help="flags for preload and serve")
    args = p.parse_args(argv)
    head = f"{'engines':>8}{'daemon tree MiB':>17}{'engines MiB':>13}{'total MiB':>11}"
    print(f"{head}{'per engine MiB':>16}{'x one':>8}")
    one = None
    for n in args.engines:
        daemon, engines, each = measure(args.model, n, args.serve_args)
        total = daemon + engines
        if n == 1:
            one = total
        ratio = f"{total / one:.2f}" if one else "-"
        per = " ".join(f"{e / 1024:.0f}" for e in each)
        print(f"{n:>8}{daemon / 1024:>17.0f}{engines / 1024:>13.0f}{total / 1024:>11.0f}{per:>16}{ratio:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
