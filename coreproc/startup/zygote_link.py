"""The way to the preload zygote, light enough for the `ember` command's first module.

Runs in the processes that ask the zygote to fork one (the `ember` launcher, a frontend starting its
core, a core starting its workers). It imports nothing heavy: the launcher of a warm `ember serve`
spends ~0.1 s less than when it imported msgspec and the protocol. So requests travel as JSON (the
zygote decodes them into coreproc.base.protocol's `ZygoteRequest` with msgspec; the launcher writes its
`SpawnServe` with the standard library), and the answers (`SpawnReply`, `ServeExit`) are read here as
plain JSON. `ForkedProcess` is the handle of a forked process: `poll`, `wait`, `send_signal`, `kill`,
like a `subprocess.Popen`.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

from coreproc.base.channel import default_socket_dir, peer_creds, recv_frame, send_frame
from coreproc.base.orphan import exited

ZYGOTE_SOCKET = "zygote.sock"


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


def recv_json(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One JSON message from the zygote, as a dict, and the descriptors that came with it."""
    body, fds = recv_frame(conn)
    try:
        msg = json.loads(body)
        if not isinstance(msg, dict):
            raise ValueError(f"a JSON object was expected, got {body[:80]!r}")
        return msg, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


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


def fork_from(path: Path, request: bytes, fds: list[int]) -> ForkedProcess:
    """Ask the zygote at `path` to fork the process of `request` (a `SpawnServe` or `SpawnWorker` as
    JSON), handing it `fds` (our standard streams); RuntimeError with the zygote's refusal, or when
    its answer is not one (a zygote of an older Ember, which spoke msgpack)."""
    conn = connect_zygote(path)
    try:
        send_frame(conn, request, fds)
        try:
            reply, got = recv_json(conn)
            for fd in got:
                os.close(fd)
            if reply.get("error"):
                raise RuntimeError(reply["error"])
            pid = int(reply["pid"])
        except (ValueError, KeyError, TypeError) as e:
            raise RuntimeError(
                f"the zygote's answer is not one this Ember reads ({e}); restart ember preload"
            ) from None
        conn.settimeout(None)
        return ForkedProcess(pid, conn)
    except BaseException:
        conn.close()
        raise


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
            msg, fds = recv_json(self.conn)  # a `ServeExit`
            for fd in fds:
                os.close(fd)
            return int(msg["code"])
        except (OSError, ConnectionError, ValueError, KeyError, TypeError):  # no answer, or not one
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
