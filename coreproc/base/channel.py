"""Unix-socket messages with file descriptors: one msgspec message each way, descriptors alongside.

Part of the shared base (beside `ipc`, the ZeroMQ side). Runs in preload daemons, the zygote, engine
processes and the `ember` launcher. A message is an 8-byte big-endian length sent with `sendmsg`
(file descriptors ride on it as SCM_RIGHTS), then the body: msgpack, or JSON on the zygote's socket
(which the launcher writes with the standard library; msgspec is imported at the first message, not
with this module). The peer's uid is read with SO_PEERCRED: both sides refuse a peer that is not the
same user.
"""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path
from typing import Any, Literal

MAX_FDS = 16
MAX_BODY = 64 * 2**20

Wire = Literal["msgpack", "json"]  # the daemons' messages / the zygote's (see coreproc.startup.zygote_link)


def default_socket_dir() -> Path:
    """Where `ember preload` puts its daemons' and zygote's sockets unless told (--socket-dir)."""
    import tempfile  # here: the `ember` launcher imports this module and is timed

    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"ember-cache-{os.getuid()}"


def peer_creds(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


def peer_uid(conn: socket.socket) -> int:
    return peer_creds(conn)[1]


def send_frame(conn: socket.socket, body: bytes, fds: list[int] | None = None) -> None:
    """One message's bytes, `fds` riding on its length prefix."""
    socket.send_fds(conn, [struct.pack(">Q", len(body))], fds or [])
    conn.sendall(body)


def send_msg(conn: socket.socket, msg: Any, fds: list[int] | None = None, wire: Wire = "msgpack") -> None:
    import msgspec

    send_frame(conn, (msgspec.json if wire == "json" else msgspec.msgpack).encode(msg), fds)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = conn.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection mid-message")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def recv_frame(conn: socket.socket) -> tuple[bytes, list[int]]:
    """One message's bytes and the file descriptors that came with it (closed here when the message
    is cut short or too large)."""
    head, fds, _, _ = socket.recv_fds(conn, 8, MAX_FDS)
    try:
        if len(head) < 8:
            head += _recv_exact(conn, 8 - len(head)) if head else b""
        if len(head) < 8:
            raise ConnectionError("the peer closed the connection before answering")
        (length,) = struct.unpack(">Q", head)
        if length > MAX_BODY:
            raise ConnectionError(f"message of {length} bytes is too large")
        return _recv_exact(conn, length), fds
    except BaseException:
        close_fds(fds)
        raise


def recv_msg(conn: socket.socket, typ: Any, wire: Wire = "msgpack") -> tuple[Any, list[int]]:
    """One message of `typ` (a message type, or a union of tagged ones) and the file descriptors that
    came with it (the caller closes them; when the message is cut short, too large or does not decode,
    they are closed here)."""
    import msgspec

    body, fds = recv_frame(conn)
    try:
        return (msgspec.json if wire == "json" else msgspec.msgpack).decode(body, type=typ), fds
    except BaseException:
        close_fds(fds)
        raise
