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
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from coreproc.protocol import ServeExit, SpawnReply, SpawnWorker, ZygoteQuery, ZygoteRequest, ZygoteState
from coreproc.startup import standby
from coreproc.startup.orphan import exited
from workers.weight_cache.channel import default_socket_dir, peer_creds, recv_msg, send_msg

if TYPE_CHECKING:  # imported by `ember serve`'s launcher, which stays light
    from coreproc.config import EngineConfig

log = logging.getLogger("ember.spawn")

ZYGOTE_SOCKET = "zygote.sock"
ENV_PREFIXES = ("EMBER_", "OMP_", "MKL_", "TORCH_", "TRITON_", "NCCL_", "MASTER_", "CUDA_")


def code_stamp() -> str:
    """Which Ember code is on disk: the newest modification time and the number of its Python files
    (an upgrade or an edit changes it). A zygote forks only for requesters that see the code it
    imported, so that `ember preload` started before an upgrade never serves the old code."""
    root = Path(__file__).resolve().parents[2]  # the folder that holds the packages
    newest, count = 0, 0
    for package in ("frontend", "coreproc", "workers", "kernels"):
        for path in (root / package).rglob("*.py"):
            newest, count = max(newest, path.stat().st_mtime_ns), count + 1
    return f"{newest}-{count}"


def worker_env() -> dict[str, str]:
    """The environment of worker processes: this process's, with a short OpenMP spin.

    Spinning briefly after a parallel region suits workers: a decode step runs dozens of parallel ops
    back to back, and sleeping between them (OMP_WAIT_POLICY=PASSIVE) made batch-1 decode ~30% slower
    on 2 cores. But libgomp's default spin (300,000 rounds) made a worker 8-10x slower beside one busy
    process on the same cores, so workers spin 3,000 rounds (`coreproc.host.worker_openmp_env`).
    OMP_WAIT_POLICY / GOMP_SPINCOUNT set by the user pass through.
    """
    from coreproc.host import worker_openmp_env

    return worker_openmp_env(dict(os.environ))


class ForkedProcess:
    """A process the zygote forked for us (not our child): watched through a pidfd, its exit status
    read from the spawn connection it keeps (`ServeExit`; -1 when it died without saying, killed)."""

    def __init__(self, pid: int, conn: socket.socket | None = None) -> None:
        self.pid = pid
        self.fd = os.pidfd_open(pid)
        self.conn = conn
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and exited(self.fd):
            self.returncode = self._reported()
            os.close(self.fd)
        return self.returncode

    def _reported(self) -> int:
        if self.conn is None:
            return -1
        try:
            self.conn.settimeout(0.5)  # the message was sent before the exit: it is there or never
            msg, _ = recv_msg(self.conn, ServeExit)
            return int(msg.code)
        except (OSError, ConnectionError, ValueError):
            return -1
        finally:
            self.conn.close()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self.fd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        self.poll()
        assert self.returncode is not None, "a pidfd that polled readable has exited"
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def zygote_socket(config: EngineConfig) -> Path | None:
    """The preload zygote's socket when this engine may use it (`--load-format ipc_cache`, not
    `--no-worker-zygote`) and one listens, else None."""
    if config.load.load_format != "ipc_cache" or not config.load.worker_zygote:
        return None
    return zygote_at(config.load.socket_dir)


def zygote_at(socket_dir: str | None) -> Path | None:
    """The zygote's socket in `socket_dir` (default: `ember preload`'s) if one is there."""
    path = (Path(socket_dir) if socket_dir else default_socket_dir()) / ZYGOTE_SOCKET
    return path if path.exists() else None


def connect_zygote(path: Path, timeout: float = 10.0) -> socket.socket:
    """A connection to the zygote at `path`, checked: same user, same mount and network namespaces (a
    forked process sees the zygote's files and ports)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout)
        conn.connect(str(path))
        pid, uid, _ = peer_creds(conn)
        if uid != os.getuid():
            raise PermissionError(f"{path} is served by another user")
        for ns in ("mnt", "net"):
            if os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"):
                raise OSError(f"the zygote runs in another {ns} namespace (another container)")
    except BaseException:
        conn.close()
        raise
    return conn


def fork_from(path: Path, request: ZygoteRequest, fds: list[int]) -> ForkedProcess:
    """Ask the zygote at `path` to fork `request`'s process, handing it `fds` (our standard streams)."""
    conn = connect_zygote(path)
    try:
        send_msg(conn, request, fds)
        reply, got = recv_msg(conn, SpawnReply)
        for fd in got:
            os.close(fd)
        if reply.error:
            raise RuntimeError(reply.error)
        conn.settimeout(None)
        return ForkedProcess(reply.pid, conn)
    except BaseException:
        conn.close()
        raise


def zygote_state(path: Path) -> ZygoteState:
    """What the zygote at `path` holds ready (its prepared worker)."""
    with connect_zygote(path) as conn:
        send_msg(conn, ZygoteQuery())
        state, fds = recv_msg(conn, ZygoteState)
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
    started on standby (coreproc.startup.standby), else a fresh interpreter (`python -m
    coreproc.startup.boot ROLE`, collector off)."""
    zygote = zygote_socket(config)
    if zygote is not None:
        env = {k: v for k, v in worker_env().items() if k.startswith(ENV_PREFIXES)}
        affinity = sorted(os.sched_getaffinity(0))
        request = SpawnWorker(
            argv=argv, config=config_json, env=env, role=role, code=code_stamp(), affinity=affinity
        )
        try:
            return fork_from(zygote, request, [sys.stdout.fileno(), sys.stderr.fileno()])
        except (OSError, ConnectionError, RuntimeError) as e:
            log.warning("the zygote at %s failed (%s); starting a fresh %s process", zygote, e, role)
    waiting = standby.take(role, argv, config_json, worker_env())
    if waiting is not None:
        return waiting
    proc = subprocess.Popen(
        [sys.executable, "-m", "coreproc.startup.boot", role, *argv],
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
