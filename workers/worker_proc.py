"""Entry point of a worker process (`ember-worker-N`): one device, one rank (pipeline stage x TP rank).

Started by the core's `MultiprocExecutor` as `python -m workers.worker_proc` with the engine config
as JSON on stdin (no pickle, no re-import of the caller's main module). It joins the engine's process group
(gloo on CPU, NCCL on CUDA; a file rendezvous in the launch's private runtime directory, MASTER_ADDR/
MASTER_PORT when set, or the head's --master-addr/--master-port across nodes), loads its shard of the
model, sends `WorkerReady`, then runs every `StepRequest` it receives and answers `StepResult` (the last
stage's TP rank 0 carries the sampled tokens; other ranks answer empty so the core knows they
finished). Pipeline stages pass
hidden states to each other directly (workers/parallel.py `PPGroup`), not through the core. Any error
is reported as `WorkerFailed`. It exits on `Shutdown`, or on its own when the core process disappears
(a rank of another node, started by `ember worker --headless`: when its link to the head drops, see
workers/head_link.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
import traceback
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import zmq

from coreproc.base import boot, trace
from coreproc.base.config import EngineConfig
from coreproc.base.errors import EmberError
from coreproc.base.ipc import Codec
from coreproc.base.orphan import LauncherWatch
from coreproc.base.protocol import TO_WORKER, RunnerOutput, Shutdown, StepRequest, StepResult, WorkerFailed
from workers.head_link import connect_head, interface_towards, is_remote
from workers.parallel import PPGroup, TPGroup, device_index

if TYPE_CHECKING:  # the worker's modules import torch: loaded inside `new_worker`, timed
    from workers.worker import Prepared, Worker

log = logging.getLogger("ember.worker")

PARENT_CHECK_MS = 500
NODES_TIMEOUT_S = 300  # across nodes: the rendezvous, and any collective a lost peer never joins


def rendezvous(config: EngineConfig, runtime_dir: Path) -> str:
    """Where the ranks of one engine meet: the head's master address and port across nodes, env:// when
    MASTER_ADDR is set, else a file in the launch's private runtime directory (one host)."""
    par = config.parallel
    if par.nnodes > 1:
        host = f"[{par.master_addr}]" if ":" in (par.master_addr or "") else par.master_addr
        return f"tcp://{host}:{par.master_port}"
    if os.environ.get("MASTER_ADDR"):
        return "env://"
    return f"file://{runtime_dir / 'tp-rendezvous'}"


def worker_threads(config: EngineConfig) -> int:
    """Torch threads of one CPU worker: the host's cores (this process's affinity) shared by every
    worker on the host, of every data-parallel engine: oversubscribed OpenMP threads spin and stall
    each other."""
    cores = len(os.sched_getaffinity(0))
    return max(1, cores // config.parallel.workers_per_host)


def init_distributed(config: EngineConfig, rank: int, init_method: str) -> tuple[TPGroup, PPGroup]:
    """Join the engine's process group at `init_method` (a torch.distributed init URL) as global rank
    `rank` = stage * tensor_parallel_size + tp_rank, and return this rank's tensor-parallel group and
    pipeline stage; no-op groups for a single worker. Every rank makes every stage's tensor-parallel
    subgroup, in stage order, as torch.distributed requires."""
    par = config.parallel
    tp_size, world = par.tensor_parallel_size, par.world_size
    stage, tp_rank = divmod(rank, tp_size)
    start, end = par.stage_layers(config.model.num_layers)[stage]
    pp = PPGroup(stage, par.pipeline_parallel_size, start, end, rank - tp_size, rank + tp_size)
    if world == 1:
        return TPGroup(), pp
    import torch
    import torch.distributed as dist

    backend = "nccl" if config.device.resolved_type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device_index(config, rank))
    if par.nnodes == 1:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    else:  # gloo must use the interface that reaches the head, not the one the host name resolves to
        ifname = interface_towards(par.master_addr or "")
        if backend == "gloo" and ifname and not os.environ.get("GLOO_SOCKET_IFNAME"):
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
        timeout = timedelta(seconds=NODES_TIMEOUT_S)
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout
        )
    if par.pipeline_parallel_size == 1:
        return TPGroup(rank=tp_rank, size=tp_size, group=dist.group.WORLD), pp
    groups = [
        dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(par.pipeline_parallel_size)
    ]
    tp = TPGroup(rank=tp_rank, size=tp_size, group=groups[stage]) if tp_size > 1 else TPGroup()
    return tp, pp


