"""Starting worker processes: a fresh interpreter, or a fork of the preload zygote (torch pre-imported).

Runs in the scheduler process. `spawn_worker` returns a handle with `poll`, `wait` and `kill` either
way. With `--load-format ipc_cache` and an `ember-zygote` listening in the cache directory, the worker
is forked from it (its stdout/stderr are ours, passed as file descriptors), which saves the seconds
of importing torch; it is then not our child, so it is watched through a pidfd.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

from coreproc.config import EngineConfig
from coreproc.host import worker_openmp_env
from coreproc.protocol import SpawnReply, SpawnWorker

log = logging.getLogger("ember.spawn")

ENV_PREFIXES = ("EMBER_", "OMP_", "MKL_", "TORCH_", "TRITON_", "NCCL_", "MASTER_", "CUDA_")


def worker_env() -> dict[str, str]:
    """The environment of worker processes: this process's, with a short OpenMP spin.

    Spinning briefly after a parallel region suits workers: a decode step runs dozens of parallel ops
    back to back, and sleeping between them (OMP_WAIT_POLICY=PASSIVE) made batch-1 decode ~30% slower
    on 2 cores. But libgomp's default spin (300,000 rounds) made a worker 8-10x slower beside one busy
    process on the same cores, so workers spin 3,000 rounds (`coreproc.host.worker_openmp_env`).
    OMP_WAIT_POLICY / GOMP_SPINCOUNT set by the user pass through.
    """
    return worker_openmp_env(dict(os.environ))


class ForkedProcess:
    """A process that is not our child, watched through a pidfd (exit codes are not visible)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = os.pidfd_open(pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.fd], [], [], 0)[0]:
            self.returncode = -1
            os.close(self.fd)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self.fd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        self.poll()
        assert self.returncode is not None, "a pidfd that polled readable has exited"
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def terminate(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGTERM)


def _zygote(config: EngineConfig) -> Path | None:
    if config.load.load_format != "ipc_cache" or not config.load.worker_zygote:
        return None
    from coreproc.startup.zygote import ZYGOTE_SOCKET
    from workers.weight_cache.fingerprint import default_socket_dir

    path = (Path(config.load.socket_dir) if config.load.socket_dir else default_socket_dir()) / ZYGOTE_SOCKET
    return path if path.exists() else None


def _fork_from(path: Path, argv: list[str], config_json: bytes) -> ForkedProcess:
    from workers.weight_cache.channel import peer_creds, recv_msg, send_msg

    env = {k: v for k, v in worker_env().items() if k.startswith(ENV_PREFIXES)}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(str(path))
        pid, uid, _ = peer_creds(conn)
        if uid != os.getuid():
            raise PermissionError(f"{path} is served by another user")
        # a forked worker sees the zygote's files: it must be able to reach our runtime directory
        if os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"):
            raise OSError("the zygote runs in another mount namespace (another container)")
        send_msg(
            conn,
            SpawnWorker(argv=argv, config=config_json, env=env),
            [sys.stdout.fileno(), sys.stderr.fileno()],
        )
        reply, fds = recv_msg(conn, SpawnReply)
    for fd in fds:
        os.close(fd)
    if reply.error:
        raise RuntimeError(reply.error)
    return ForkedProcess(reply.pid)


def spawn_worker(
    config: EngineConfig, argv: list[str], config_json: bytes
) -> subprocess.Popen | ForkedProcess:
    """A worker process running `workers.worker_proc` with `argv` (via coreproc.startup.boot when fresh)."""
    zygote = _zygote(config)
    if zygote is not None:
        try:
            return _fork_from(zygote, argv, config_json)
        except (OSError, ConnectionError, RuntimeError) as e:
            log.warning("the worker zygote at %s failed (%s); starting a fresh process", zygote, e)
    proc = subprocess.Popen(
        [sys.executable, "-m", "coreproc.startup.boot", "worker", *argv],
        stdin=subprocess.PIPE,
        env=worker_env(),
    )
    assert proc.stdin is not None
    proc.stdin.write(config_json)
    proc.stdin.close()
    return proc
