"""The worker zygote (`ember-zygote`): forks engine worker processes with torch already imported.

Started by `ember preload` beside the weight-cache daemons. Importing torch and transformers costs
seconds per process, longer than mapping cached weights, so a warm restart asks this process to fork
its workers instead of starting fresh interpreters. It imports the heavy modules, never runs a torch
operation itself (no thread pools exist to break across fork), listens on `zygote.sock` in the cache
directory (0600, same-user peers only) and answers each `SpawnWorker` by forking: the child takes the
requester's stdout/stderr and environment entries and runs the worker main. Children are reaped here.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from coreproc.protocol import SpawnReply, SpawnWorker
from workers.weight_cache.channel import peer_uid, recv_msg, send_msg

log = logging.getLogger("ember.zygote")

ZYGOTE_SOCKET = "zygote.sock"
WORKER_MODULES = (
    "torch",
    "transformers",
    "transformers.models.llama.configuration_llama",
    "transformers.models.mistral.configuration_mistral",
    "transformers.models.qwen2.configuration_qwen2",
    "transformers.models.qwen3.configuration_qwen3",
    "workers.worker_proc",
    "workers.worker",
    "workers.models.llama",
    "workers.models.mistral",
    "workers.models.qwen2",
    "workers.models.qwen3",
    "workers.weight_cache.client",
    "workers.quant.fp8",
    "workers.quant.int8",
    "workers.quant.int4",
)


def preimport() -> None:
    import importlib

    for name in WORKER_MODULES:
        importlib.import_module(name)


def child(req: SpawnWorker, fds: list[int], listener: socket.socket) -> None:
    """Runs in the forked process: become the worker (never returns)."""
    listener.close()
    for target, fd in zip((1, 2), fds):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.update(req.env)
    sys.stdin = open(os.devnull)
    from workers.worker_proc import main

    try:
        main(req.argv, config_json=req.config)
    finally:
        os._exit(1)


def reap(*_: object) -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def serve(socket_file: Path) -> None:
    if socket_file.exists():
        socket_file.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_file))
    os.chmod(socket_file, 0o600)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, reap)
    print("ember zygote: ready", flush=True)
    while True:
        try:
            conn, _ = listener.accept()
        except InterruptedError:
            continue
        with conn:
            fds: list[int] = []
            try:
                if peer_uid(conn) != os.getuid():
                    continue
                req, fds = recv_msg(conn, SpawnWorker)
                pid = os.fork()
                if pid == 0:
                    child(req, fds, listener)
                send_msg(conn, SpawnReply(pid=pid))
            except Exception as e:  # a bad request never takes the zygote down
                log.warning("spawn failed: %s", e)
                try:
                    send_msg(conn, SpawnReply(error=f"{type(e).__name__}: {e}"))
                except OSError:
                    pass
            finally:
                for fd in fds:
                    os.close(fd)


def main(argv: list[str] | None = None) -> int:
    from setproctitle import setproctitle

    p = argparse.ArgumentParser(prog="python -m coreproc.startup.zygote")
    p.add_argument("--socket-dir", required=True)
    args = p.parse_args(argv)
    setproctitle("ember-zygote")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    path = Path(args.socket_dir) / ZYGOTE_SOCKET
    lock = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held for our lifetime
    except BlockingIOError:
        print(f"ember zygote: another zygote already serves {path}", flush=True)
        return 1
    preimport()
    serve(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
