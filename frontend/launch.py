"""The `ember` command's first module: `ember serve` on a preloaded host starts as a fork of the zygote.

Runs in the user's shell process, importing little. With `--load-format ipc_cache` and an `ember
preload` zygote listening (its socket directory: --socket-dir or the default), `ember serve` does not
import its HTTP stack and tokenizer itself: it asks the zygote, which has them imported and the
preloaded model's tokenizer built, to fork the server with this command line, environment, working
directory and standard streams (`SpawnServe`), then stands in for it: SIGINT, SIGTERM, SIGHUP and
SIGQUIT are passed on, and its exit status is the server's. A server whose launcher is gone (killed)
stops as on SIGTERM. The server is then a child of the zygote: it runs on this process's CPUs, but
its resource limits and cgroup are the preload's. `--no-serve-zygote` (or no zygote, or one running
another Python, Ember install or code) starts the server in this process as before; so do `python -m
frontend.cli serve`, parked snapshots and the extra API servers. Otherwise `ember serve` starts its
core on standby before anything else (coreproc.base.standby), so that the core's imports overlap
this process's.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from frontend.argv import command_of, flag_value

RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
SERVE_WITHOUT_ZYGOTE = ("--no-serve-zygote", "--snapshot-park", "--api-server-child", "-h", "--help")


def zygote_for(argv: list[str]) -> Path | None:
    """The zygote socket to fork `ember ARGV` from, or None to run it here."""
    if command_of(argv) != "serve" or flag_value(argv, "--load-format") != "ipc_cache":
        return None
    if any(arg.split("=", 1)[0] in SERVE_WITHOUT_ZYGOTE for arg in argv):
        return None
    from coreproc.startup.zygote_link import zygote_at

    return zygote_at(flag_value(argv, "--socket-dir"))


def serve_from(zygote: Path, argv: list[str]) -> int | None:
    """Have the zygote fork `ember serve ARGV` and stand in for it until it exits (its exit status);
    None when the zygote cannot (the reason logged), so that the caller serves itself."""
    import json

    from coreproc.base import trace
    from coreproc.startup.zygote_link import code_stamp, fork_from

    trace.started(process="ember (launcher)")
    request = spawn_serve(argv, code_stamp())
    try:
        with trace.phase("fork the server from the zygote", "ember (launcher)"):
            server = fork_from(zygote, json.dumps(request).encode(), [0, 1, 2])
    except (OSError, ConnectionError, RuntimeError) as e:
        print(f"ember serve: not forked from the preload zygote ({e}); starting here", file=sys.stderr)
        return None
    for sig in RELAYED:
        signal.signal(sig, lambda sig, _frame: server.send_signal(sig))
    code = server.wait()
    return code if code >= 0 else 1  # -1: it ended without a status (killed)


def spawn_serve(argv: list[str], code: str) -> dict[str, Any]:
    """coreproc.base.protocol's `SpawnServe` for `ember ARGV`, as the JSON object the zygote decodes (built
    here without msgspec and the protocol module: importing them took this process ~0.1 s)."""
    import frontend

    return {
        "type": "SpawnServe",
        "argv": list(argv),
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "executable": sys.executable,
        "package": str(Path(frontend.__file__ or "").parent),
        "code": code,
        "affinity": sorted(os.sched_getaffinity(0)),
    }


def forked(argv: list[str], conn: socket.socket) -> int:
    """Runs in the zygote's child: `ember serve ARGV` (its modules imported, the preloaded model's
    tokenizer and GGUF header already in this process's caches); SIGTERM to itself when the
    launcher's end of `conn` closes (the launcher was killed)."""
    from setproctitle import setproctitle

    from frontend.cli import main

    setproctitle("ember-serve")
    sys.argv = ["ember", *argv]

    def watch() -> None:
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="ember-launcher-watch", daemon=True).start()
    return main(argv)


def main() -> int:
    """The `ember` console script."""
    argv = sys.argv[1:]
    zygote = zygote_for(argv)
    if zygote is not None:
        code = serve_from(zygote, argv)
        if code is not None:
            return code
    if starts_a_core(argv):  # it imports while this process imports and reads the model's config
        from coreproc.base import standby
        from coreproc.startup.spawn import worker_env

        standby.start("core", env=worker_env())
    from frontend.cli import main as cli_main

    return cli_main(argv)


def starts_a_core(argv: list[str]) -> bool:
    """Whether `ember ARGV` starts an engine core process (a server's own, not one forked by the
    zygote)."""
    if command_of(argv) != "serve":
        return False
    return not any(arg.split("=", 1)[0] in ("-h", "--help", "--api-server-child") for arg in argv)


if __name__ == "__main__":
    sys.exit(main())
