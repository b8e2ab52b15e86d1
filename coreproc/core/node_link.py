"""The head's link to the workers of the other nodes (`ember worker --headless`, mp backend).

Runs in the scheduler process of the head node (node rank 0), inside `MultiprocExecutor`. One ZeroMQ
ROUTER on the master address, port `--master-port` + 1, with CurveZMQ off loopback (only the client
keys of the `--curve-keys` directory get in) and ZMTP heartbeats. Each remote rank connects a DEALER,
sends `WorkerHello` (its rank, node and engine config, checked against ours) and then the same
`WorkerReady` / `StepResult` / `WorkerFailed` as a local worker, and takes `StepRequest` / `Shutdown`.
Frames that do not decode, and messages from a connection that did not say hello, are logged and
dropped (a stray peer cannot take the head down); a rank that said hello and then sends garbage is a
broken worker (`WorkerError`). A socket monitor turns a dropped connection of a rank that said hello
(its node died, its worker was killed, or the link was cut and the heartbeat timed out) into a
`WorkerError` naming the node; other connections come and go unnoticed.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from coreproc.base.config import EngineConfig
from coreproc.base.errors import ConfigError, WorkerError
from coreproc.base.ipc import Codec, CurveServer, ProtocolError, apply_heartbeat, is_loopback_endpoint
from coreproc.base.protocol import FROM_WORKER, WorkerHello

log = logging.getLogger("ember.executor")

# config fields that may differ between nodes: local paths, and which node this is
NODE_LOCAL = {
    ("model", "model"),
    ("parallel", "node_rank"),
    ("parallel", "rank"),
    ("parallel", "curve_keys"),
    ("load", "socket_dir"),
}


def config_differences(ours: EngineConfig, theirs: EngineConfig) -> list[str]:
    """Dotted names of the settings where another node's config differs from ours (paths aside)."""
    a, b = msgspec.to_builtins(ours), msgspec.to_builtins(theirs)
    out = []
    for section in sorted(set(a) | set(b)):
        x, y = a.get(section), b.get(section)
        if isinstance(x, dict) and isinstance(y, dict):
            out += [
                f"{section}.{k}"
                for k in sorted(set(x) | set(y))
                if (section, k) not in NODE_LOCAL and x.get(k) != y.get(k)
            ]
        elif x != y:
            out.append(section)
    return out


def _bind_address(endpoint: str) -> list[str]:
    """The master address as an IP (ZeroMQ binds IPs and interfaces, not names), then every interface
    when that address is not local (a service address in front of the head)."""
    host, port = endpoint[len("tcp://") :].rsplit(":", 1)
    host = host.strip("[]")
    try:
        ip = str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError:
        return [f"tcp://*:{port}"]
    ip = f"[{ip}]" if ":" in ip else ip
    return [f"tcp://{ip}:{port}", f"tcp://*:{port}"]


