"""Errors a user can fix, and the one base class they share; and `WorkerError`, the engine's failure.

Part of the shared base (imports nothing of Ember), raised in every process. An `EmberError`'s message
is one line meant for the user: the `ember` command prints it and exits 2, the HTTP server answers 400.
Any other exception is a bug or a failure of the machine: the command prints its traceback, exits 1.
A `ConfigError` about a setting names it by keyword (what `EngineConfig.create` and `LLM(...)` take);
the command says it with the setting's flag instead.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping


class EmberError(Exception):
    """Something the user can fix (a flag, a file, a request); the message says what, in one line."""


class ConfigError(EmberError, ValueError):
    """A configuration value is wrong. `option`: the keyword of the setting at fault, when one is; `also`:
    other settings the message names. The message names them by keyword; `said_with(flags)` says it
    in the command line's words."""

    def __init__(self, message: str, option: str | None = None, also: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.option = option
        self.names = (option, *also) if option else also
        assert all(_word(n).search(message) for n in self.names), f"{message!r} names {self.names}"

    @classmethod
    def bad(cls, option: str, problem: str, also: tuple[str, ...] = ()) -> ConfigError:
        """The usual shape: `<option> <problem>` (`max_num_seqs must be at least 1, got -3`)."""
        return cls(f"{option} {problem}", option=option, also=also)

    def said_with(self, flags: Mapping[str, str]) -> str:
        """The message with the first mention of each setting it names replaced by the setting's flag."""
        text = str(self)
        for name in self.names:
            text = _word(name).sub(flags.get(name, name), text, count=1)
        return text


def _word(name: str) -> re.Pattern[str]:
    """`name` as a whole word (`max_num_seqs`, not the start of `max_num_seqs_per_request`)."""
    return re.compile(rf"\b{re.escape(name)}\b")


class InvalidParam(EmberError, ValueError):
    """A user-supplied value is out of range; `param` names it (OpenAI error bodies carry it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFull(RuntimeError):
    """The engine's waiting queue is at its limit (`--max-num-queued-*`); retry later (HTTP 503)."""


class WorkerError(RuntimeError):
    """A worker died or failed; the engine cannot continue. Not an `EmberError`: no flag fixes it.
    Raised by every executor (coreproc/core/executor.py, coreproc/core/ray_executor.py)."""


class EngineDeadError(RuntimeError):
    """The engine died or the connection to it was lost (raised by the client SDK)."""


class EngineRequestError(RuntimeError):
    """The engine refused or failed one request; the message says why, `code` what kind of failure
    (a `coreproc.base.protocol.ErrorCode`, or None for a failure while running)."""

    def __init__(self, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


def run_command(
    name: str,
    func: Callable[[], int],
    debug: bool = False,
    flags: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None,
) -> int:
    """A command's exit status: its own; 2 with one line on stderr for an `EmberError` (its traceback
    too with `debug`; a `ConfigError` said with `flags`, keyword -> flag, or the function that gives
    them, called only then); 130 on Ctrl-C. Any other exception propagates (traceback, status 1)."""
    try:
        return func()
    except KeyboardInterrupt:
        return 130
    except EmberError as e:
        if debug:
            raise
        if callable(flags):
            flags = flags()
        said = e.said_with(flags) if flags is not None and isinstance(e, ConfigError) else str(e)
        print(f"{name}: error: {said}", file=sys.stderr)
        return 2
