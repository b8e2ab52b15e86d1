"""`ember serve [MODEL]`: start the engine cores, then the HTTP server in front of them.

Runs in the frontend process. The listening socket is bound first (a taken port fails at once, before
the model loads), then the `ember-core` processes (one per data-parallel rank) and their workers start
and report ready, then uvicorn (uvloop) serves the Starlette app on that socket; with
`--api-server-count N`, N - 1 more frontend processes share the port (frontend.http.processes).
Ctrl-C / SIGTERM: uvicorn drains, then the other API servers and the cores are stopped, and the exit
status is 0 (1 when the cores died first).

Parked mode (`--snapshot-park DIR`, started by `ember snapshot create`): everything is initialized the
same way, but no socket is bound. The canary request runs through the app in-process, its answer goes
to DIR/canary.json, and the process waits for DIR/handoff.json, which `ember snapshot restore` writes
for each restored copy, to learn the address to bind. It runs on asyncio's own loop: uvloop's libuv
holds an io_uring descriptor, which CRIU cannot dump.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coreproc.base import standby, trace
from coreproc.base.errors import EmberError
from coreproc.base.model_config import MODEL_HELP
from frontend.atomic_files import write_json_atomic
from frontend.canary import canary_request, canary_result
from frontend.http.listen import bind
from frontend.http.processes import (
    CHILD_FLAG,
    exit_with_parent,
    remove_shared_metrics,
    start_children,
    stop_children,
    use_shared_metrics,
)
from frontend.http.read_deadline import read_deadline_protocol
from frontend.http.security import exposure_warning
from frontend.http.settings import ServerConfig, add_server_arguments, server_config

if TYPE_CHECKING:
    from coreproc.base.config import EngineConfig

HANDOFF_POLL_S = 0.002
FRONTEND = "ember serve"  # the frontend's name in a start-up trace (its process title is Python's)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The model positional and the server flags (the CLI adds the engine flags)."""
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    add_server_arguments(p)
    p.add_argument("--snapshot-park", default=None, help=argparse.SUPPRESS)
    p.add_argument(CHILD_FLAG, default=None, help=argparse.SUPPRESS)  # set for API servers 1..N-1


def describe_engine(addresses: list[str]) -> str:
    """One line for the operator: model, weight memory by dtype, load and quantization time (and the
    number of data-parallel engine cores)."""
    from coreproc.client.sdk import EngineClient

    with EngineClient(addresses[0]) as client:
        info = client.info_cache
    weights = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(info.weight_bytes_by_dtype.items()))
    cores = f"; {len(addresses)} data-parallel engine cores ({info.dp_routing})" if len(addresses) > 1 else ""
    return (
        f"ember serve: {info.model} (quantization {info.quantization or 'none'}): weights {weights} "
        f"from {info.weight_source}; loaded in {info.load_seconds:.2f}s, "
        f"quantized in {info.quantize_seconds:.2f}s; "
        f"{info.num_kv_blocks} KV blocks of {info.block_size} tokens{cores}"
    )


