"""Errors a user can fix, and the one base class they share; and `WorkerError`, the engine's failure.

Part of the shared base (imports nothing of Ember), raised in every process. An `EmberError`'s message
is one line meant for the user: the `ember` command prints it and exits 2, the HTTP server answers 400.
Any other exception is a bug or a failure of the machine: the command prints its traceback, exits 1.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class EmberError(Exception):
    """Something the user can fix (a flag, a file, a request); the message says what, in one line."""


class ConfigError(EmberError, ValueError):
    """A configuration value is wrong."""


class WorkerError(RuntimeError):
    """A worker died or failed; the engine cannot continue. Not an `EmberError`: no flag fixes it.
    Raised by every executor (coreproc/executor.py, coreproc/ray_executor.py)."""


class EngineDeadError(RuntimeError):
    """The engine died or the connection to it was lost (raised by the client SDK)."""


class EngineRequestError(RuntimeError):
    """The engine refused or failed one request; the message says why, `code` what kind of failure
    (a `coreproc.protocol.ErrorCode`, or None for a failure while running)."""

    def __init__(self, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


def run_command(name: str, func: Callable[[], int], debug: bool = False) -> int:
    """A command's exit status: its own; 2 with one line on stderr for an `EmberError` (its traceback
    too with `debug`); 130 on Ctrl-C. Any other exception propagates (traceback, status 1)."""
    try:
        return func()
    except KeyboardInterrupt:
        return 130
    except EmberError as e:
        if debug:
            raise
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
