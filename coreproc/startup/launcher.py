"""Starts an `ember-core` process (which starts its workers) and waits for its typed READY.

Runs in the process that needs an engine behind a socket: the HTTP frontend, tests, benchmarks.
It creates the launch's private runtime directory (0700), starts `python -m coreproc.startup.boot core`
(coreproc.core_proc, collector paused while it starts) with the config as JSON on stdin, and waits
for `CoreReady` on a one-shot socket, with a timeout, watching the child. `stop()` sends SIGTERM
(graceful), then kills what is left and removes the directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import zmq

from coreproc.config import EngineConfig
from coreproc.errors import EmberError
from coreproc.ipc import Codec, ipc_endpoint, make_runtime_dir, remove_runtime_dir
from coreproc.protocol import CoreReady


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
    ) -> None:
        self.runtime_dir = make_runtime_dir()
        listen = listen or ipc_endpoint(self.runtime_dir, "core")
        ready_endpoint = ipc_endpoint(self.runtime_dir, "launcher")
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(ready_endpoint)
        cmd = [sys.executable, "-m", "coreproc.startup.boot", "core", "--listen", listen]
        cmd += ["--runtime-dir", str(self.runtime_dir), "--ready-endpoint", ready_endpoint]
        cmd += ["--shutdown-timeout", str(shutdown_timeout), "--parent-pid", str(os.getpid())]
        cmd += ["--client-timeout", str(client_timeout)]
        if curve_keys is not None:
            cmd += ["--curve-keys", str(curve_keys)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, start_new_session=False)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(msgspec.json.encode(config))
            self.proc.stdin.close()
            ready = self._wait_ready(pull, ready_timeout)
        except BaseException:
            self.stop(grace=0)
            raise
        finally:
            pull.close()
            ctx.term()
        if ready.error:
            self.stop(grace=0)
            raise EngineRefused(ready.error) if ready.user_error else EngineStartError(ready.error)
        self.address = ready.address

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
