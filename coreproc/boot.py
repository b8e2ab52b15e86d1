"""Start-up without garbage collection: Ember's processes and the `LLM` API pause it while they start.

Importing torch and building an engine allocate a few hundred thousand long-lived objects, and each
full collection meanwhile walks all of them (~0.1 s each here, three during `import torch` alone).
So start-up runs with the collector off; once the engine is up, `settle()` freezes everything alive
(later collections skip those objects, which also keeps serving steps free of long pauses) and turns
collection back on. `python -m coreproc.boot core|worker ARGS` starts the core or a worker process
with the collector off from its first import; `paused()` turns it off around a block of code (the
in-process `LLM` only pauses: a library user may build and drop several engines in one process).
"""

from __future__ import annotations

import atexit
import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def settle() -> None:
    """Freeze the start-up heap into the permanent generation and resume collection. Only where what
    was built lives as long as the process: frozen objects in reference cycles (a module tree has
    them) are never collected, even once unreachable."""
    gc.freeze()
    # thawed at exit, so that the final collection still finalizes what was frozen (extension types
    # otherwise report their instances as leaked)
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
    gc.enable()


@contextmanager
def paused() -> Iterator[None]:
    """Run a block with the collector off, then restore the collector's state (nothing is frozen)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def main(argv: list[str] | None = None) -> int:
    """`python -m coreproc.boot core ARGS` (coreproc.core_proc) or `worker ARGS` (workers.worker_proc)."""
    argv = sys.argv[1:] if argv is None else argv
    gc.disable()  # the role's process calls settle() once its engine or model is up
    role, rest = (argv[0], argv[1:]) if argv else ("", [])
    if role == "core":
        from coreproc.core_proc import main as core_main

        return core_main(rest)
    if role == "worker":
        from workers.worker_proc import main as worker_main

        worker_main(rest)
        return 0
    gc.enable()
    print("usage: python -m coreproc.boot core|worker ARGS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
