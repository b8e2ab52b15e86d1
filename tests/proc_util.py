"""Ember's processes as /proc sees them, for the end-to-end tests: children, command lines, exits."""

from __future__ import annotations

import time
from pathlib import Path


def children(pid: int) -> list[int]:
    """Direct children of a process, from /proc."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() and "ember" in cmdline(p) for p in pids):
            return True
        time.sleep(0.05)
    return False