def prepare_http(tokenizer_dir: str) -> tuple[Any, Any, Any]:
    """The HTTP stack's imports and the tokenizer (uvicorn, build_app, tokenizer): done while the
    engine starts, they are off the time to ready (a server forked by the preload zygote finds both
    ready)."""
    with trace.phase("HTTP stack imports", FRONTEND):
        import uvicorn

        from frontend.http.server import build_app
    from coreproc.base.tokenizer import load_tokenizer, tokenizer_built

    if tokenizer_built(tokenizer_dir):
        return uvicorn, build_app, load_tokenizer(tokenizer_dir)
    with trace.phase("tokenizer", FRONTEND):
        return uvicorn, build_app, load_tokenizer(tokenizer_dir)


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    from coreproc.startup.launcher import CoreGroup

    trace.started(process=FRONTEND)
    if args.snapshot_park:
        return run_parked(args, config, Path(args.snapshot_park))
    if args.api_server_child:
        return run_child(args, config, json.loads(args.api_server_child))
    cfg = server_config(args)  # its errors before the port is taken and the model loads
    raise_open_file_limit()
    count = cfg.api_server_count
    metrics_dir = use_shared_metrics() if count > 1 else None  # before prometheus_client loads
    dead: str | None = None
    try:
        sock = bind(args.host, args.port, reuse_port=count > 1)
        host, port = sock.getsockname()[:2]
        with ThreadPoolExecutor(1) as pool:
            prepared = pool.submit(prepare_http, config.model.tokenizer)
            with trace.phase("start the engine cores", FRONTEND):
                group = CoreGroup(config, shutdown_timeout=args.shutdown_timeout)
            standby.discard()  # a core started early that this launch did not take
            with group as cores:
                uvicorn, build_app, tokenizer = prepared.result()
                print(describe_engine(cores.addresses), flush=True)
                children = start_children(args.argv, count, port, cores.addresses) if count > 1 else []
                try:
                    with trace.phase("build the app", FRONTEND):
                        app = build_app(cores.addresses, config.model.model, cfg, tokenizer)
                    servers = f" ({count} API server processes)" if count > 1 else ""
                    warning = exposure_warning(host, bool(cfg.api_key))
                    if warning:
                        print(warning, file=sys.stderr, flush=True)
                    scheme = "https" if cfg.tls else "http"
                    server = _uvicorn_server(uvicorn, app, cfg, args.shutdown_timeout)
                    watch = EngineWatch(server, app, cores)
                    watch.start()
                    with stop_signals_end_serving(server):  # from the line a supervisor waits for
                        print(f"ember serve: listening on {scheme}://{host}:{port}{servers}", flush=True)
                        server.run(sockets=[sock])
                    dead = watch.dead
                finally:
                    stop_children(children, args.shutdown_timeout)
    finally:
        if metrics_dir is not None:
            remove_shared_metrics(metrics_dir)
    return 1 if dead else 0


CORE_EXIT_WAIT_S = 10.0
WATCH_POLL_S = 0.02  # a supervisor's restart starts this much sooner after the last core is gone


class EngineWatch(threading.Thread):
    """Ends `ember serve` (exit status 1) once every engine core is gone, so that a supervisor
    (systemd `Restart=always`, Kubernetes) restarts it; the streams have had their error events. A
    core given up while still running (stopped, wedged) is killed if it has not exited in 10 s."""

    def __init__(self, server: Any, app: Any, cores: Any) -> None:
        super().__init__(name="ember-engine-watch", daemon=True)
        self.server, self.app, self.cores = server, app, cores
        self.dead: str | None = None

    def run(self) -> None:
        while not self.server.should_exit:  # a normal shutdown stops the watch before the cores
            ctx = self.app.state.api.ctx
            dead = None if ctx is None else ctx.dead or ctx.client.dead  # the client knows first
            if dead is not None:
                self.dead = dead
                print(f"ember serve: every engine core is gone ({dead}); exiting", flush=True)
                self.server.stop(drain=False)  # the streams have had their error events
                deadline = time.monotonic() + CORE_EXIT_WAIT_S  # a dying core stops its workers
                for core in self.cores.cores:
                    while core.alive() and time.monotonic() < deadline:
                        time.sleep(0.1)
                    if core.alive():  # stopped or wedged: it will not exit by itself
                        core.proc.kill()
                return
            time.sleep(WATCH_POLL_S)


def run_child(args: argparse.Namespace, config: EngineConfig, spec: dict[str, Any]) -> int:
    """API server `spec["index"]` of `--api-server-count`: the parent's engine cores, the shared port."""
    from setproctitle import setproctitle

    setproctitle(f"ember-api-server-{spec['index']}")
    exit_with_parent(spec["parent"])
    cfg = server_config(args)
    sock = bind(args.host, args.port, reuse_port=True)
    uvicorn, build_app, tokenizer = prepare_http(config.model.tokenizer)
    app = build_app(spec["addresses"], config.model.model, cfg, tokenizer, api_server=spec["index"])
    print(f"ember serve: API server {spec['index']} listening", flush=True)
    server = _uvicorn_server(uvicorn, app, cfg, args.shutdown_timeout)
    with stop_signals_end_serving(server):
        server.run(sockets=[sock])
    return 0


