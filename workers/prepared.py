"""A worker prepared ahead of the next warm restart (`ember-prepared`): what it prepares.

Runs in a child of the preload zygote, which decides when and hands it a request
(coreproc/startup/prepared.py). `prepare` does for an earlier request what the engine's config alone
decides: the weights mapped from the preload daemon, the model built around them, the kernels picked,
and every page of the mapped weights faulted in (a gigabyte of fresh mapping costs a new process's
first step about a tenth of a second). When a request with the same key comes, `stale` checks that
the checkpoint's files and the daemon it mapped are the ones it prepared from, and `main` runs as the
request's worker (workers/worker_proc.py) with the prepared model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from coreproc.base import trace
from coreproc.base.config import EngineConfig
from coreproc.base.protocol import SpawnWorker
from workers.weight_cache.arena import fault_in
from workers.weight_cache.client import cache_socket, daemon_pid
from workers.worker import Prepared, Worker
from workers.worker_proc import new_worker, parse_args, run_worker, worker_title

FileStamps = dict[str, tuple[int, int, int]]


def checkpoint_stamps(model: str) -> FileStamps:
    """(inode, size, modification time) of the checkpoint's files: a GGUF file, or a folder's files."""
    path = Path(model)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return {str(p): (s.st_ino, s.st_size, s.st_mtime_ns) for p in files for s in [p.stat()]}


@dataclass
class PreparedWorker:
    """A worker prepared for a request (`prepare`), and what its weights were mapped from."""

    config: EngineConfig
    worker: Worker
    ready: Prepared
    stamps: FileStamps  # the checkpoint's files before the weights were mapped
    daemon: int  # the preload daemon's pid

    def stale(self) -> str:
        """Why the prepared weights may no longer be the checkpoint's, or ""."""
        model = self.config.model.model
        try:
            if checkpoint_stamps(model) != self.stamps:
                return f"{model} changed since the worker was prepared"
        except OSError as e:
            return f"{model}: {e}"
        if daemon_pid(cache_socket(self.config, torch.device("cpu"), 0)) != self.daemon:
            return "the preload daemon the worker mapped is gone"
        return ""

    def main(self, argv: list[str], taken: float) -> None:
        """Run as the worker that `argv` asks for (the request's environment is ours by now)."""
        args = parse_args(argv)
        title = worker_title(self.config, args.rank)
        trace.record("take the prepared worker", taken, process=title)  # into the request's trace
        prepared = (self.worker, self.ready)
        run_worker(self.config, args.rank, args.endpoint, args.runtime_dir, args.parent_pid, prepared)


def prepare(req: SpawnWorker) -> PreparedWorker:
    """The worker `req` asks for, prepared as far as its config decides (see the module's doc)."""
    args = parse_args(req.argv)
    config = msgspec.json.decode(req.config, type=EngineConfig)
    stamps = checkpoint_stamps(config.model.model)
    path = cache_socket(config, torch.device("cpu"), 0)
    daemon = daemon_pid(path)
    worker = new_worker(config, args.rank, args.runtime_dir)
    ready = worker.prepare(show_progress=False, cache_only=True)  # never a private copy from disk
    fault_in(ready.weights.model)
    if daemon == 0 or daemon_pid(path) != daemon:
        raise RuntimeError(f"the preload daemon at {path} changed while the worker was prepared")
    return PreparedWorker(config, worker, ready, stamps, daemon)
