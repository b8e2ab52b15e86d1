"""A worker rank on another node than the head's (`ember worker --headless`): its link to the core.

Runs in worker processes of node ranks 1.. . The rank's DEALER connects over TCP to the head's
`coreproc.core.node_link.NodeLink` (port `--master-port` + 1), with CurveZMQ keys from `--curve-keys` off
loopback and ZMTP heartbeats, and first sends `WorkerHello` (rank, node, config). A watchdog thread
reads the socket's monitor: once connected, a dropped connection (the head died, the link was cut and
the heartbeat timed out) ends the process, even one blocked in a collective with the lost head.
Also: the network interface that reaches the head, for gloo (GLOO_SOCKET_IFNAME).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import threading
from pathlib import Path

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from coreproc.base.config import EngineConfig
from coreproc.base.errors import EmberError
from coreproc.base.ipc import Codec, apply_curve_client_dir, apply_heartbeat, is_loopback_endpoint
from coreproc.base.protocol import WorkerHello

log = logging.getLogger("ember.worker")

SHUTDOWN_GRACE_S = 1.0  # a Shutdown sent just before the head closes may still be on its way
SIOCGIFADDR = 0x8915


def is_remote(config: EngineConfig, rank: int) -> bool:
    """Whether `rank` runs on another node than the head's (and so talks to it over TCP)."""
    return config.parallel.nnodes > 1 and config.parallel.node_of(rank) != 0


def connect_head(sock: zmq.Socket, config: EngineConfig, rank: int, stopping: threading.Event) -> None:
    """Connect `sock` to the head with keys and heartbeats, start the watchdog, and say hello."""
    endpoint = config.parallel.node_endpoint
    apply_heartbeat(sock)
    if not is_loopback_endpoint(endpoint):
        if not config.parallel.curve_keys:
            raise EmberError(
                f"{endpoint} is not loopback: give --curve-keys DIR (the head's, from `ember keygen`)"
            )
        apply_curve_client_dir(sock, Path(config.parallel.curve_keys))
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    name = f"head-watch-{rank}"
    threading.Thread(target=_watch, args=(monitor, rank, stopping), name=name, daemon=True).start()
    sock.connect(endpoint)
    hello = WorkerHello(rank=rank, node_rank=config.parallel.node_rank, config=msgspec.json.encode(config))
    sock.send_multipart(Codec(()).encode(hello))


def _watch(monitor: zmq.Socket, rank: int, stopping: threading.Event) -> None:
    """Exit the process when the head's connection drops after it was made (unless we are stopping)."""
    connected = False
    try:
        while True:
            try:
                event = recv_monitor_message(monitor)
            except zmq.ZMQError:  # the context is closing: the worker is exiting on its own
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED and connected:
                if stopping.wait(SHUTDOWN_GRACE_S):
                    return
                log.error("rank %d: lost the head (connection closed or heartbeat timed out); exiting", rank)
                os._exit(1)
    finally:
        monitor.close(0)  # the context's term() waits for every socket


def interface_towards(host: str) -> str | None:
    """The name of the local network interface whose address routes to `host` (None if unknown)."""
    try:
        family = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family[0], socket.SOCK_DGRAM) as probe:
            probe.connect((family[4][0], 9))  # UDP: picks the route and source address, sends nothing
            local = probe.getsockname()[0]
    except OSError:
        return None
    if family[0] != socket.AF_INET:
        return None  # gloo then picks by hostname; set GLOO_SOCKET_IFNAME yourself
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == local:
                return name
    return None
