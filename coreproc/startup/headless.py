"""`ember worker --headless`: the ranks of one node other than the head's, without a core of its own.

Runs in the user's process on node ranks 1..N-1 (process title `ember-worker-node<R>`). It starts this
node's ranks (global ranks R x ranks-per-node onwards, each `ember-worker-<rank>`, a fresh interpreter
through coreproc.startup.spawn) with the engine config as JSON on stdin. Each rank joins the engine's
process group at --master-addr:--master-port and connects to the head's core at the master address,
port + 1 (CurveZMQ with --curve-keys off loopback; see workers/head_link.py). It returns when every rank
has exited: 0 when the head shut them down, 1 when one failed or lost the head (the others are then
stopped). SIGTERM / SIGINT stop the ranks.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from pathlib import Path

import msgspec

from coreproc.base.config import EngineConfig
from coreproc.base.errors import ConfigError
from coreproc.base.ipc import is_loopback_endpoint, make_runtime_dir, remove_runtime_dir
from coreproc.startup.spawn import spawn_worker
from coreproc.startup.zygote_link import ForkedProcess

log = logging.getLogger("ember.headless")

POLL_S = 0.2
STOP_GRACE_S = 5.0


def check_node(config: EngineConfig) -> None:
    """A headless node needs a rank other than the head's, and keys to reach it off loopback."""
    par = config.parallel
    if par.nnodes < 2 or par.node_rank == 0:
        raise ConfigError(
            "ember worker --headless runs the ranks of node 1..N-1: give --nnodes N (> 1) and "
            "--node-rank R (> 0); node rank 0 runs `ember serve` or `ember core`"
        )
    if not is_loopback_endpoint(par.node_endpoint):
        if not par.curve_keys:
            raise ConfigError(
                f"the head's link {par.node_endpoint} is not loopback: give --curve-keys DIR "
                "(the head's `ember keygen` directory, copied to this node)"
            )
        for name in ("server.key", "client.key_secret"):
            if not (Path(par.curve_keys) / name).is_file():
                raise ConfigError(f"--curve-keys {par.curve_keys} lacks {name} (see `ember keygen`)")


def run_headless(config: EngineConfig) -> int:
    """Start this node's ranks and wait for them; the exit status says how they ended."""
    from setproctitle import setproctitle

    check_node(config)
    par = config.parallel
    setproctitle(f"ember-worker-node{par.node_rank}")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    runtime_dir = make_runtime_dir()
    config_json = msgspec.json.encode(config)
    procs: dict[int, subprocess.Popen | ForkedProcess] = {}
    print(
        f"ember worker: node {par.node_rank} of {par.nnodes}, ranks {par.node_ranks().start}-"
        f"{par.node_ranks().stop - 1}, head at {par.node_endpoint}",
        flush=True,
    )
    try:
        for rank in par.node_ranks():
            argv = ["--rank", str(rank), "--endpoint", par.node_endpoint, "--runtime-dir", str(runtime_dir)]
            argv += ["--parent-pid", str(os.getpid())]
            procs[rank] = spawn_worker(config, argv, config_json)
        return _wait(procs, stop)
    finally:
        _stop(list(procs.values()))
        remove_runtime_dir(runtime_dir)


def _wait(procs: dict[int, subprocess.Popen | ForkedProcess], stop: threading.Event) -> int:
    """Until every rank exited (0: all cleanly) or one failed (1) or we were asked to stop (0). A rank
    forked by the preload zygote is not our child: its exit status is unknown, and counts as clean."""
    while not stop.wait(POLL_S):
        codes = {rank: 0 if isinstance(p, ForkedProcess) and p.poll() is not None else p.poll()
                 for rank, p in procs.items()}  # fmt: skip
        failed = {rank: code for rank, code in codes.items() if code not in (None, 0)}
        if failed:
            rank, code = next(iter(failed.items()))
            log.error("rank %d exited with code %s; stopping this node's other ranks", rank, code)
            return 1
        if all(code == 0 for code in codes.values()):
            return 0
    return 0


def _stop(procs: list[subprocess.Popen | ForkedProcess]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(STOP_GRACE_S)
