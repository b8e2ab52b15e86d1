"""What a process forked by the zygote does first: become the process its requester asked for.

Runs in a child of the zygote (coreproc/startup/zygote.py), and in a prepared worker when a request
takes it (coreproc/startup/prepared.py). `child` takes the requester's standard streams, signals'
defaults, environment and CPUs, runs the role's main (the `ember serve` frontend, an engine core or a
worker), and reports the exit status on the request's connection (`ServeExit`) before the process ends.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import NoReturn

from coreproc.base.channel import send_msg
from coreproc.base.protocol import ServeExit, SpawnServe, SpawnWorker
from coreproc.startup.spawn import ENV_PREFIXES

log = logging.getLogger("ember.zygote")

# named, not imported: the frontend sits above this layer (its entry points are looked up by name)
SERVE_ENTRY = ("frontend.launch", "forked")
ROLE_MAINS = {"worker": "workers.worker_proc", "core": "coreproc.core.server"}


Spawn = SpawnWorker | SpawnServe
RoleMain = Callable[[list[str], bytes], object]  # (argv, config JSON) -> exit status (None: 0)


def take_environment(env: dict[str, str], whole: bool) -> None:
    """The requester's environment: all of it (`whole`), or its Ember/OpenMP/torch entries (those of
    ours it lacks removed)."""
    for key in list(os.environ):
        if whole or (key.startswith(ENV_PREFIXES) and key not in env):
            del os.environ[key]
    os.environ.update(env)


def run_on(cpus: list[int]) -> None:
    """Run on the requester's CPUs (taskset), where the zygote's cgroup allows them (none: as is)."""
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:
            log.warning("cannot run on the requester's CPUs %s: %s", cpus, e)


def child(
    req: Spawn, fds: list[int], conn: socket.socket, closing: list[int], main: RoleMain | None = None
) -> NoReturn:
    """Runs in the forked process: become the requested process; never returns (whatever happens, the
    exit status goes to the requester and the process ends here, never back in the zygote's loop).
    `main`: a worker's, instead of its role's module (a prepared worker's)."""
    code = 1
    try:
        code = become(req, fds, conn, closing, main)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # what a fresh interpreter would print before exiting 1
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        try:
            send_msg(conn, ServeExit(code=code), wire="json")
        except OSError:
            pass
        os._exit(code)


def become(
    req: Spawn, fds: list[int], conn: socket.socket, closing: list[int], main: RoleMain | None = None
) -> int:
    """Take the requester's streams, signals' defaults, environment and CPUs, then run the process's
    main; its exit status."""
    for fd in closing:  # the listener and the zygote's lock: a child must not hold them
        os.close(fd)
    targets = (0, 1, 2) if isinstance(req, SpawnServe) else (1, 2)
    for stream in (sys.stdout, sys.stderr):  # nothing of the zygote's reaches the requester's streams
        stream.flush()
    for target, fd in zip(targets, fds):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    sys.stdout.reconfigure(line_buffering=os.isatty(1))  # type: ignore[union-attr]
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    take_environment(req.env, whole=isinstance(req, SpawnServe))
    run_on(req.affinity)
    if isinstance(req, SpawnServe):
        os.chdir(req.cwd)
        module, name = SERVE_ENTRY
        status = getattr(importlib.import_module(module), name)(req.argv, conn)
    else:
        sys.stdin = open(os.devnull)
        run = main or importlib.import_module(ROLE_MAINS[req.role]).main
        status = run(req.argv, req.config)
    return status if isinstance(status, int) else 0
