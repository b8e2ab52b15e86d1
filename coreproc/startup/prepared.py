"""The zygote's prepared worker: one worker forked ahead of the next warm restart, taken by it.

Runs in the zygote (`ember-zygote`, coreproc/startup/zygote.py) and, after the fork, in the prepared
process itself (`run_prepared`). A forked worker of a warm restart spends its time on what the
engine's config alone decides: the fingerprint, mapping the preloaded weights, the model around them,
the kernels, and on its first step the page faults of the freshly mapped weights. So once the zygote
has forked a worker it can prepare (`preparable`: one CPU rank whose weights come from the cache, no
draft model) and has then had no request for `QUIET_S` (the engine it forked has started), it forks one
more process that does all that for the same request (workers/prepared.py) and waits. The next
request with the same key (config, rank, CPUs and environment, the start-up trace's file aside) takes
it (`PreparedTake`): it checks the checkpoint and the daemon are unchanged, answers its pid, and runs as
that request's worker. One prepared worker at a time; a request with another key replaces it. Its
connection to the zygote closing (the zygote gone, or replacing it) ends it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import signal
import socket
import time
import traceback
from typing import NoReturn

import msgspec

from coreproc.base import trace
from coreproc.base.channel import recv_msg, send_msg
from coreproc.base.config import EngineConfig
from coreproc.base.protocol import PreparedReady, PreparedTake, SpawnReply, SpawnWorker, ZygoteState

log = logging.getLogger("ember.zygote")

QUIET_S = 1.0  # the zygote prepares after this long without a request: the engine it forked is up
TAKE_TIMEOUT_S = 5.0  # the prepared worker's checks are two stats and a ping
PREPARED_WORKER = "workers.prepared"  # named, not imported: it imports torch (the zygote has by then)


def preparable(req: SpawnWorker) -> str:
    """The key that a worker prepared for `req` is taken by; "" when `req`'s worker is not prepared
    (another role; several ranks, a GPU, a draft model, weights not from the preload cache)."""
    if req.role != "worker":
        return ""
    try:
        config = msgspec.json.decode(req.config, type=EngineConfig)
        rank = req.argv[req.argv.index("--rank") + 1]
    except (msgspec.DecodeError, ValueError, IndexError):
        return ""
    if (
        config.parallel.world_size != 1
        or config.device.resolved_type != "cpu"
        or config.speculative is not None
        or config.load.load_format != "ipc_cache"
    ):
        return ""
    env = sorted((k, v) for k, v in req.env.items() if k != trace.ENV)
    return hashlib.sha256(msgspec.json.encode([req.config, rank, env, req.affinity])).hexdigest()


class PreparedSlot:
    """The zygote's one prepared worker: when to fork it, its connection, and handing it a request."""

    def __init__(self, closing: list[int]) -> None:
        self.closing = closing  # the zygote's descriptors (listener, lock) a child must not keep
        self.conn: socket.socket | None = None  # to the prepared worker
        self.pid, self.key, self.ready = 0, "", False
        self.wanted: tuple[str, SpawnWorker] | None = None  # the request to prepare a worker for
        self.last_request = time.monotonic()

    def waiting_on(self) -> list[socket.socket]:
        """What the zygote's loop also waits on: the prepared worker's connection (ready, or gone)."""
        return [self.conn] if self.conn is not None else []

    def timeout(self) -> float | None:
        """Seconds until a wanted worker is due to be prepared (None: none is wanted)."""
        return None if self.wanted is None else max(0.0, self.last_request + QUIET_S - time.monotonic())

    def state(self) -> ZygoteState:
        return ZygoteState(prepared_pid=self.pid, prepared_ready=self.ready)

    def poll(self, readable: list[socket.socket]) -> None:
        """After the zygote's wait: read the prepared worker's word; fork one that is due."""
        if self.conn is not None and self.conn in readable:
            try:
                msg, fds = recv_msg(self.conn, PreparedReady)
                for fd in fds:
                    os.close(fd)
                if msg.error:
                    log.warning("no worker prepared for the next restart: %s", msg.error)
                    self.drop()
                else:
                    self.ready = True
            except (ConnectionError, OSError, ValueError):  # it died
                self.drop()
        if self.wanted is not None and self.timeout() == 0.0:
            if self.conn is not None and self.key == self.wanted[0]:
                self.wanted = None  # the one held (ready or on its way) is for it
            else:
                self.start(*self.wanted)

    def note(self, req: object) -> str:
        """Every request the zygote takes: it delays the preparation; a worker request it can prepare
        for becomes the wanted one (the next restart's). Its key ("" for other requests)."""
        self.last_request = time.monotonic()
        if not isinstance(req, SpawnWorker):
            return ""
        key = preparable(req)
        if key:
            self.wanted = (key, req)
        return key

    def take(self, key: str, req: SpawnWorker, fds: list[int], conn: socket.socket) -> int:
        """The prepared worker's pid once it runs as `req`'s worker (`key`: `req`'s, from `note`;
        `fds`: its stdout and stderr, `conn`: the request's connection), else 0 (the zygote forks)."""
        if not key or not self.ready or self.conn is None or key != self.key:
            return 0
        try:
            self.conn.settimeout(TAKE_TIMEOUT_S)
            send_msg(self.conn, PreparedTake(argv=req.argv, env=req.env), [*fds, conn.fileno()])
            reply, got = recv_msg(self.conn, SpawnReply)
            for fd in got:
                os.close(fd)
        except (ConnectionError, OSError, ValueError) as e:
            log.warning("the prepared worker failed to take the request: %s", e)
            return 0
        finally:
            self.drop()  # used up, or useless: the next one is prepared after the next quiet spell
        if reply.error:
            log.warning("the prepared worker refused the request: %s", reply.error)
        return 0 if reply.error else reply.pid

    def start(self, key: str, req: SpawnWorker) -> None:
        """Fork the prepared worker for `req` (replacing the one held)."""
        self.wanted = None
        self.drop()
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            ours.close()
            run_prepared(req, theirs, self.closing)
        theirs.close()
        self.conn, self.pid, self.key, self.ready = ours, pid, key, False

    def drop(self) -> None:
        """Let go of the prepared worker: one not taken sees its connection close and exits."""
        if self.conn is not None:
            self.conn.close()
        self.conn, self.pid, self.key, self.ready = None, 0, "", False


