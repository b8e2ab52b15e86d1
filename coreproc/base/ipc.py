"""ZeroMQ plumbing shared by the core, the workers and the client SDK.

Runs in every process that has a socket. `Codec` frames protocol messages as [kind byte, msgpack body]
and decodes only the kinds allowed on its socket (no pickle anywhere). Also: the private runtime
directory for IPC endpoints (mode 0700, one per launch, checked), `bind` (ipc socket files 0600),
loopback checks, CurveZMQ key handling for TCP endpoints that are reachable from other hosts, and
ZMTP heartbeats for links between hosts.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from coreproc.base.errors import EmberError
from coreproc.base.protocol import KIND_OF


class ProtocolError(RuntimeError):
    """A peer sent a frame that is not a message of this socket's direction."""


class Codec:
    """Encodes any protocol message; decodes only the message types given."""

    def __init__(self, allowed: tuple[type, ...]) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoders: dict[bytes, msgspec.msgpack.Decoder[Any]] = {
            KIND_OF[t]: msgspec.msgpack.Decoder(t) for t in allowed
        }

    def encode(self, msg: Any) -> list[bytes]:
        return [KIND_OF[type(msg)], self._encoder.encode(msg)]

    def decode(self, frames: list[bytes] | list[zmq.Frame]) -> Any:
        if len(frames) != 2:
            raise ProtocolError(f"expected 2 frames, got {len(frames)}")
        kind, body = (f.bytes if isinstance(f, zmq.Frame) else f for f in frames)
        decoder = self._decoders.get(kind)
        if decoder is None:
            raise ProtocolError(f"unexpected message kind {kind!r} on this socket")
        try:
            return decoder.decode(body)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"malformed message: {e}") from None


def make_runtime_dir() -> Path:
    """A fresh private directory (0700) for this launch's IPC endpoints."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    base = base if base and os.access(base, os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="ember-", dir=base))
    path.chmod(0o700)
    check_private_dir(path)
    return path


def check_private_dir(path: Path) -> None:
    """EmberError unless `path` is a real directory (not a symlink) owned by us with mode 0700."""
    try:
        info = os.lstat(path)
    except OSError as e:
        raise EmberError(f"runtime directory {path}: {e.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise EmberError(f"runtime directory {path} is not a real directory")
    if info.st_uid != os.getuid():
        raise EmberError(f"runtime directory {path} is owned by uid {info.st_uid}, not by us ({os.getuid()})")
    if info.st_mode & 0o077:
        raise EmberError(f"runtime directory {path} has mode {oct(info.st_mode & 0o777)}; want 0700")


def bind(sock: zmq.Socket, endpoint: str) -> None:
    """`sock.bind(endpoint)`; an ipc:// socket file is made 0600 at once (zmq leaves it to the umask:
    0755, or 0775 under umask 002, which lets the group connect). Its directory must belong to us (or
    root) and be writable by nobody else, unless sticky (/tmp): else another user could swap the file."""
    path = ipc_path(endpoint)
    if path is not None:
        check_socket_parent(path.parent)
    sock.bind(endpoint)
    if path is not None:
        os.chmod(path, 0o600)


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ipc:// endpoint (None for other transports and abstract names)."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None
    return Path(endpoint[len("ipc://") :])


def check_socket_parent(directory: Path) -> None:
    """EmberError unless another user can neither own `directory` nor replace files in it."""
    try:
        info = os.stat(directory)
    except OSError as e:
        raise EmberError(f"socket directory {directory}: {e.strerror}") from None
    if info.st_uid not in (os.getuid(), 0):
        raise EmberError(f"socket directory {directory} is owned by uid {info.st_uid}, not by us or root")
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        mode = oct(info.st_mode & 0o777)
        raise EmberError(f"socket directory {directory} is writable by other users (mode {mode})")


def remove_runtime_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def ipc_endpoint(runtime_dir: Path, name: str) -> str:
    return f"ipc://{runtime_dir / name}"


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for ipc:// and inproc:// endpoints and TCP on a loopback address."""
    url = urlparse(endpoint)
    if url.scheme in ("ipc", "inproc"):
        return True
    if url.scheme != "tcp" or url.hostname is None:
        return False
    host = url.hostname
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


def generate_curve_keys(directory: Path) -> tuple[Path, Path]:
    """Write a server and a client key pair; authorised client public keys go in `clients/`."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    clients = directory / "clients"
    clients.mkdir(exist_ok=True)
    _, server_secret = zmq.auth.create_certificates(str(directory), "server")
    client_public, client_secret = zmq.auth.create_certificates(str(directory), "client")
    shutil.copy(client_public, clients / Path(client_public).name)
    return Path(server_secret), Path(client_secret)


class CurveServer:
    """CURVE on a server socket: only clients whose public key is in `keys_dir/clients` get through."""

    def __init__(self, context: zmq.Context, keys_dir: Path) -> None:
        secret = keys_dir / "server.key_secret"
        clients = keys_dir / "clients"
        if not secret.is_file() or not clients.is_dir():
            raise EmberError(f"{keys_dir} lacks server.key_secret or clients/ (see `ember keygen`)")
        self.public, self.secret = zmq.auth.load_certificate(str(secret))
        self.auth = ThreadAuthenticator(context)
        self.auth.start()
        self.auth.configure_curve(domain="*", location=str(clients))

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def stop(self) -> None:
        self.auth.stop()


def apply_curve_client(sock: zmq.Socket, server_public_key: Path, client_secret_key: Path) -> None:
    """Make a client socket authenticate to a CURVE server."""
    server_public, _ = zmq.auth.load_certificate(str(server_public_key))
    public, secret = zmq.auth.load_certificate(str(client_secret_key))
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def apply_curve_client_dir(sock: zmq.Socket, keys_dir: Path) -> None:
    """Authenticate a client socket with an `ember keygen` directory: its client key pair and the
    server's public key."""
    server, client = keys_dir / "server.key", keys_dir / "client.key_secret"
    if not server.is_file() or not client.is_file():
        raise EmberError(f"{keys_dir} lacks server.key or client.key_secret (see `ember keygen`)")
    apply_curve_client(sock, server, client)


HEARTBEAT_INTERVAL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000


def apply_heartbeat(
    sock: zmq.Socket, interval_ms: int = HEARTBEAT_INTERVAL_MS, timeout_ms: int = HEARTBEAT_TIMEOUT_MS
) -> None:
    """ZMTP heartbeats on a TCP link between hosts: PING every `interval_ms`; a peer silent for
    `timeout_ms` (a dead host, a cut link: no FIN ever comes) has its connection dropped, which a
    socket monitor reports as EVENT_DISCONNECTED. The peer is told to drop us after the same time."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, interval_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, timeout_ms)