class NodeLink:
    """The ROUTER the other nodes' ranks connect to, and what the head knows about each connection."""

    def __init__(self, ctx: zmq.Context, config: EngineConfig) -> None:
        par = config.parallel
        self.config = config
        self.remote = [r for r in range(par.world_size) if par.node_of(r) != 0]
        endpoint = par.node_endpoint
        self.curve: CurveServer | None = None
        if not is_loopback_endpoint(endpoint):
            if not par.curve_keys:
                raise ConfigError(
                    f"the workers' link {endpoint} is reachable from other hosts: give --curve-keys DIR "
                    "(from `ember keygen`, copied to every node)"
                )
            self.curve = CurveServer(ctx, Path(par.curve_keys))
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)  # a Shutdown sent as we close still reaches the nodes
        apply_heartbeat(self.sock)
        if self.curve is not None:
            self.curve.apply(self.sock)
        events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        self.monitor = self.sock.get_monitor_socket(events)
        for address in _bind_address(endpoint):
            try:
                self.sock.bind(address)
                break
            except zmq.ZMQError as e:
                if address.startswith("tcp://*"):
                    raise ConfigError(f"cannot listen for the workers' link on {address}: {e}") from None
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.peer_of_fd: dict[int, str] = {}  # accepted connection -> peer IP
        self.peer_of_rank: dict[int, str] = {}  # rank that said hello -> peer IP
        self.fd_of_rank: dict[int, int] = {}  # rank that said hello -> its connection
        self.codec = Codec(FROM_WORKER)

    def receive(self) -> object | None:
        """The next message of a rank that said hello, or None: a hello was taken in, or frames from
        a stray peer were dropped. WorkerError when a rank that said hello sends garbage."""
        identity, *parts = self.sock.recv_multipart(copy=False)
        fd = parts[-1].get(zmq.SRCFD)
        peer = parts[-1].get("Peer-Address")
        rank = next((r for r, f in self.fd_of_rank.items() if f == fd), None)
        try:
            msg = self.codec.decode(parts)
            if isinstance(msg, WorkerHello):
                self.hello(msg, peer, fd)
                return None
        except (ProtocolError, msgspec.DecodeError) as e:
            if rank is not None:
                raise WorkerError(f"rank {rank} at {peer} sent a malformed message: {e}") from None
            log.warning("dropped a malformed message on the workers' link from %s: %s", peer, e)
            return None
        if rank is None or identity.bytes != f"w{rank}".encode():
            log.warning("dropped a %s from %s, which did not say hello", type(msg).__name__, peer)
            return None
        return msg

    def hello(self, msg: WorkerHello, peer: str, fd: int = -1) -> None:
        """A remote rank connected: check who it says it is and that its engine flags equal ours
        (ConfigError: the nodes were started with different flags). A config that does not decode
        is garbage (msgspec.DecodeError), checked first."""
        theirs = msgspec.json.decode(msg.config, type=EngineConfig)
        par = self.config.parallel
        if msg.rank not in self.remote or par.node_of(msg.rank) != msg.node_rank:
            raise ConfigError(
                f"a worker at {peer} says it is rank {msg.rank} on node {msg.node_rank}; this engine has "
                f"{par.world_size} ranks, {par.ranks_per_node} per node on {par.nnodes} nodes"
            )
        if msg.rank in self.peer_of_rank:
            raise ConfigError(
                f"two workers say they are rank {msg.rank} (node {msg.node_rank}): at "
                f"{self.peer_of_rank[msg.rank]} and {peer}; check each node's --node-rank"
            )
        diff = config_differences(self.config, theirs)
        if diff:
            raise ConfigError(
                f"node {msg.node_rank} ({peer}) runs other engine flags than the head: {', '.join(diff)}"
            )
        self.peer_of_rank[msg.rank] = peer
        self.fd_of_rank[msg.rank] = fd
        log.info("rank %d of node %d connected from %s", msg.rank, msg.node_rank, peer)

    def check(self, wait_ms: int = 0) -> None:
        """Read the connection events so far (the first for up to `wait_ms`); a dropped connection of a
        known rank raises WorkerError."""
        while self.monitor.poll(wait_ms):
            wait_ms = 0
            event = recv_monitor_message(self.monitor)
            kind, fd = event["event"], int(event["value"])
            if kind == zmq.EVENT_ACCEPTED:
                self.peer_of_fd[fd] = _peer_ip(fd)
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                log.warning("refused a connection to the workers' link: its key is not in --curve-keys")
            elif kind == zmq.EVENT_DISCONNECTED:
                peer = self.peer_of_fd.pop(fd, "?")
                ranks = sorted(r for r, f in self.fd_of_rank.items() if f == fd)
                if ranks:
                    node = self.config.parallel.node_of(ranks[0])
                    raise WorkerError(
                        f"lost node {node} at {peer} (ranks {', '.join(map(str, ranks))}): its connection "
                        "closed or stopped answering heartbeats (node down, link cut, or worker killed)"
                    )

    def close(self) -> None:
        self.monitor.close(0)
        self.sock.close()
        if self.curve is not None:
            self.curve.stop()


def _peer_ip(fd: int) -> str:
    """The peer IP of a connection ZeroMQ accepted (a duplicate of its descriptor, closed at once)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:  # the family is read from the descriptor
            return str(conn.getpeername()[0])
    except OSError:
        return "?"
