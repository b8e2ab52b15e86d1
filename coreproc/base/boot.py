"""Start-up without garbage collection: Ember's processes and the `LLM` API pause it while they start.

Importing torch and building an engine allocate a few hundred thousand long-lived objects, and each
full collection meanwhile walks all of them (~0.1 s each here, three during `import torch` alone).
So start-up runs with the collector off; once the engine is up, `settle()` freezes everything alive
(later collections skip those objects, which also keeps serving steps free of long pauses) and turns
collection back on. `python -m coreproc.base.boot core|worker ARGS` starts the core or a worker process
with the collector off from its first import; `paused()` turns it off around a block of code (the
in-process `LLM` only pauses: a library user may build and drop several engines in one process).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import os
import signal
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


ROLES = {
    "core": "coreproc.core.server",
    "worker": "workers.worker_proc",
}  # named, not imported: boot sits below both


def main(argv: list[str] | None = None) -> int:
    """`python -m coreproc.base.boot core|worker ARGS`: the role's `main(ARGS)`, collector off.
    `ARGS` = `--standby`: import the role's modules, then wait for the command line and config
    (coreproc.base.standby); a core on standby starts its first worker on standby first."""
    argv = sys.argv[1:] if argv is None else argv
    role, rest = (argv[0], argv[1:]) if argv else ("", [])
    if role not in ROLES:
        print("usage: python -m coreproc.base.boot core|worker ARGS", file=sys.stderr)
        return 2
    gc.disable()  # the role's process calls settle() once its engine or model is up
    if rest != ["--standby"]:
        status = importlib.import_module(ROLES[role]).main(rest)
        return status if isinstance(status, int) else 0
    from setproctitle import setproctitle

    from coreproc.base import standby, trace

    setproctitle(f"ember-standby-{role}")  # also before the environment is replaced, which it needs
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C while it waits is its launcher's to handle
    if role == "core":
        from coreproc.base.host import worker_openmp_env

        standby.start("worker", env=worker_openmp_env(dict(os.environ)))
    module = importlib.import_module(ROLES[role])
    trace.started("interpreter and imports, on standby", process=f"ember-{role} (standby)")
    rest, config_json = standby.wait_for_role()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    status = module.main(rest, config_json=config_json)
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    raise SystemExit(main())
