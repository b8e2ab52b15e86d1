"""Entry point of a worker process (`ember-worker-N`): one device, one tensor-parallel rank.

Started by the core's `MultiprocExecutor` as `python -m workers.worker_proc` with the engine config
as JSON on stdin (no pickle, no re-import of the caller's main module). It joins the tensor-parallel group
(gloo on CPU, NCCL on CUDA; a file rendezvous in the launch's private runtime directory, or
MASTER_ADDR/MASTER_PORT when set for multi-host), loads its shard of the model, sends `WorkerReady`,
then runs every `StepRequest` it receives and answers `StepResult` (rank 0 carries the sampled tokens;
other ranks answer empty so the core knows they finished). Any error is reported as `WorkerFailed`.
It exits on `Shutdown`, or on its own when the core process disappears.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import traceback
from pathlib import Path

import msgspec
import zmq

from coreproc.config import EngineConfig
from coreproc.errors import EmberError
from coreproc.ipc import Codec
from coreproc.protocol import TO_WORKER, RunnerOutput, Shutdown, StepRequest, StepResult, WorkerFailed
from coreproc.startup import boot
from workers.parallel import TPGroup

log = logging.getLogger("ember.worker")

PARENT_CHECK_MS = 500


def rendezvous(config: EngineConfig, runtime_dir: Path) -> str:
    """Where the ranks of one engine meet: env:// when MASTER_ADDR is set, else a file in the launch's
    private runtime directory (one host)."""
    if os.environ.get("MASTER_ADDR"):
        return "env://"
    return f"file://{runtime_dir / 'tp-rendezvous'}"


def init_tensor_parallel(config: EngineConfig, rank: int, init_method: str) -> TPGroup:
    """Join the TP process group at `init_method` (a torch.distributed init URL); a no-op group for a
    single rank."""
    size = config.parallel.tensor_parallel_size
    if size == 1:
        return TPGroup()
    import torch
    import torch.distributed as dist

    backend = "nccl" if config.device.resolved_type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    return TPGroup(rank=rank, size=size, group=dist.group.WORLD)


def run_worker(config: EngineConfig, rank: int, endpoint: str, runtime_dir: str, parent_pid: int) -> None:
    """Process main: never returns normally; exits 0 on shutdown, 1 on failure."""
    from setproctitle import setproctitle

    setproctitle(f"ember-worker-{rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the core decides when workers stop
    logging.basicConfig(
        level=os.environ.get("EMBER_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s"
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"w{rank}".encode())
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(endpoint)
    codec = Codec(TO_WORKER)
    # watch the core by pidfd: a worker forked by the zygote is not the core's child
    core = os.pidfd_open(parent_pid)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(core, zmq.POLLIN)
    code = 0
    try:
        from workers.worker import Worker

        if config.device.resolved_type == "cpu":
            import torch

            # ranks share the host's cores; oversubscribed OpenMP threads spin and stall each other
            cores = len(os.sched_getaffinity(0))
            torch.set_num_threads(max(1, cores // config.parallel.tensor_parallel_size))
        tp = init_tensor_parallel(config, rank, rendezvous(config, Path(runtime_dir)))
        cfg = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, rank=rank))
        worker = Worker(cfg, tp)
        sock.send_multipart(codec.encode(worker.load(show_progress=rank == 0 and sys.stderr.isatty())))
        boot.settle()  # started by coreproc.startup.boot with the collector off
        empty = RunnerOutput()
        while True:
            events = dict(poller.poll(PARENT_CHECK_MS))
            if core in events:
                log.warning("rank %d: the core process is gone; exiting", rank)
                break
            if sock not in events:
                continue
            msg = codec.decode(sock.recv_multipart())
            if isinstance(msg, Shutdown):
                break
            assert isinstance(msg, StepRequest)
            output = worker.execute_model(msg.scheduler_output)
            sock.send_multipart(codec.encode(StepResult(msg.step_id, rank, output if rank == 0 else empty)))
    except Exception as e:  # report, then die: the core fails its requests loudly
        user = isinstance(e, EmberError)  # the core reports it in the user's words, once
        if not user:
            log.error("rank %d failed:\n%s", rank, traceback.format_exc())
        sock.send_multipart(
            codec.encode(WorkerFailed(rank, str(e) if user else f"{type(e).__name__}: {e}", user))
        )
        code = 1
    finally:
        sock.close()
        ctx.term()
    os._exit(code)


def main(argv: list[str] | None = None, config_json: bytes | None = None) -> None:
    """Entry point of `python -m workers.worker_proc` (config on stdin) and of zygote-forked workers."""
    parser = argparse.ArgumentParser(prog="python -m workers.worker_proc")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--runtime-dir", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    config = msgspec.json.decode(config_json or sys.stdin.buffer.read(), type=EngineConfig)
    run_worker(config, args.rank, args.endpoint, args.runtime_dir, args.parent_pid)


if __name__ == "__main__":
    main()
