"""A process still starting ends when the process that launched it is gone.

The core and its workers watch their launcher in their serving loops, but start-up (building the
engine, loading weights: minutes for a large model) runs no loop. A launcher stopped or killed
mid-load used to leave its core and workers loading to the end, holding the memory that the server a
supervisor starts next needs. `LauncherWatch` starts a thread that waits on the launcher's pidfd
and ends this process (status 1) if the launcher exits before `started()` is called; from then on the
serving loop handles a lost launcher its own way (the core drains, a worker leaves its loop).
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Callable
from typing import NoReturn

log = logging.getLogger("ember.startup")


class LauncherWatch:
    """Watches the launcher while this process starts; `started()` ends the watch (and its thread)."""

    def __init__(self, pid: int, name: str, on_gone: Callable[[], None] | None = None) -> None:
        """`on_gone`: what the launcher would have cleaned up, done before this process ends."""
        self.name, self.on_gone = name, on_gone
        fd = watch_pid(pid)
        if fd is None:
            self._gone()
        self.fd = fd
        self.wake_r, self.wake_w = os.pipe()
        threading.Thread(target=self._watch, name="ember-launcher-watch", daemon=True).start()

    def _watch(self) -> None:
        ready, _, _ = select.select([self.fd, self.wake_r], [], [])
        if self.wake_r not in ready:
            self._gone()
        for fd in (self.fd, self.wake_r, self.wake_w):
            os.close(fd)

    def _gone(self) -> NoReturn:
        log.warning("%s: the launching process exited during start-up; exiting", self.name)
        if self.on_gone is not None:
            self.on_gone()
        logging.shutdown()
        os._exit(1)

    def started(self) -> None:
        os.write(self.wake_w, b"x")


def watch_pid(pid: int) -> int | None:
    """A pidfd of `pid` for `exited` (None when it is already gone). A pidfd, not `os.getppid()`: a
    process the preload zygote forked is not its launcher's child."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def exited(pidfd: int | None) -> bool:
    """Whether the process behind `pidfd` (from `watch_pid`) has exited; no wait."""
    return pidfd is None or bool(select.select([pidfd], [], [], 0)[0])
