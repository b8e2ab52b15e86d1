"""A start-up trace: when each process of one start reached each of its phases.

Imported in every process (part of the shared base: it imports nothing of Ember). Off, at the cost of
one environment lookup per phase, unless $EMBER_STARTUP_TRACE names a file. Then every process of the
start (the frontend, its cores and workers, which inherit the variable) appends one JSON line per
phase: {"process": its title, "pid", "phase", "start", "end"}, in wall-clock seconds (`time.time()`,
comparable across processes). `started()` records the interpreter's own start-up, from the kernel's
start time of the process (its fork, for a zygote's child) to the call. Each line is one write to a
file opened with O_APPEND, so lines of several processes never interleave. `ember bench restart
--trace` sets the variable and reads the lines back (`read`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ENV = "EMBER_STARTUP_TRACE"


def _path() -> str | None:
    return os.environ.get(ENV) or None


def process_title() -> str:
    """The process's name as `ps` shows it (`ember-core`, `ember-worker-0`; set by setproctitle)."""
    try:
        return Path("/proc/self/comm").read_text().strip()
    except OSError:
        return Path(sys.argv[0]).name


def record(
    phase: str, start: float, end: float | None = None, process: str | None = None, to: Path | None = None
) -> None:
    """One phase of this process, `start` to `end` (now when None), into the trace file (`to`, or
    $EMBER_STARTUP_TRACE's); nothing when tracing is off."""
    path = to or _path()
    if path is None:
        return
    line = {
        "process": process or process_title(),
        "pid": os.getpid(),
        "phase": phase,
        "start": start,
        "end": time.time() if end is None else end,
    }
    try:  # a trace never stops a start: a file it cannot write loses the line
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    except OSError:
        return
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def phase(name: str, process: str | None = None) -> Iterator[None]:
    """Record the block as the phase `name` (also when it raises: a failed start shows where)."""
    if _path() is None:
        yield
        return
    start = time.time()
    try:
        yield
    finally:
        record(name, start, process=process)


def process_start_time() -> float:
    """When the kernel started this process, in wall-clock seconds (10 ms resolution)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime, the 22nd field: ticks after boot
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)


def started(what: str = "interpreter and imports", process: str | None = None) -> None:
    """Record the process's life so far (the interpreter starting, the imports done before this call)."""
    if _path() is not None:
        try:
            begun = process_start_time()
        except (OSError, IndexError, ValueError):  # no /proc: nothing to say
            return
        record(what, begun, process=process)


def read(path: str | Path) -> list[dict[str, Any]]:
    """The trace's lines, in order of their start."""
    text = Path(path).read_text() if Path(path).exists() else ""
    return sorted((json.loads(line) for line in text.splitlines() if line), key=lambda r: r["start"])
