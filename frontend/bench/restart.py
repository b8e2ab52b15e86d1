"""`ember bench restart`: time to ready of a cold start, a warm restart from the cache, a snapshot restore.

Runs in the user's shell. Time to ready is measured from launching `ember serve` until `/health`
answers 200 *and* a first token has come back from `/v1/completions` (not until the process starts).
Cold: the server loads (and quantizes) the checkpoint itself. Warm: an `ember preload` daemon holds the
processed weights and the server starts with `--load-format ipc_cache`; "warm 1st" is the first start
after `ember preload`, "warm" a restart (best of --runs), each once the zygote holds the worker it
prepares after a start (coreproc/startup/prepared.py), as it does for a server that has been up a
second. Snapshot (`--mode snapshot`,
root and CRIU needed): a snapshot is made once (untimed), then `ember snapshot restore` is timed from
its launch until it returns, which is after its canary token came back over HTTP. Prints each, and
the ratios to cold.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coreproc.base.config import EngineConfig
from coreproc.base.gguf_file import is_gguf
from coreproc.base.model_config import MODEL_HELP
from coreproc.startup.spawn import wait_prepared
from coreproc.startup.zygote_link import ZYGOTE_SOCKET
from frontend.bench import restart_trace
from frontend.bench.restart_trace import StartTrace

EMBER = [sys.executable, "-m", "frontend.launch"]  # what the `ember` command runs
PREPARED_WAIT_S = 60.0  # for the zygote's prepared worker before a restart


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    p.add_argument("--runs", type=int, default=1, help="measurements of each kind (the best is kept)")
    p.add_argument(
        "--mode",
        choices=["preload", "snapshot"],
        default="preload",
        help="preload: cold and warm; snapshot: adds a row for `ember snapshot restore`",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="print where each start's seconds go: every process's phases against the launch",
    )
    p.add_argument(
        "--trace-plot", metavar="PNG", default=None, help="draw the --trace breakdown as a timeline"
    )


def engine_flags(config: EngineConfig) -> list[str]:
    m = config.model
    flags = [m.model, "--dtype", m.dtype, "--max-model-len", str(m.max_model_len)]
    if m.quantization:
        flags += ["--quantization", m.quantization]
    return flags


def wait_healthy(http: Any, url: str, deadline: float, proc: subprocess.Popen) -> None:
    """Poll `url`/health every 10 ms until 200; RuntimeError once `deadline` (perf_counter) passes or
    the server exits."""
    import httpx

    while True:
        try:
            if http.get(f"{url}/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.perf_counter() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the server did not become healthy (exit status {proc.poll()})")
        time.sleep(0.01)


def time_to_ready(
    cmd: list[str], timeout: float = 900.0, traced: StartTrace | None = None
) -> tuple[float, float, str]:
    """Seconds from launch to /health 200 plus one generated token, and to /health 200 alone;
    returns (ready seconds, healthy seconds, start-up lines). `traced`: the processes write their
    phases to its file, and the client's marks are added."""
    import httpx

    http = httpx.Client(timeout=60)  # built before the clock starts: its set-up is the client's
    start = time.perf_counter()
    launch = time.time()
    env = traced.env() if traced is not None else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
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
        wait_healthy(http, url, start + timeout, proc)
        healthy = time.perf_counter() - start
        body = {"prompt": "def", "max_tokens": 1, "temperature": 0}
        http.post(f"{url}/v1/completions", json=body).raise_for_status()
        ready = time.perf_counter() - start
        if traced is not None:
            traced.launch = launch
            traced.mark("launch: /health answers 200", launch, launch + healthy)
            traced.mark("first token", launch + healthy, launch + ready)
        return ready, healthy, "\n".join(lines)
    finally:
        http.close()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


Timed = tuple[Any, ...]  # a start's seconds (the first value: which start is best) and what else it gave


def best_of(
    runs: int, tracing: bool, attempt: Callable[[StartTrace | None], Timed]
) -> tuple[Timed, StartTrace | None]:
    """The fastest of `runs` attempts, and its trace when `tracing` (the others' are removed)."""
    best: Timed | None = None
    best_trace: StartTrace | None = None
    for _ in range(runs):
        traced = StartTrace() if tracing else None
        result = attempt(traced)
        if best is None or result[0] < best[0]:
            if best_trace is not None:
                best_trace.remove()
            best, best_trace = result, traced
        elif traced is not None:
            traced.remove()
    assert best is not None, "at least one run"
    return best, best_trace


