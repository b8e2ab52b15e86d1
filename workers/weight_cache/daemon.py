"""One preload daemon (`ember-preload-<role>-dp<D>-tp<R>`): holds one rank's processed weights.

Started by `ember preload` as `python -m workers.weight_cache.daemon` (config as JSON on stdin). It
takes an exclusive lock on its socket path (a second daemon for the same device and rank fails
instead of stealing the socket), computes its fingerprint, loads, quantizes and shards the weights
once, moves them into shared memory, and only then binds its Unix socket (0600) and reports
`DaemonReady`. Each connection (served on its own thread, so a stalled peer holds up no engine) is
one request from a peer that must be the same user (SO_PEERCRED):
"ping" -> "ready"; "state" with a matching fingerprint -> the tensor table plus the arena's file
descriptor; a mismatch -> the names of the differing fields. A failing request never kills it.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import msgspec
import torch
import zmq

from coreproc.base.channel import close_fds, peer_uid, recv_msg, send_msg
from coreproc.base.config import EngineConfig
from coreproc.base.ipc import Codec
from coreproc.base.protocol import CacheReply, CacheRequest, DaemonReady
from workers.loader import release_load_memory
from workers.parallel import device_index
from workers.weight_cache.arena import CpuArena, export_cuda, module_attrs, named_tensors, repoint
from workers.weight_cache.fingerprint import device_identity, differences, fingerprint, linear_kernel

log = logging.getLogger("ember.preload")
REQUEST_TIMEOUT = 30.0  # seconds a peer has to send its request and take the reply


class Daemon:
    """Loads one placement's weights and answers engines on its socket."""

    def __init__(self, config: EngineConfig, role: str, tp_rank: int, socket_file: Path) -> None:
        from kernels import select_backend
        from workers.loader import ModelSpec, build_model
        from workers.parallel import TPGroup
        from workers.quant import make_method

        self.socket_file = socket_file
        self.lock = os.fdopen(os.open(f"{socket_file}.lock", os.O_RDWR | os.O_CREAT, 0o600), "w")
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another preload daemon already serves {socket_file}") from None
        kernel = linear_kernel(config)
        method = make_method(config.model.quantization, kernel)
        if not method.cacheable:
            raise ValueError(f"quantization method {method.name} cannot be served from the preload cache")
        self.device = torch.device(config.device.resolved)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", device_index(config, tp_rank))
            torch.cuda.set_device(self.device)
        index = self.device.index or 0
        self.fingerprint = fingerprint(config, tp_rank, device_identity(self.device.type, index), role)
        tp = TPGroup(rank=tp_rank, size=config.parallel.tensor_parallel_size)
        start = time.perf_counter()
        spec = ModelSpec(
            config.model.model,
            config.model.architecture,
            getattr(torch, config.model.dtype),
            self.device,
            select_backend(self.device),
            config.model.max_model_len,
            tp=tp,
            quantization=config.model.quantization,
            kernel=kernel,
        )
        model, _, _ = build_model(spec, show_progress=False)
        entries, self.aliases = named_tensors(model)
        self.attrs = module_attrs(model)
        self.entries = entries
        self.arena: CpuArena | None = None
        if self.device.type == "cpu":
            self.arena = CpuArena(entries)
            repoint(model, self.arena.views, self.aliases)
            self.entries = []  # the arena now holds the only copy
        self.model = model
        self.weight_bytes = sum(t.numel() * t.element_size() for _, _, t in entries)
        self.seconds = time.perf_counter() - start
        release_load_memory(collect=True)  # its start-up time is not a restart's

    def listen(self) -> socket.socket:
        """Bind only now that the weights are ready; a leftover socket file is stale (we hold the lock)."""
        if self.socket_file.exists() or self.socket_file.is_symlink():
            self.socket_file.unlink()
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(self.socket_file))
        os.chmod(self.socket_file, 0o600)
        srv.listen(64)
        return srv

    def answer(self, req: CacheRequest) -> tuple[CacheReply, list[int]]:
        if req.kind == "ping":
            return CacheReply(status="ready", fingerprint=self.fingerprint), []
        if req.fingerprint is None:
            return CacheReply(status="error", message="a state request needs a fingerprint"), []
        fields = differences(req.fingerprint, self.fingerprint)
        if fields:
            return CacheReply(status="mismatch", fields=fields, fingerprint=self.fingerprint), []
        reply = CacheReply(
            status="ok", fingerprint=self.fingerprint, aliases=self.aliases, module_attrs=self.attrs
        )
        if self.arena is not None:
            reply.tensors, reply.arena_bytes = self.arena.specs, self.arena.size
            return reply, [self.arena.fd]
        reply.tensors = export_cuda(self.entries)
        return reply, []

    def serve(self, srv: socket.socket) -> None:
        """Each connection on its own thread: a peer that stalls mid-message holds up no other."""
        while True:
            try:
                conn, _ = srv.accept()
            except OSError as e:  # e.g. out of descriptors while many peers are connected
                log.warning("accept failed: %s", e)
                time.sleep(0.1)
                continue
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    def handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                if peer_uid(conn) != os.getuid():
                    log.warning("refused a connection from uid %d", peer_uid(conn))
                    return
                conn.settimeout(REQUEST_TIMEOUT)
                try:
                    req, sent = recv_msg(conn, CacheRequest)
                except msgspec.ValidationError as e:  # e.g. a kind this daemon does not know
                    send_msg(conn, CacheReply(status="error", message=f"unknown request: {e}"))
                    return
                close_fds(sent)  # no request carries descriptors; a peer's are not kept
                reply, fds = self.answer(req)
                send_msg(conn, reply, fds)
            except Exception as e:  # one bad request never takes the daemon down
                log.warning("request failed: %s", e)

    def close(self) -> None:
        try:
            self.socket_file.unlink()
        except FileNotFoundError:
            pass


def main(argv: list[str] | None = None) -> int:
    from setproctitle import setproctitle

    p = argparse.ArgumentParser(prog="python -m workers.weight_cache.daemon")
    p.add_argument("--role", default="target")
    p.add_argument("--tp-rank", type=int, required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--ready-endpoint", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("EMBER_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s"
    )
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    dp = config.parallel.data_parallel_rank
    setproctitle(f"ember-preload-{args.role}-dp{dp}-tp{args.tp_rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher stops us with SIGTERM
    ctx = zmq.Context()
    report = ctx.socket(zmq.PUSH)
    report.setsockopt(zmq.LINGER, 2000)
    report.connect(args.ready_endpoint)
    codec = Codec(())
    ready = DaemonReady(role=args.role, dp_rank=dp, tp_rank=args.tp_rank)
    try:
        daemon = Daemon(config, args.role, args.tp_rank, Path(args.socket))
        srv = daemon.listen()
    except Exception as e:
        ready.error = f"{type(e).__name__}: {e}"
        report.send_multipart(codec.encode(ready))
        report.close()
        ctx.term()
        return 1

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        daemon.close()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    ready.socket, ready.weight_bytes, ready.seconds = (
        str(daemon.socket_file),
        daemon.weight_bytes,
        daemon.seconds,
    )
    report.send_multipart(codec.encode(ready))
    report.close()
    ctx.term()
    daemon.serve(srv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