@contextlib.contextmanager
def stop_signals_end_serving(server: Any) -> Iterator[None]:
    """uvicorn drains on SIGTERM / SIGINT and then raises the signal again for the handler it found;
    the default one would end the process there, before its `finally` blocks stop the API server
    children and the engine cores (which then log that their launcher is gone). Inside, that handler
    only tells `server` to exit: a signal that comes before uvicorn has put its own handlers in place
    (while it starts) still ends the serving, and one raised again after it changes nothing."""
    stops = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, lambda *_: server.stop()) for sig in stops}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def raise_open_file_limit() -> None:
    """Every connection is a file descriptor: take the hard limit (children inherit it), so thousands
    of idle clients do not lock out new ones at a soft limit of 1024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # keep the soft limit; nothing else depends on it


def _uvicorn_server(uvicorn: Any, app: Any, cfg: ServerConfig, shutdown_timeout: float) -> Any:
    """uvicorn on uvloop; with --ssl-certfile it wraps the pre-bound socket in TLS."""
    from frontend.http.uvicorn_server import Server

    level = logging.getLevelName(logging.getLogger().level).lower()
    return Server(
        uvicorn.Config(
            app,
            loop="uvloop",
            log_level=level,
            timeout_graceful_shutdown=shutdown_timeout,
            http=read_deadline_protocol(cfg.request_read_timeout),
            **cfg.uvicorn_ssl(),
        )
    )


def run_parked(args: argparse.Namespace, config: EngineConfig, state: Path) -> int:
    """Initialize fully, answer the canary, wait for a restore's address, then serve (see module doc)."""
    import asyncio

    from coreproc.startup.launcher import CoreProcess
    from frontend.http.server import build_app

    cfg = server_config(args)
    with CoreProcess(config, shutdown_timeout=args.shutdown_timeout) as core:
        print(describe_engine([core.address]), flush=True)
        app = build_app([core.address], config.model.model, cfg)
        return asyncio.run(_parked(app, state, str(core.runtime_dir), args.shutdown_timeout))


async def _parked(app: Any, state: Path, runtime_dir: str, shutdown_timeout: float) -> int:
    import asyncio

    import httpx
    import uvicorn

    from frontend.http.uvicorn_server import Server

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # PID 1 of a namespace ignores unhandled signals
        loop.add_signal_handler(sig, stop.set)
    api = app.state.api
    api.warm_media = False  # image processes hold POSIX semaphores CRIU cannot dump: started once restored
    async with api.lifespan(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://snapshot") as http:
            reply = await http.post("/v1/completions", json=canary_request())
        if reply.status_code != 200:
            print(f"ember serve: the canary request failed: {reply.text}", flush=True)
            return 1
        canary = {**canary_result(reply.json()), "runtime_dir": runtime_dir, "pid": os.getpid()}
        write_json_atomic(state / "canary.json", canary)
        print("ember serve: parked for a snapshot", flush=True)
        handoff = state / "handoff.json"
        while not handoff.exists():  # after a restore the file is already there
            if stop.is_set():
                return 0
            await asyncio.sleep(HANDOFF_POLL_S)
        addr = json.loads(handoff.read_text())
        handoff.unlink(missing_ok=True)
        if api.ctx is not None and api.ctx.media is not None:
            api.ctx.media.warm()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        try:
            sock = bind(addr["host"], addr["port"])
        except EmberError as e:
            print(f"ember serve: restored, but {e}", flush=True)
            return 1
        host, port = sock.getsockname()[:2]
        server = Server(
            uvicorn.Config(
                app,
                lifespan="off",
                log_level=logging.getLevelName(logging.getLogger().level).lower(),
                timeout_graceful_shutdown=shutdown_timeout,
                http=read_deadline_protocol(app.state.api.cfg.request_read_timeout),
            )
        )
        print(
            f"ember serve: restored at {time.strftime('%Y-%m-%d %H:%M:%S')}; "
            f"listening on http://{host}:{port}",
            flush=True,
        )
        with stop_signals_end_serving(server):
            await server.serve(sockets=[sock])
    return 0