def restore_once(root: Path, traced: StartTrace | None) -> float:
    """Seconds of one `ember snapshot restore` of `root`, launch to return; the restored server is
    killed after."""
    start, launch = time.perf_counter(), time.time()
    done = subprocess.run(
        [*EMBER, "snapshot", "restore", str(root), "--port", "0"],
        capture_output=True,
        text=True,
        env=traced.env() if traced is not None else None,
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip())
    os.kill(int(re.search(r"\(pid (\d+)\)", done.stdout).group(1)), signal.SIGKILL)
    if traced is not None:
        traced.launch = launch
        traced.mark("launch: restored, canary token back", launch, launch + seconds)
    return seconds


def snapshot_restore_time(
    config: EngineConfig, runs: int, tracing: bool = False
) -> tuple[float, str, StartTrace | None]:
    """Best seconds of `ember snapshot restore` (launch to return), a note on the snapshot, and the
    best restore's trace when `tracing`."""
    with tempfile.TemporaryDirectory(prefix="ember-bench-snap-") as tmp:
        root = Path(tmp) / "snap"
        made = subprocess.run(
            [*EMBER, "snapshot", "create", str(root), *engine_flags(config), "--port", "0"],
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            raise RuntimeError(made.stderr.strip() or made.stdout.strip())
        (best,), best_trace = best_of(runs, tracing, lambda traced: (restore_once(root, traced),))
        note = re.search(r"\((\w+ mode)[^)]*\), image (\d+ MiB)", made.stdout)
        return best, f"{note.group(1)}, image {note.group(2)}" if note else "", best_trace


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    serve = [*EMBER, "serve", *engine_flags(config), "--port", "0"]
    tracing = args.trace or args.trace_plot is not None
    (cold, cold_healthy, _), cold_trace = best_of(
        args.runs, tracing, lambda t: time_to_ready(serve, traced=t)
    )
    with tempfile.TemporaryDirectory(prefix="ember-bench-") as tmp:
        sockets = Path(tmp) / "sockets"
        sockets.mkdir(mode=0o700)
        preload_cmd = [*EMBER, "preload", *engine_flags(config)]
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
            first, first_healthy, lines = time_to_ready(warm_cmd)  # the first start after preload

            def restart(traced: StartTrace | None) -> Timed:
                """A restart once the last server has been up a while: its worker prepared."""
                if not wait_prepared(sockets / ZYGOTE_SOCKET, PREPARED_WAIT_S):
                    print("warning: the zygote prepared no worker for the restart", file=sys.stderr)
                return time_to_ready(warm_cmd, traced=traced)

            (warm, warm_healthy, _), warm_trace = best_of(args.runs, tracing, restart)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
    if "from ipc_cache" not in lines:
        print(f"warning: the warm server did not use the cache:\n{lines}", file=sys.stderr)
    path = Path(config.model.model)
    size = sum(f.stat().st_size for f in ([path] if is_gguf(path) else path.glob("*.safetensors")))
    print(
        f"model {config.model.model} ({size / 2**30:.2f} GiB on disk, dtype {config.model.dtype}, "
        f"quantization {config.model.quantization or 'none'}), {os.cpu_count()} CPUs"
    )
    print(f"{'start':<8}{'time to ready (s)':>20}{'of which healthy (s)':>22}{'first token (s)':>17}")
    print(f"{'cold':<8}{cold:>20.2f}{cold_healthy:>22.2f}{cold - cold_healthy:>17.2f}")
    print(f"{'warm 1st':<8}{first:>20.2f}{first_healthy:>22.2f}{first - first_healthy:>17.2f}")
    print(f"{'warm':<8}{warm:>20.2f}{warm_healthy:>22.2f}{warm - warm_healthy:>17.2f}")
    summary = f"summary: warm restart is {cold / warm:.1f}x faster than cold ({cold:.2f}s -> {warm:.2f}s)"
    starts = {"cold": cold_trace, "warm": warm_trace}
    if args.mode == "snapshot":
        try:
            snap, note, starts["snapshot"] = snapshot_restore_time(config, args.runs, tracing)
        except RuntimeError as e:
            print(f"{'snapshot':<8}{'not measured: ' + str(e).splitlines()[-1]:>20}")
        else:
            print(f"{'snapshot':<8}{snap:>20.2f}{'-':>22}{'-':>17}   ({note})")
            summary += f"; snapshot restore {cold / snap:.1f}x faster ({snap:.2f}s)"
    print(summary)
    traced = {kind: t for kind, t in starts.items() if t is not None}
    if args.trace:
        for kind, t in traced.items():
            print("\n" + restart_trace.table(kind, t))
    if args.trace_plot is not None:
        restart_trace.plot(traced, args.trace_plot)
        print(f"timeline: {args.trace_plot}")
    for t in traced.values():
        t.remove()
    return 0