def init_tensor_parallel(config: EngineConfig, rank: int, init_method: str) -> TPGroup:
    """Join the process group at `init_method` and return the tensor-parallel group (`init_distributed`
    without the pipeline stage: for a single stage)."""
    return init_distributed(config, rank, init_method)[0]


def worker_title(config: EngineConfig, rank: int) -> str:
    dp = config.parallel
    if dp.data_parallel_size == 1:
        return f"ember-worker-{rank}"
    return f"ember-worker-dp{dp.data_parallel_rank}-{rank}"


def new_worker(config: EngineConfig, rank: int, runtime_dir: str) -> Worker:
    """This rank's `Worker`, in the engine's process group, its weights not loaded yet."""
    with trace.phase("import torch and the model code"):
        from workers.worker import Worker

        if config.device.resolved_type == "cpu":
            import torch

            # ranks share the host's cores; oversubscribed OpenMP threads spin and stall each other
            torch.set_num_threads(worker_threads(config))
    with trace.phase("join the process group"):
        tp, pp = init_distributed(config, rank, rendezvous(config, Path(runtime_dir)))
    cfg = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, rank=rank))
    return Worker(cfg, tp, pp)


def run_worker(
    config: EngineConfig,
    rank: int,
    endpoint: str,
    runtime_dir: str,
    parent_pid: int,
    prepared: tuple[Worker, Prepared] | None = None,
) -> None:
    """Process main: never returns normally; exits 0 on shutdown, 1 on failure. `prepared`: this
    process prepared the worker before its engine asked for it (workers/prepared.py)."""
    from setproctitle import setproctitle

    setproctitle(worker_title(config, rank))
    if prepared is None:
        trace.started()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the core decides when workers stop
    logging.basicConfig(
        level=os.environ.get("EMBER_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s"
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"w{rank}".encode())
    sock.setsockopt(zmq.LINGER, 2000)
    stopping = threading.Event()  # set before a deliberate exit: the head watchdog stands down
    if is_remote(config, rank):
        connect_head(sock, config, rank, stopping)
    else:
        sock.connect(endpoint)
    codec = Codec(TO_WORKER)
    # watch the core by pidfd: a worker forked by the zygote is not the core's child
    core = os.pidfd_open(parent_pid)
    watch = LauncherWatch(parent_pid, f"rank {rank}")  # loading runs no loop that watches the core
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(core, zmq.POLLIN)
    code = 0
    try:
        worker, ready = prepared if prepared is not None else (new_worker(config, rank, runtime_dir), None)
        sock.send_multipart(codec.encode(worker.load(rank == 0 and sys.stderr.isatty(), ready)))
        boot.settle()  # started by coreproc.base.boot with the collector off
        watch.started()
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
            answer = output if worker.returns_tokens else empty
            sock.send_multipart(codec.encode(StepResult(msg.step_id, rank, answer)))
    except Exception as e:  # report, then die: the core fails its requests loudly
        user = isinstance(e, EmberError)  # the core reports it in the user's words, once
        if not user:
            log.error("rank %d failed:\n%s", rank, traceback.format_exc())
        sock.send_multipart(
            codec.encode(WorkerFailed(rank, str(e) if user else f"{type(e).__name__}: {e}", user))
        )
        code = 1
    finally:
        stopping.set()
        sock.close()
        ctx.term()
    os._exit(code)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """A worker's command line: its rank, the core's endpoint, the launch's runtime directory, the
    core's pid."""
    parser = argparse.ArgumentParser(prog="python -m workers.worker_proc")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--runtime-dir", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, config_json: bytes | None = None) -> None:
    """Entry point of `python -m workers.worker_proc` (config on stdin) and of zygote-forked workers."""
    args = parse_args(argv)
    config = msgspec.json.decode(config_json or sys.stdin.buffer.read(), type=EngineConfig)
    run_worker(config, args.rank, args.endpoint, args.runtime_dir, args.parent_pid)


if __name__ == "__main__":
    main()
