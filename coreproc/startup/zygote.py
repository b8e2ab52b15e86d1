"""The zygote (`ember-zygote`): forks Ember's processes with their modules already imported.

Started by `ember preload` beside the weight-cache daemons. Importing torch, transformers and the HTTP
stack costs more than mapping cached weights, so a warm restart asks this process to fork instead of
starting fresh interpreters: the engine's workers (asked by the core), its core (asked by the
frontend) and the `ember serve` frontend itself (asked by the `ember` command, frontend.launch). It
imports the heavy modules and prepares the preloaded model's tokenizer and GGUF header once
(`--warm`), never runs a torch operation itself (no thread pools exist to break across fork), freezes
its heap so children share those pages, listens on `zygote.sock` in the cache directory (0600,
same-user peers only) and answers each request by forking. A child takes the requester's standard
streams and environment, keeps the request's connection and reports its exit status on it
(`ServeExit`) before it ends (coreproc/startup/forked.py). A worker request may instead take the
worker prepared for it after an earlier one (coreproc/startup/prepared.py); `ZygoteQuery` asks about
that worker. Children are reaped here.
"""

from __future__ import annotations

import argparse
import fcntl
import gc
import importlib
import logging
import os
import select
import signal
import socket
import sys
from pathlib import Path

from coreproc.base.channel import peer_uid, recv_msg, send_msg
from coreproc.base.model_config import ARCHITECTURES
from coreproc.base.protocol import SpawnReply, SpawnServe, SpawnWorker, ZygoteQuery, ZygoteRequest
from coreproc.startup.forked import ROLE_MAINS, Spawn, child
from coreproc.startup.prepared import PreparedSlot
from coreproc.startup.zygote_link import ZYGOTE_SOCKET, code_stamp

log = logging.getLogger("ember.zygote")

ENGINE_MODULES = (
    "torch",
    "transformers",
    "transformers.models.llama.configuration_llama",
    "transformers.models.mistral.configuration_mistral",
    "transformers.models.qwen2.configuration_qwen2",
    "transformers.models.qwen3.configuration_qwen3",
    "coreproc.core.server",
    "workers.worker_proc",
    "workers.worker",
    *dict.fromkeys(target.split(":")[0] for target in ARCHITECTURES.values()),  # the model classes
    "workers.weight_cache.client",
    "workers.quant.fp8",
    "workers.quant.int8",
    "workers.quant.int4",
)
# named, not imported: the frontend sits above this layer (its entry points are looked up by name)
SERVE_MODULES = ("uvicorn", "uvloop", "frontend.cli", "frontend.serve", "frontend.http.server")


def prepare(warm: list[str]) -> None:
    """Fill this process's caches, which every child inherits: the preloaded models' tokenizers and
    GGUF headers (coreproc.base.tokenizer and coreproc.base.gguf_file share them within a process), the
    engine options' annotations and the installed logits processors."""
    from coreproc.base.config import ENGINE_SECTIONS
    from coreproc.base.gguf_file import is_gguf, open_gguf
    from coreproc.base.logits_processors import installed_specs
    from coreproc.base.options import settings
    from coreproc.base.tokenizer import load_tokenizer

    list(settings(ENGINE_SECTIONS))  # the options' resolved annotations, for the CLI's parser
    installed_specs()  # the installed logits processors, read once
    for path in warm:
        try:
            if is_gguf(path):
                open_gguf(path)
            load_tokenizer(path)
        except (OSError, ValueError) as e:  # the server then builds it itself, as without a zygote
            log.warning("cannot prepare the tokenizer of %s: %s", path, e)


def preimport() -> None:
    for name in (*ENGINE_MODULES, *SERVE_MODULES):
        importlib.import_module(name)


def refusal(req: Spawn, code: str) -> str | None:
    """Why this zygote, which imported the Ember code stamped `code`, cannot be `req`'s process
    (another Python, another Ember install, code changed since), or None."""
    if req.code != code:
        return "Ember's code changed since `ember preload` started (restart it to fork again)"
    if not isinstance(req, SpawnServe):
        return None if req.role in ROLE_MAINS else f"unknown role {req.role!r}"
    if os.path.realpath(req.executable) != os.path.realpath(sys.executable):
        return f"the zygote runs {sys.executable}, not {req.executable}"
    package = str(Path(importlib.import_module("frontend").__file__ or "").parent)
    return None if req.package == package else f"the zygote runs Ember from {package}, not {req.package}"


def reap(*_: object) -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def serve(socket_file: Path, lock: int, code: str) -> None:
    if socket_file.exists():
        socket_file.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_file))
    os.chmod(socket_file, 0o600)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, reap)
    slot = PreparedSlot([listener.fileno(), lock])
    print("ember zygote: ready", flush=True)
    while True:
        try:
            readable = select.select([listener, *slot.waiting_on()], [], [], slot.timeout())[0]
        except InterruptedError:
            continue
        slot.poll(readable)
        if listener not in readable:
            continue
        try:
            conn, _ = listener.accept()
        except (InterruptedError, BlockingIOError):
            continue
        with conn:
            answer(conn, code, slot, [listener.fileno(), lock])


def answer(conn: socket.socket, code: str, slot: PreparedSlot, closing: list[int]) -> None:
    """One request: a fork (or the prepared worker), a refusal, or the zygote's state."""
    fds: list[int] = []
    try:
        if peer_uid(conn) != os.getuid():
            return
        req, fds = recv_msg(conn, ZygoteRequest, wire="json")
        if isinstance(req, ZygoteQuery):
            send_msg(conn, slot.state(), wire="json")
            return
        why = refusal(req, code)
        if why is not None:
            send_msg(conn, SpawnReply(error=why), wire="json")
            return
        key = slot.note(req)
        pid = slot.take(key, req, fds, conn) if isinstance(req, SpawnWorker) else 0
        if not pid:
            pid = os.fork()
            if pid == 0:
                child(req, fds, conn, closing)
        send_msg(conn, SpawnReply(pid=pid), wire="json")
    except Exception as e:  # a bad request never takes the zygote down
        log.warning("spawn failed: %s", e)
        try:
            send_msg(conn, SpawnReply(error=f"{type(e).__name__}: {e}"), wire="json")
        except OSError:
            pass
    finally:
        for fd in fds:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    from setproctitle import setproctitle

    p = argparse.ArgumentParser(prog="python -m coreproc.startup.zygote")
    p.add_argument("--socket-dir", required=True)
    p.add_argument("--warm", action="append", default=[], help="a tokenizer (folder or GGUF) to prepare")
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
    code = code_stamp()  # before the imports: what they read is at least this old
    gc.disable()
    preimport()
    prepare(args.warm)
    gc.freeze()  # children share the imported heap: a collection in one of them leaves it unwritten
    gc.enable()
    serve(path, lock, code)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
