"""`ember preload`: start one weight-cache daemon per (role, DP rank, TP rank) and watch them.

Runs in the launcher process (`ember-preload`). It checks the socket directory (private, ours, not a
symlink), starts the daemons (`python -m workers.weight_cache.daemon`, config as JSON on stdin), waits
for every `DaemonReady` (if one fails or dies while starting, it stops them all and exits with the
reason), then serves `GET /health` on a loopback port (200 only when every rank is ready and none has
died) until SIGTERM/SIGINT. `ember preload --wait` only waits until the daemons of the same placement
answer, for deployment scripts. With `--nnodes N --node-rank R` (the engine's flags) it starts only
the ranks node R holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from coreproc.base.config import EngineConfig
from coreproc.base.errors import ConfigError
from coreproc.base.host import worker_openmp_env
from coreproc.base.ipc import Codec, bind, ipc_endpoint, make_runtime_dir, remove_runtime_dir
from coreproc.base.protocol import DaemonReady


@dataclass
class Placement:
    role: str
    config: EngineConfig
    tp_rank: int
    socket: Path
    proc: subprocess.Popen | None = None
    state: str = "starting"

    @property
    def name(self) -> str:
        return f"{self.role} dp{self.config.parallel.data_parallel_rank} tp{self.tp_rank}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: bundled model)")
    p.add_argument("--draft-model", default=None, help="also hold this draft model's weights")
    p.add_argument("--health-port", type=int, default=None, help="serve GET /health on 127.0.0.1:PORT")
    p.add_argument("--wait", action="store_true", help="only wait until the daemons answer, then exit")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for readiness")


def socket_dir(args: argparse.Namespace) -> Path:
    from coreproc.base.channel import default_socket_dir
    from workers.weight_cache.fingerprint import check_socket_dir

    given = args.socket_dir is not None
    path = Path(args.socket_dir) if given else default_socket_dir()
    try:
        check_socket_dir(path, create=not given, strict=not given)  # an operator's own dir may be shared
    except PermissionError as e:
        raise ConfigError(f"socket directory: {e}") from None
    return path


def placements(config: EngineConfig, draft: EngineConfig | None, directory: Path) -> list[Placement]:
    from workers.parallel import local_placement
    from workers.weight_cache.fingerprint import device_identity, socket_path

    out = []
    par = config.parallel
    for dp_rank in range(par.data_parallel_size):
        for tp_rank in par.node_ranks():  # this node's (all of them on one node)
            for role, cfg in (("target", config), ("draft", draft)):
                if cfg is None:
                    continue
                ranked = dataclasses.replace(
                    cfg, parallel=dataclasses.replace(cfg.parallel, data_parallel_rank=dp_rank)
                )
                device = cfg.device.resolved_type
                index = _cuda_index(local_placement(ranked, tp_rank)) if device == "cuda" else 0
                ident = device_identity(device, index)
                out.append(
                    Placement(role, ranked, tp_rank, socket_path(directory, ident, dp_rank, tp_rank, role))
                )
    return out


def _cuda_index(placement: int) -> int:
    import torch

    return placement % max(1, torch.cuda.device_count())


def wait_for(places: list[Placement], timeout: float) -> int:
    from workers.weight_cache.client import wait_ready

    deadline = time.monotonic() + timeout
    missing = [p.name for p in places if not wait_ready(p.socket, max(0.0, deadline - time.monotonic()))]
    if missing:
        print(f"ember preload: not ready after {timeout:.0f}s: {', '.join(missing)}", file=sys.stderr)
        return 1
    print(f"ember preload: {len(places)} daemons ready")
    return 0


class Launcher:
    """Starts the daemons, tracks their state, stops them."""

    def __init__(self, places: list[Placement], directory: Path) -> None:
        self.places = places
        self.directory = directory
        self.zygote: subprocess.Popen | None = None
        self.zygote_dead = False
        self.runtime = make_runtime_dir()
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.endpoint = ipc_endpoint(self.runtime, "preload")
        bind(self.pull, self.endpoint)

    def start(self, timeout: float) -> None:
        env = dict(os.environ)
        zygote_cmd = [sys.executable, "-m", "coreproc.startup.zygote", "--socket-dir", str(self.directory)]
        for tokenizer in dict.fromkeys(p.config.model.tokenizer for p in self.places if p.role == "target"):
            zygote_cmd += ["--warm", tokenizer]  # the servers it forks find it built
        # the zygote's children are engine workers: their short OpenMP spin, set before torch loads
        zygote_env = worker_openmp_env(env)
        self.zygote = zygote = subprocess.Popen(zygote_cmd, stdout=subprocess.PIPE, text=True, env=zygote_env)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the daemons only hold memory once loaded
        for p in self.places:
            cmd = [sys.executable, "-m", "workers.weight_cache.daemon", "--role", p.role]
            cmd += ["--tp-rank", str(p.tp_rank), "--socket", str(p.socket), "--ready-endpoint", self.endpoint]
            p.proc = proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
            assert proc.stdin is not None, "stdin=PIPE gives the daemon a pipe"
            proc.stdin.write(msgspec.json.encode(p.config))
            proc.stdin.close()
        codec, deadline = Codec((DaemonReady,)), time.monotonic() + timeout
        by_key = {(p.role, p.config.parallel.data_parallel_rank, p.tp_rank): p for p in self.places}
        while any(p.state == "starting" for p in self.places):
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemons not ready after {timeout:.0f}s")
            if self.pull.poll(200):
                msg: DaemonReady = codec.decode(self.pull.recv_multipart())
                place = by_key[(msg.role, msg.dp_rank, msg.tp_rank)]
                if msg.error:
                    raise RuntimeError(f"{place.name}: {msg.error}")
                place.state = "ready"
                gib = msg.weight_bytes / 2**30
                print(
                    f"ember preload: {place.name} ready at {msg.socket} ({gib:.2f} GiB in {msg.seconds:.1f}s)"
                )
            for p in self.places:
                assert p.proc is not None, f"{p.name} was started above"
                if p.state == "starting" and p.proc.poll() is not None:
                    raise RuntimeError(f"{p.name} exited with code {p.proc.returncode} while starting")
        assert zygote.stdout is not None, "stdout=PIPE gives the zygote a pipe"
        line = zygote.stdout.readline().strip()
        if line != "ember zygote: ready":
            raise RuntimeError(f"the worker zygote failed to start: {line or zygote.wait()}")

    def check(self) -> None:
        if self.zygote is not None and self.zygote.poll() is not None and not self.zygote_dead:
            self.zygote_dead = True
            code = self.zygote.returncode
            print(f"ember preload: the worker zygote died (exit code {code})", file=sys.stderr)
        for p in self.places:
            if p.state != "dead" and p.proc is not None and p.proc.poll() is not None:
                p.state = "dead"
                print(f"ember preload: {p.name} died (exit code {p.proc.returncode})", file=sys.stderr)

    def health(self) -> tuple[int, dict]:
        self.check()
        bad = {p.name: p.state for p in self.places if p.state != "ready"}
        if self.zygote is None or self.zygote.poll() is not None:
            bad["zygote"] = "dead"
        return (503, {"status": "unhealthy", "ranks": bad}) if bad else (200, {"status": "ok"})

    def stop(self) -> None:
        procs = [p.proc for p in self.places] + [self.zygote]
        for proc in procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in procs:
            if proc is not None:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        self.pull.close()
        self.ctx.term()
        remove_runtime_dir(self.runtime)


def serve_health(launcher: Launcher, port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def health(request: object) -> JSONResponse:
        status, body = launcher.health()
        return JSONResponse(body, status_code=status)

    app = Starlette(routes=[Route("/health", health)])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, name="ember-preload-health", daemon=True).start()


def run(args: argparse.Namespace, config: EngineConfig, draft: EngineConfig | None) -> int:
    from setproctitle import setproctitle

    if config.parallel.pipeline_parallel_size != 1:
        raise ConfigError(
            "ember preload does not support pipeline parallelism (--pipeline-parallel-size must be 1)"
        )
    directory = socket_dir(args)
    places = placements(config, draft, directory)
    if args.wait:
        return wait_for(places, args.timeout)
    setproctitle("ember-preload")
    launcher = Launcher(places, directory)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        launcher.start(args.timeout)
        if args.health_port is not None:
            serve_health(launcher, args.health_port)
        print(f"ember preload: ready: {len(places)} daemons", flush=True)
        while not stop.wait(0.5):
            launcher.check()
        return 0
    except RuntimeError as e:
        print(f"ember preload: error: {e}", file=sys.stderr)
        return 1
    finally:
        launcher.stop()
