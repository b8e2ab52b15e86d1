"""The engine's `ipc_cache` loader: map a preload daemon's weights instead of reading the checkpoint.

Runs in worker processes (and in-process engines). It computes this rank's fingerprint, checks the
daemon's socket (a real socket, owned by us) and the peer (same uid), asks for the state, and on a
match builds the model on the meta device and installs the daemon's tensors zero-copy. Any reason not
to use the cache (no daemon, a fingerprint mismatch naming the fields, a daemon that hangs up or does
not answer within `STATE_TIMEOUT`) raises
`CacheUnavailable`; the worker then loads from disk and logs the reason in one line.
"""

from __future__ import annotations

import os
import socket
import stat
import time
from pathlib import Path

import torch
from torch import nn

from coreproc.base import trace
from coreproc.base.channel import default_socket_dir, peer_creds, peer_uid, recv_msg, send_msg
from coreproc.base.config import EngineConfig
from coreproc.base.protocol import CacheReply, CacheRequest
from kernels import AttentionBackend
from workers.models.layers import VocabEmbedding
from workers.parallel import TPGroup
from workers.quant.base import QuantLayer
from workers.weight_cache.arena import import_cpu, import_cuda, install, keep_mapping
from workers.weight_cache.fingerprint import (
    device_identity,
    fingerprint,
    linear_kernel,
    socket_path,
)

STATE_TIMEOUT = 10.0  # s; a ready daemon answers from memory, so silence means it is stopped or wedged


class CacheUnavailable(Exception):
    """The weights cannot come from the cache; the message says why (for the one log line)."""


def cache_socket(config: EngineConfig, device: torch.device, tp_rank: int, role: str = "target") -> Path:
    directory = Path(config.load.socket_dir) if config.load.socket_dir else default_socket_dir()
    ident = device_identity(device.type, device.index or 0)
    return socket_path(directory, ident, config.parallel.data_parallel_rank, tp_rank, role)


def connect(path: Path, timeout: float) -> socket.socket:
    """A connection to the daemon at `path`, with the socket and peer checks."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise CacheUnavailable(f"no preload daemon at {path}") from None
    if not stat.S_ISSOCK(info.st_mode):
        raise CacheUnavailable(f"{path} is not a socket")
    if info.st_uid != os.getuid():
        raise CacheUnavailable(f"{path} is owned by uid {info.st_uid}, not by us")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout)
    try:
        conn.connect(str(path))
        if peer_uid(conn) != os.getuid():
            raise CacheUnavailable(f"the process behind {path} runs as another user")
    except (ConnectionRefusedError, FileNotFoundError):
        conn.close()
        raise CacheUnavailable(f"no preload daemon listening at {path} (stale socket)") from None
    except BaseException:
        conn.close()
        raise
    return conn


def daemon_pid(path: Path, timeout: float = 5.0) -> int:
    """The pid of the daemon at `path` if it answers a ping "ready", else 0."""
    try:
        conn = connect(path, timeout)
    except (CacheUnavailable, OSError):
        return 0
    try:
        send_msg(conn, CacheRequest(kind="ping"))
        reply, fds = recv_msg(conn, CacheReply)
        for fd in fds:
            os.close(fd)
        return peer_creds(conn)[0] if reply.status == "ready" else 0
    except (ConnectionError, OSError, ValueError):
        return 0
    finally:
        conn.close()


def request(path: Path, req: CacheRequest, timeout: float = 10.0) -> tuple[CacheReply, list[int]]:
    """One request to a daemon, with the socket and peer checks."""
    conn = connect(path, timeout)
    try:
        try:
            send_msg(conn, req)
            return recv_msg(conn, CacheReply)
        except TimeoutError:  # a stopped or wedged daemon: the caller loads from disk instead
            raise CacheUnavailable(f"the preload daemon at {path} did not answer in {timeout:g} s") from None
        except (ConnectionError, OSError) as e:
            raise CacheUnavailable(
                f"the preload daemon at {path} failed during the handshake ({e})"
            ) from None
    finally:
        conn.close()


def wait_ready(path: Path, timeout: float) -> bool:
    """Ping until the daemon answers "ready" or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            reply, fds = request(path, CacheRequest(kind="ping"), timeout=5.0)
            for fd in fds:
                os.close(fd)
            if reply.status == "ready":
                return True
        except CacheUnavailable:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def load_from_cache(
    config: EngineConfig,
    device: torch.device,
    tp: TPGroup,
    backend: AttentionBackend,
    role: str = "target",
) -> nn.Module:
    """The model with the daemon's tensors installed (zero-copy), or CacheUnavailable."""
    from workers.quant import make_method

    kernel = linear_kernel(config)
    method = make_method(config.model.quantization, kernel)
    if not method.cacheable:
        raise ValueError(f"quantization method {method.name} cannot be served from the preload cache")
    path = cache_socket(config, device, tp.rank, role)
    if config.load.preload_wait_timeout > 0:
        wait_ready(path, config.load.preload_wait_timeout)
    with trace.phase("weights: fingerprint"):
        fp = fingerprint(config, tp.rank, device_identity(device.type, device.index or 0), role)
    with trace.phase("weights: the daemon's answer"):
        reply, fds = request(path, CacheRequest(kind="state", fingerprint=fp), timeout=STATE_TIMEOUT)
    try:
        if reply.status == "mismatch":
            raise CacheUnavailable(f"fingerprint mismatch in {', '.join(reply.fields)}")
        if reply.status != "ok":
            raise CacheUnavailable(f"the preload daemon answered {reply.status}: {reply.message}")
        if device.type == "cpu":
            if not fds:
                raise CacheUnavailable("the preload daemon sent no shared memory")
            with trace.phase("weights: map the arena"):
                tensors, mapping = import_cpu(fds[0], reply.arena_bytes, reply.tensors)
        else:
            tensors, mapping = import_cuda(reply.tensors, device), None
    finally:
        for fd in fds:
            os.close(fd)
    with trace.phase("weights: the model around them"):
        model = around(config, device, backend, kernel, tp, tensors, reply)
    if mapping is not None:
        keep_mapping(model, mapping)  # keeps the shared memory mapped as long as the model lives
    return model.eval()


def around(
    config: EngineConfig,
    device: torch.device,
    backend: AttentionBackend,
    kernel: str,
    tp: TPGroup,
    tensors: dict[str, torch.Tensor],
    reply: CacheReply,
) -> nn.Module:
    """The model built on the meta device with the cache's tensors installed, its derived tables made
    real (`materialize`), CacheUnavailable if a tensor is missing."""
    from workers.loader import ModelSpec, construct

    cfg = config.model
    meta = torch.device("meta")
    spec = ModelSpec(
        cfg.model, cfg.architecture, getattr(torch, cfg.dtype), meta, backend, cfg.max_model_len,
        tp=tp, quantization=cfg.quantization, kernel=kernel,
    )  # fmt: skip
    model = construct(spec)
    install(model, tensors, reply.tensors, reply.aliases)
    for name, attrs in reply.module_attrs.items():
        layer = model.get_submodule(name)
        if not isinstance(layer, (QuantLayer, VocabEmbedding)):
            raise CacheUnavailable(f"the cache has quantization attributes for {name}, not a quantized layer")
        layer.quant_attrs = attrs
    for module in model.modules():
        materialize = getattr(module, "materialize", None)  # layers with derived buffers (rotary)
        if materialize is not None:
            materialize(device)
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise CacheUnavailable(f"the cache lacks {len(missing)} tensors (first: {missing[0]})")
    return model
