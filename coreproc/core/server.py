"""The scheduler process (`ember-core`): serves clients over ZeroMQ and drives the workers.

Clients (the SDK, the HTTP frontend) connect DEALER sockets to this process's ROUTER and send
`SubmitRequests` / `AbortRequests` / `UtilityCall`; each gets `OutputBatch`es for its own requests
(the first output of an admitted request is an empty acknowledgement, or for a constrained request
its first token; the requests of a refused submission, or a constraint the workers cannot compile,
each get one finished output with an `error_code`), `UtilityResult`s (an unknown utility
method gets an error, never silence), and `EngineDead` if the engine fails. One loop does it all,
each turn: wait (while a step is in flight, on the workers and the clients together; when idle, on
the clients), drain client messages, advance the engine without blocking, route outputs. A dead worker
fails every request at once and ends the process non-zero; SIGTERM/SIGINT stop admission, let running
requests finish within a grace period, abort the rest, and exit 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from coreproc.base import boot, standby, trace
from coreproc.base.config import EngineConfig
from coreproc.base.errors import EmberError, InvalidParam, QueueFull
from coreproc.base.host import engine_version
from coreproc.base.ipc import (
    Codec,
    CurveServer,
    bind,
    check_private_dir,
    is_loopback_endpoint,
    remove_runtime_dir,
)
from coreproc.base.orphan import LauncherWatch, exited, watch_pid
from coreproc.base.protocol import (
    KIND_OF,
    TO_CORE,
    UTILITY_METHODS,
    AbortRequests,
    CoreReady,
    EngineDead,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    OutputBatch,
    RefusalCode,
    SchedulerStats,
    SubmitRequests,
    UtilityCall,
    UtilityMethod,
    UtilityResult,
)
from coreproc.core.engine import EngineCore
from coreproc.core.executor import MultiprocExecutor, WorkerError, make_executor
from coreproc.core.mm_store import MultiModalCacheMiss
from coreproc.core.ray_executor import RayExecutor

log = logging.getLogger("ember.core")

IDLE_POLL_MS = 200
STEP_POLL_MS = 100  # the longest wait on a step in flight between two looks at the watchdog
REAP_INTERVAL_S = 0.5


class CoreServer:
    """One engine behind a ROUTER socket. Build it, then `serve()` until stopped."""

    def __init__(
        self,
        config: EngineConfig,
        listen: str,
        runtime_dir: Path,
        curve_keys: Path | None = None,
        shutdown_timeout: float = 30.0,
        parent_pid: int | None = None,
        client_timeout: float = 10.0,
    ) -> None:
        if not is_loopback_endpoint(listen) and curve_keys is None:
            raise EmberError(
                f"{listen} is reachable from other hosts: give --curve-keys DIR (see `ember keygen`)"
            )
        check_private_dir(runtime_dir)  # the workers' socket goes there
        self.config = config
        self.shutdown_timeout = shutdown_timeout
        self.eos_ids = list(config.model.eos_token_ids)
        self._bind_and_start(config, listen, runtime_dir, curve_keys)
        self.owner: dict[str, bytes] = {}  # request id -> client identity
        self._admitted: list[EngineOutput] = []  # acknowledgements to send after this drain
        self.last_seen: dict[bytes, float] = {}  # client identity -> last message time
        self.client_timeout = client_timeout
        self._last_reap = time.monotonic()
        self.stopping_since: float | None = None
        self.parent_pid = parent_pid  # the launcher: if it disappears, nobody is left to serve
        self.parent_fd = watch_pid(parent_pid) if parent_pid is not None else None
        self.launcher_gone = False

    def _bind_and_start(
        self, config: EngineConfig, listen: str, runtime_dir: Path, curve_keys: Path | None
    ) -> None:
        """Bind the client socket, start the workers and wait for them, build the engine core."""
        self.ctx = zmq.Context()
        self.curve = CurveServer(self.ctx, curve_keys) if curve_keys is not None else None
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # no high-water mark: a ROUTER drops what it cannot queue, and a dropped output would leave a
        # stream hanging; the queue of a client that stops reading is bounded by `client_timeout`,
        # after which its requests are aborted
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, config.limits.max_submit_bytes + 2**20)  # + framing slack
        if self.curve is not None:
            self.curve.apply(self.sock)
        bind(self.sock, listen)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.codec = Codec(TO_CORE)
        executor = make_executor(config, runtime_dir)  # worker processes, or Ray actors
        assert isinstance(executor, (MultiprocExecutor, RayExecutor)), "the core's workers run elsewhere"
        overlapped = config.scheduler.async_scheduling  # (off whenever the engine speculates)
        self.engine = EngineCore(config, executor, overlapped=overlapped)

    def info(self) -> EngineInfo:
        cfg = self.config
        return EngineInfo(
            model=cfg.model.model,
            max_model_len=cfg.model.max_model_len,
            vocab_size=cfg.model.vocab_size,
            num_kv_blocks=self.engine.scheduler.kv.num_blocks,
            block_size=cfg.cache.block_size,
            tensor_parallel_size=cfg.parallel.tensor_parallel_size,
            version=engine_version(),
            eos_token_ids=self.eos_ids,
            quantization=cfg.model.quantization,
            weight_bytes_by_dtype=self.engine.executor.ready[0].weight_bytes_by_dtype,
            load_seconds=self.engine.executor.ready[0].load_seconds,
            quantize_seconds=self.engine.executor.ready[0].quantize_seconds,
            weight_source=self.engine.executor.ready[0].weight_source,
            limits=dataclasses.asdict(cfg.limits),
            image_token_id=cfg.model.image_token_id,
            mm_cache_bytes=cfg.cache.mm_cache_bytes,
            lora_enabled=cfg.lora.enable_lora,
            loras={name: a.path for name, a in self.engine.scheduler.loras.adapters.items()},
            pipeline_parallel_size=cfg.parallel.pipeline_parallel_size,
            data_parallel_rank=cfg.parallel.data_parallel_rank,
            data_parallel_size=cfg.parallel.data_parallel_size,
            dp_routing=cfg.parallel.dp_routing,
            max_num_seqs=cfg.scheduler.max_num_seqs,
        )

    def load_lora(self, lora_name: str, lora_path: str) -> dict[str, object]:
        """Check and register an adapter (a name again: its new weights, for new requests only); it
        serves the next request that names it. LoRAError / InvalidParam say what cannot be served."""
        adapter = self.engine.scheduler.loras.load(lora_name, lora_path)
        log.info("LoRA adapter %r loaded from %s (rank %d)", lora_name, adapter.path, adapter.rank)
        return {"lora_name": adapter.name, "lora_path": adapter.path, "rank": adapter.rank}

    def unload_lora(self, lora_name: str) -> dict[str, object]:
        """Refuse new requests for an adapter; those running with it finish with its weights."""
        self.engine.scheduler.loras.unload(lora_name)
        log.info("LoRA adapter %r unloaded", lora_name)
        return {"lora_name": lora_name}

    # ------------------------------------------------------------------ client messages

    def _send(self, identity: bytes, msg: object) -> None:
        try:
            self.sock.send_multipart([identity, *self.codec.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # a client that went away cannot block the engine
            log.warning("dropping a message to a client: %s", e)

    def _route(self, outputs: list[EngineOutput]) -> None:
        by_client: dict[bytes, list[EngineOutput]] = defaultdict(list)
        for out in outputs:
            identity = self.owner.get(out.request_id)
            if identity is None:
                continue
            by_client[identity].append(out)
            if out.finished:
                del self.owner[out.request_id]
        now = time.time()
        for identity, batch in by_client.items():
            self._send(identity, OutputBatch(batch, now))

    def _handle(self, identity: bytes, msg: object) -> None:
        self.last_seen[identity] = time.monotonic()
        if isinstance(msg, SubmitRequests):
            self._add(identity, msg.requests)
        elif isinstance(msg, AbortRequests):
            mine = [r for r in msg.request_ids if self.owner.get(r) == identity]
            self._route(self.engine.abort_requests(mine))
        elif isinstance(msg, UtilityCall) and msg.call_id:  # call id 0: a heartbeat, no reply
            self._send(identity, self._utility(msg))

    def _reap_silent_clients(self) -> None:
        """Abort the requests of clients that stopped sending heartbeats (crashed or cut off)."""
        now = time.monotonic()
        if now - self._last_reap < REAP_INTERVAL_S:
            return
        self._last_reap = now
        silent = {c for c, seen in self.last_seen.items() if now - seen > self.client_timeout}
        if not silent:
            return
        orphans = [rid for rid, c in self.owner.items() if c in silent]
        if orphans:
            log.warning("aborting %d requests of %d silent clients", len(orphans), len(silent))
            self._route(self.engine.abort_requests(orphans))
        for c in silent:
            del self.last_seen[c]

    def _add(self, identity: bytes, reqs: list[EngineRequest]) -> None:
        """Admit the requests of one submission together, or refuse them all with one reason."""

        def reject(reason: str, code: RefusalCode, param: str | None = None) -> None:
            outs = [
                EngineOutput(
                    r.request_id, finish_reason="error", error=reason, error_code=code, error_param=param
                )
                for r in reqs
            ]
            self._send(identity, OutputBatch(outs))

        if self.stopping_since is not None:
            return reject("the engine is shutting down", "unavailable")
        taken = next((r.request_id for r in reqs if r.request_id in self.owner), None)
        if taken is not None:
            return reject(f"request id {taken!r} is already in use", "invalid_request", "request_id")
        for req in reqs:
            if not req.eos_token_ids:
                req.eos_token_ids = self.eos_ids
        try:
            self.engine.add_requests(reqs)
        except MultiModalCacheMiss as e:
            return reject(str(e), "mm_cache_miss", e.param)
        except InvalidParam as e:
            return reject(str(e), "invalid_request", e.param)
        except QueueFull as e:
            return reject(str(e), "overloaded")
        for req in reqs:
            self.owner[req.request_id] = identity
            # a constrained request is acknowledged by its first token: its grammar may still fail to
            # compile in the workers, and that refusal must reach the client before a 200 does
            if req.sampling_params.structured is None:
                self._admitted.append(EngineOutput(req.request_id))

    def stats(self) -> SchedulerStats:
        """The engine's stats and how many requests this process still maps to a client."""
        stats = self.engine.stats()
        stats.num_client_requests = len(self.owner)
        return stats

    def _utility(self, call: UtilityCall) -> UtilityResult:
        """Answer one `UtilityMethod`; anything else is refused with the list of methods. A failure is
        the error text: an `EmberError`'s own message (a user can fix it), else with its type."""
        args = call.args
        answers: dict[UtilityMethod, Callable[[], object]] = {
            "info": self.info,
            "stats": self.stats,
            "reset_prefix_cache": self.engine.reset_prefix_cache,
            "ping": lambda: True,  # a liveness probe that asked for an answer
            "load_lora": lambda: self.load_lora(_text_arg(args, "lora_name"), _text_arg(args, "lora_path")),
            "unload_lora": lambda: self.unload_lora(_text_arg(args, "lora_name")),
        }
        answer = answers.get(call.method)
        if answer is None:
            return UtilityResult(call.call_id, error=_unknown_method(call.method))
        try:
            return UtilityResult(call.call_id, answer())
        except Exception as e:  # a bad utility call must not take the engine down
            error = str(e) if isinstance(e, EmberError) else f"{type(e).__name__}: {e}"
            return UtilityResult(call.call_id, error=error)

    def _refuse_undecodable(self, identity: bytes, frames: list[bytes], error: Exception) -> None:
        """Drop a malformed message, but answer a utility call the core cannot decode (an unknown
        method) so that its caller is not left waiting."""
        log.warning("ignoring a malformed client message: %s", error)
        if len(frames) != 2 or frames[0] != KIND_OF[UtilityCall]:
            return
        try:
            call_id, method = msgspec.msgpack.decode(frames[1])[:2]
        except Exception:
            return
        if isinstance(call_id, int) and call_id > 0:
            reason = (
                f"malformed utility call: {error}" if method in UTILITY_METHODS else _unknown_method(method)
            )
            self._send(identity, UtilityResult(call_id, error=reason))

    def _drain(self, timeout_ms: int) -> None:
        """Handle every waiting client message; wait up to `timeout_ms` for the first. Requests
        admitted meanwhile are acknowledged in one batch per client."""
        while self.sock.poll(timeout_ms):
            timeout_ms = 0
            identity, *frames = self.sock.recv_multipart()
            try:
                msg = self.codec.decode(frames)
            except Exception as e:
                self._refuse_undecodable(identity, frames, e)
                continue
            self._handle(identity, msg)
        if self._admitted:
            acks, self._admitted = self._admitted, []
            self._route(acks)

    # ------------------------------------------------------------------ main loop

    def request_stop(self, *_: object) -> None:
        if self.stopping_since is None:
            log.info("shutting down: no new requests; %d in flight", len(self.owner))
            self.stopping_since = time.monotonic()

    def serve(self) -> int:
        """Run until stopped (exit code 0) or until a worker fails (exit code 1)."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if self.engine.in_flight():  # wake for the step's end or for a client, whichever is first
                    self.engine.executor.poll(STEP_POLL_MS, wake=self.sock)
                self._drain(0 if busy else IDLE_POLL_MS)
                self._reap_silent_clients()
                if self.parent_pid is not None and exited(self.parent_fd):
                    log.error("the launching process is gone; stopping")
                    self.launcher_gone = True
                    self.shutdown_timeout = 0.0
                    self.request_stop()
                if self.stopping_since is not None:
                    if not self.engine.has_unfinished_requests():
                        return 0
                    if time.monotonic() - self.stopping_since > self.shutdown_timeout and self.owner:
                        log.warning("grace period over: aborting %d requests", len(self.owner))
                        self._route(self.engine.abort_requests(list(self.owner)))
                if self.engine.has_unfinished_requests():
                    self._watchdog()
                    self._route(self.engine.advance())
                else:
                    self.engine.executor.check_alive()
        except WorkerError as e:
            log.error("engine dead: %s", e)
            self._fail_everything(str(e))
            return 1
        finally:
            self.close()

    def _watchdog(self) -> None:
        """The stall check; with --stall-action fail a stall ends the engine like a dead worker."""
        reason = self.engine.check_stall()
        if reason is not None and self.config.scheduler.stall_action == "fail":
            raise WorkerError(f"stalled: {reason}")

    def _fail_everything(self, reason: str) -> None:
        """EngineDead to every client first (their SDKs fail all streams), then per-request errors."""
        for identity in self.last_seen:
            self._send(identity, EngineDead(reason))
        self._route(
            [EngineOutput(rid, finish_reason="error", error=f"engine dead: {reason}") for rid in self.owner]
        )

    def close(self) -> None:
        self.engine.shutdown()
        if self.curve is not None:
            self.curve.stop()
        self.sock.close(linger=1000)
        self.ctx.term()


def _text_arg(args: dict[str, object], name: str) -> str:
    value = args.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidParam(f"{name} must be a non-empty string", name)
    return value


def _unknown_method(method: object) -> str:
    return f"unknown utility method {method!r}; the core answers {', '.join(UTILITY_METHODS)}"


def run_core_process(
    config: EngineConfig,
    listen: str,
    runtime_dir: Path,
    ready_endpoint: str | None = None,
    curve_keys: Path | None = None,
    shutdown_timeout: float = 30.0,
    parent_pid: int | None = None,
    client_timeout: float = 10.0,
) -> int:
    """Become `ember-core`: build the engine, report readiness (or the error), serve until stopped."""
    from setproctitle import setproctitle

    dp = config.parallel
    setproctitle("ember-core" if dp.data_parallel_size == 1 else f"ember-core-dp{dp.data_parallel_rank}")
    trace.started()
    watch = None
    if parent_pid is not None:  # a launcher gone mid-load cannot remove its runtime directory
        watch = LauncherWatch(parent_pid, "ember-core", lambda: remove_runtime_dir(runtime_dir))
    report = None
    if ready_endpoint is not None:
        report_ctx = zmq.Context()
        report = report_ctx.socket(zmq.PUSH)
        report.setsockopt(zmq.LINGER, 2000)
        report.connect(ready_endpoint)
    codec = Codec(())
    try:
        with boot.paused(), trace.phase("build the engine"):  # collector already off when booted
            server = CoreServer(
                config, listen, runtime_dir, curve_keys, shutdown_timeout, parent_pid, client_timeout
            )
    except Exception as e:
        user = isinstance(e, EmberError)  # the caller says it in one line; anything else is logged here
        if report is None and user:
            raise  # `ember core`: the CLI prints it
        if not user:
            log.exception("engine failed to start")
        if report is not None:
            error = str(e) if user else f"{type(e).__name__}: {e}"
            report.send_multipart(codec.encode(CoreReady(error=error, user_error=user)))
            report.close()
        return 1
    standby.discard()  # a worker started early that this engine did not take
    boot.settle()
    if report is not None:
        report.send_multipart(codec.encode(CoreReady(address=server.address)))
        report.close()
    else:
        print(f"ember core: listening on {server.address}", flush=True)
    if watch is not None:
        watch.started()  # the serving loop watches the launcher from here
    code = server.serve()
    if server.launcher_gone:
        remove_runtime_dir(runtime_dir)  # its launcher would have; the workers have exited
    return code


def main(argv: list[str] | None = None, config_json: bytes | None = None) -> int:
    """`python -m coreproc.core.server`: started by a launcher, config as JSON on stdin (or given, when
    forked by the preload zygote)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m coreproc.core.server")
    parser.add_argument("--listen", required=True)
    parser.add_argument("--runtime-dir", required=True)
    parser.add_argument("--ready-endpoint", default=None)
    parser.add_argument("--curve-keys", default=None)
    parser.add_argument("--shutdown-timeout", type=float, default=30.0)
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--client-timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("EMBER_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s"
    )
    config = msgspec.json.decode(config_json or sys.stdin.buffer.read(), type=EngineConfig)
    keys = Path(args.curve_keys) if args.curve_keys else None
    return run_core_process(
        config,
        args.listen,
        Path(args.runtime_dir),
        args.ready_endpoint,
        keys,
        args.shutdown_timeout,
        args.parent_pid,
        args.client_timeout,
    )


if __name__ == "__main__":
    raise SystemExit(main())
