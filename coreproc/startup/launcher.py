"""Starts an `ember-core` process (which starts its workers) and waits for its typed READY.

Runs in the process that needs an engine behind a socket: the HTTP frontend, tests, benchmarks.
It creates the launch's private runtime directory (0700), starts `python -m coreproc.base.boot core`
(coreproc.core.server, collector paused while it starts) with the config as JSON on stdin, or has the
preload zygote fork it (`--load-format ipc_cache`, coreproc.startup.spawn), and waits
for `CoreReady` on a one-shot socket, with a timeout, watching the child. `stop()` sends SIGTERM
(graceful), then kills what is left and removes the directory. `CoreGroup` starts the cores of
data parallelism together: one per rank, its config's `data_parallel_rank` set.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq

from coreproc.base.config import EngineConfig
from coreproc.base.errors import EmberError
from coreproc.base.ipc import Codec, bind, ipc_endpoint, make_runtime_dir, remove_runtime_dir
from coreproc.base.protocol import CoreReady
from coreproc.startup.spawn import spawn_engine_process
from coreproc.startup.zygote_link import ForkedProcess


class EngineStartError(RuntimeError):
    """The core process could not start; the message says why."""


class EngineRefused(EmberError):
    """The core refused to start for a reason the user can fix (a flag that does not fit the model,
    a checkpoint that does not match its config); the message says which."""


class CoreProcess:
    """A running `ember-core` child process and the address clients connect to."""

    def __init__(
        self,
        config: EngineConfig,
        listen: str | None = None,
        curve_keys: Path | None = None,
        ready_timeout: float = 600.0,
        shutdown_timeout: float = 30.0,
        client_timeout: float = 10.0,
        wait: bool = True,
    ) -> None:
        """Start the core; with `wait` (the default) return once it is ready, else call `wait_ready()`."""
        self.runtime_dir = make_runtime_dir()
        self.ready_timeout = ready_timeout
        self.address = ""
        listen = listen or ipc_endpoint(self.runtime_dir, "core")
        ready_endpoint = ipc_endpoint(self.runtime_dir, "launcher")
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        bind(self._pull, ready_endpoint)
        argv = [
            "--listen",
            listen,
            "--runtime-dir",
            str(self.runtime_dir),
            "--ready-endpoint",
            ready_endpoint,
        ]
        argv += ["--shutdown-timeout", str(shutdown_timeout), "--parent-pid", str(os.getpid())]
        argv += ["--client-timeout", str(client_timeout)]
        if curve_keys is not None:
            argv += ["--curve-keys", str(curve_keys)]
        try:
            self.proc: subprocess.Popen | ForkedProcess = spawn_engine_process(
                config, "core", argv, msgspec.json.encode(config)
            )
        except BaseException:
            self._close_ready_socket()
            remove_runtime_dir(self.runtime_dir)
            raise
        if wait:
            self.wait_ready()

    def wait_ready(self) -> str:
        """Block until the core reports ready; its address (EngineStartError / EngineRefused if not)."""
        try:
            ready = self._wait_ready(self._pull, self.ready_timeout)
        except BaseException:
            self.stop(grace=0)
            raise
        finally:
            self._close_ready_socket()
        if ready.error:
            self.stop(grace=0)
            raise EngineRefused(ready.error) if ready.user_error else EngineStartError(ready.error)
        self.address = ready.address
        return self.address

    def _close_ready_socket(self) -> None:
        if not self._pull.closed:
            self._pull.close()
            self._ctx.term()

    def _wait_ready(self, pull: zmq.Socket, timeout: float) -> CoreReady:
        codec = Codec((CoreReady,))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pull.poll(200):
                return codec.decode(pull.recv_multipart())
            if self.proc.poll() is not None:
                raise EngineStartError(
                    f"the core process exited with code {self.proc.returncode} before it was ready"
                )
        raise EngineStartError(f"the core process was not ready after {timeout:.0f}s")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM, wait up to `grace` (+ a few seconds), then SIGKILL; returns the exit code."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(grace + 10.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10.0)
        remove_runtime_dir(self.runtime_dir)
        return self.proc.returncode

    def __enter__(self) -> CoreProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class CoreGroup:
    """The engine cores of one launch: one per data-parallel rank, started together (each loads its
    model while the others do), each with its own workers and runtime directory."""

    def __init__(self, config: EngineConfig, listen: Sequence[str | None] = (), **kw: Any) -> None:
        """`listen`: each rank's address for clients (default: private ipc paths); `kw` as `CoreProcess`."""
        size = config.parallel.data_parallel_size
        listen = list(listen) or [None] * size
        assert len(listen) == size, "one listen address per data-parallel rank"
        self.cores: list[CoreProcess] = []
        try:
            for rank in range(size):
                cfg = dataclasses.replace(
                    config, parallel=dataclasses.replace(config.parallel, data_parallel_rank=rank)
                )
                self.cores.append(CoreProcess(cfg, listen=listen[rank], wait=False, **kw))
            for core in self.cores:
                core.wait_ready()
        except BaseException:
            self.stop(grace=0)
            raise

    @property
    def addresses(self) -> list[str]:
        return [core.address for core in self.cores]

    def stop(self, grace: float = 30.0) -> None:
        for core in self.cores:  # SIGTERM to all first, so they drain at the same time
            if core.alive():
                core.proc.send_signal(signal.SIGTERM)
        for core in self.cores:
            core.stop(grace)

    def __enter__(self) -> CoreGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def dp_listen_addresses(listen: str | None, size: int) -> list[str | None]:
    """Each data-parallel rank's address from `ember core --listen`: a comma-separated list of `size`
    addresses, or one tcp://HOST:PORT (rank r listens on PORT + r); None: private ipc paths."""
    if listen is None:
        return [None] * size
    given = [a.strip() for a in listen.split(",") if a.strip()]
    if len(given) == size:
        return list(given)
    host, sep, port = given[0].rpartition(":")
    if len(given) == 1 and given[0].startswith("tcp://") and sep and port.isdigit() and int(port) > 0:
        return [f"{host}:{int(port) + r}" for r in range(size)]
    raise EmberError(
        f"--listen needs {size} comma-separated addresses for --data-parallel-size {size}, "
        "or one tcp://HOST:PORT (rank r listens on PORT + r)"
    )


def run_core_group(config: EngineConfig, listen: str | None, **kw: Any) -> int:
    """`ember core --data-parallel-size D`: run D cores, print their addresses (give them all to
    `EngineClient([...])`), and serve until SIGTERM / SIGINT. A core that dies is reported; the
    others keep serving."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with CoreGroup(config, dp_listen_addresses(listen, config.parallel.data_parallel_size), **kw) as group:
        for rank, address in enumerate(group.addresses):
            print(f"ember core: data-parallel rank {rank} listening on {address}", flush=True)
        reported: set[int] = set()
        while not stop.wait(0.5):
            for rank, core in enumerate(group.cores):
                if not core.alive() and rank not in reported:
                    reported.add(rank)
                    print(f"ember core: data-parallel rank {rank} exited with code {core.proc.returncode}")
            if len(reported) == len(group.cores):
                return 1
    return 0
