"""Processes started early: a cold start imports a role's modules while its launcher gets ready.

Part of the shared base (every layer may start one). A cold `ember serve` needs a core, and a core
needs its workers; each of those processes spends most of its start importing (torch: 1.5 s on a
slow 2-core host) and the launcher spends its own importing and reading the model's config before it
knows their command lines. So the `ember` command starts a core on standby as it begins, the core
starts a worker on standby as it begins, and `spawn_engine_process` hands a waiting process its
command line, environment and config (one JSON line, then the config on its stdin) instead of
starting a fresh one. `python -m coreproc.base.boot ROLE --standby` imports the role's module,
then waits. A standby nobody takes exits when its launcher does (its stdin closes) or when
`discard` is called. The processes this process started early are kept in `_waiting`, each taken once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_waiting: dict[str, subprocess.Popen] = {}  # role -> this process's standby for it, until taken


def start(role: str, env: dict[str, str] | None = None) -> None:
    """Start a `role` ("core" or "worker") process on standby (once per role); a failure to start
    one is no error (the role then starts fresh when needed)."""
    if role in _waiting:
        return
    try:
        _waiting[role] = subprocess.Popen(
            [sys.executable, "-m", "coreproc.base.boot", role, "--standby"], stdin=subprocess.PIPE, env=env
        )
    except OSError:
        pass


def take(role: str, argv: list[str], config_json: bytes, env: dict[str, str]) -> subprocess.Popen | None:
    """The `role` standby, given its command line, environment and config; None when there is none
    (or it has died)."""
    proc = _waiting.pop(role, None)
    if proc is None or proc.poll() is not None or proc.stdin is None:
        return None
    try:
        proc.stdin.write(json.dumps({"argv": argv, "env": env}).encode() + b"\n" + config_json)
        proc.stdin.close()
    except OSError:  # it died meanwhile
        proc.kill()
        return None
    return proc


def discard() -> None:
    """Stop the standbys nobody took (this launch needed no such process)."""
    while _waiting:
        _, proc = _waiting.popitem()
        proc.kill()
        proc.wait()


def wait_for_role() -> tuple[list[str], bytes]:
    """In a standby process: block until the launcher hands over; (argv, config JSON). The
    environment it sent replaces this one. Exits (status 0) when the launcher closed without."""
    line = sys.stdin.buffer.readline()
    if not line:
        raise SystemExit(0)
    handed = json.loads(line)
    os.environ.clear()
    os.environ.update(handed["env"])
    return list(handed["argv"]), sys.stdin.buffer.read()
