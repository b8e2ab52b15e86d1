"""The server's listening socket, bound before anything else starts (a taken port fails at once).

Runs in the frontend process (`ember serve`, its API server children, a parked snapshot) and in
`ember snapshot restore`, which checks the port before restoring; imports nothing of Ember but its
errors, so that the restore's check stays light.
"""

from __future__ import annotations

import socket

from coreproc.base.errors import EmberError


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening socket (`reuse_port`: shared with the other API server processes)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise EmberError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    return sock
