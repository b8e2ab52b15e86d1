"""Files written whole: a reader sees the old file or the complete new one, never a part.

Used by `ember serve`'s parked server (the canary's answer) and by `ember snapshot` (manifests,
hand-off files), in the frontend process; standard library only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    """Write, fsync, rename, fsync the folder: a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: dict) -> None:
    """`data` as indented, key-sorted JSON, written atomically."""
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True).encode() + b"\n")
