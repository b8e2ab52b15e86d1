"""Starting core and worker processes: a fresh interpreter, or a fork of the preload zygote.

Runs in the process that starts them: the frontend (its cores), the core (its workers), `ember serve`
(itself, frontend.launch). `spawn_engine_process` returns a handle with `poll`, `wait`, `send_signal`
and `kill` either way. With `--load-format ipc_cache` and an `ember-zygote` listening in the cache
directory, the process is forked from it (its stdout/stderr are ours, passed as file descriptors),
which saves the seconds of importing torch; it is then not our child, so it is watched through a
pidfd and its exit status comes over the spawn connection.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from coreproc.base import standby
from coreproc.base.channel import recv_msg, send_msg
from coreproc.base.protocol import SpawnWorker, ZygoteQuery, ZygoteState
from coreproc.startup.zygote_link import ForkedProcess, code_stamp, connect_zygote, fork_from, zygote_at

if TYPE_CHECKING:  # imported by `ember serve`'s launcher, which stays light
    from coreproc.base.config import EngineConfig

log = logging.getLogger("ember.spawn")

ENV_PREFIXES = ("EMBER_", "OMP_", "MKL_", "TORCH_", "TRITON_", "NCCL_", "MASTER_", "CUDA_")


def worker_env() -> dict[str, str]:
    """The environment of worker processes: this process's, with a short OpenMP spin.

    Spinning briefly after a parallel region suits workers: a decode step runs dozens of parallel ops
    back to back, and sleeping between them (OMP_WAIT_POLICY=PASSIVE) made batch-1 decode ~30% slower
    on 2 cores. But libgomp's default spin (300,000 rounds) made a worker 8-10x slower beside one busy
    process on the same cores, so workers spin 3,000 rounds (`coreproc.base.host.worker_openmp_env`).
    OMP_WAIT_POLICY / GOMP_SPINCOUNT set by the user pass through.
    """
    from coreproc.base.host import worker_openmp_env

    return worker_openmp_env(dict(os.environ))


def zygote_socket(config: EngineConfig) -> Path | None:
    """The preload zygote's socket when this engine may use it (`--load-format ipc_cache`, not
    `--no-worker-zygote`) and one listens, else None."""
    if config.load.load_format != "ipc_cache" or not config.load.worker_zygote:
        return None
    return zygote_at(config.load.socket_dir)


def zygote_state(path: Path) -> ZygoteState:
    """What the zygote at `path` holds ready (its prepared worker)."""
    with connect_zygote(path) as conn:
        send_msg(conn, ZygoteQuery(), wire="json")
        state, fds = recv_msg(conn, ZygoteState, wire="json")
    for fd in fds:
        os.close(fd)
    return state


def wait_prepared(path: Path, timeout: float) -> bool:
    """Wait until the zygote at `path` holds a prepared worker ready to be taken; False after
    `timeout` seconds without."""
    deadline = time.monotonic() + timeout
    while not zygote_state(path).prepared_ready:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def spawn_engine_process(
    config: EngineConfig, role: str, argv: list[str], config_json: bytes
) -> subprocess.Popen | ForkedProcess:
    """A `role` ("core" or "worker") process running its main with `argv` and the config on stdin:
    forked by the preload zygote when there is one (see `zygote_socket`), else the one this process
    started on standby (coreproc.base.standby), else a fresh interpreter (`python -m
    coreproc.base.boot ROLE`, collector off)."""
    zygote = zygote_socket(config)
    if zygote is not None:
        env = {k: v for k, v in worker_env().items() if k.startswith(ENV_PREFIXES)}
        affinity = sorted(os.sched_getaffinity(0))
        request = SpawnWorker(
            argv=argv, config=config_json, env=env, role=role, code=code_stamp(), affinity=affinity
        )
        try:
            body = msgspec.json.encode(request)
            return fork_from(zygote, body, [sys.stdout.fileno(), sys.stderr.fileno()])
        except (OSError, ConnectionError, RuntimeError) as e:
            log.warning("the zygote at %s failed (%s); starting a fresh %s process", zygote, e, role)
    waiting = standby.take(role, argv, config_json, worker_env())
    if waiting is not None:
        return waiting
    proc = subprocess.Popen(
        [sys.executable, "-m", "coreproc.base.boot", role, *argv],
        stdin=subprocess.PIPE,
        env=worker_env(),
    )
    assert proc.stdin is not None
    proc.stdin.write(config_json)
    proc.stdin.close()
    return proc


def spawn_worker(
    config: EngineConfig, argv: list[str], config_json: bytes
) -> subprocess.Popen | ForkedProcess:
    """A worker process running `workers.worker_proc` with `argv` (see `spawn_engine_process`)."""
    return spawn_engine_process(config, "worker", argv, config_json)