def run_prepared(req: SpawnWorker, conn: socket.socket, closing: list[int]) -> NoReturn:
    """The prepared worker's process: prepare, wait, and on `PreparedTake` run as the request's worker
    (through the zygote's `child`, like any forked process); ends here."""
    from setproctitle import setproctitle

    from coreproc.startup.forked import child, run_on, take_environment

    try:
        for fd in closing:
            os.close(fd)
        setproctitle("ember-prepared")
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        take_environment({k: v for k, v in req.env.items() if k != trace.ENV}, whole=False)
        os.environ.pop(trace.ENV, None)  # the trace of a past start is not this process's
        run_on(req.affinity)
        try:
            prepared = importlib.import_module(PREPARED_WORKER).prepare(req)
        except Exception as e:  # the zygote logs it in one line and forks fresh workers instead
            with contextlib.suppress(OSError):
                send_msg(conn, PreparedReady(error=f"{type(e).__name__}: {e}"))
            os._exit(1)
        try:
            send_msg(conn, PreparedReady())
            take, fds = recv_msg(conn, PreparedTake)
        except (ConnectionError, OSError, ValueError):  # the zygote is gone, or wants another worker
            os._exit(0)
        taken = time.time()
        why = prepared.stale() if len(fds) == 3 else f"{len(fds)} descriptors, not 3"
        send_msg(conn, SpawnReply(pid=0 if why else os.getpid(), error=why or None))
        conn.close()
        if why:
            for fd in fds:
                os.close(fd)
            os._exit(0)
        request = SpawnWorker(argv=take.argv, config=req.config, env=take.env, affinity=req.affinity)
        conn = socket.socket(fileno=fds[2])  # the request's: the exit status goes there
        child(request, fds[:2], conn, [], main=lambda argv, _: prepared.main(argv, taken))
    except BaseException:
        traceback.print_exc()
    os._exit(1)
