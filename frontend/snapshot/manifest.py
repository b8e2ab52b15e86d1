"""The snapshot manifest: what a CRIU image of an engine was made from, and whether this host matches.

Runs in the `ember snapshot` controller (the user's shell); never imports torch. A manifest records
the schema version, a complete flag (false until the image is fully written), the identity of the
machine and software the image is only valid on (engine, Python, torch and CRIU versions, kernel
release, machine id, architecture, device), the model with a content hash, the serve argv, the
relevant environment variables and the canary. `differences()` names each identity field that differs
from this host; `folder_changes()` re-hashes a folder (the model, the mapped weights) only when a
file's size or mtime changed.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import msgspec

from coreproc.base.errors import EmberError
from frontend.atomic_files import write_atomic

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
ENV_PREFIXES = ("EMBER_", "OMP_", "MKL_", "KMP_", "TORCH", "CUDA_", "NCCL_", "TRITON_", "HF_", "XDG_")
ENV_NAMES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "LD_PRELOAD", "VIRTUAL_ENV", "TZ", "LANG")


class SnapshotError(EmberError):
    """A snapshot cannot be created, restored or read; the message says why."""


class Canary(msgspec.Struct, frozen=True, kw_only=True):
    """The answer recorded before the dump: one greedy token of a fixed prompt (seed 0)."""

    prompt: str
    token_id: int
    text: str
    logprob: float


class Identity(msgspec.Struct, frozen=True, kw_only=True):
    """What must be equal between the host that made an image and the host that restores it."""

    engine_version: str
    python_version: str
    python_prefix: str  # the environment (sys.prefix)
    torch_version: str
    criu_version: str
    kernel_release: str
    machine_id: str
    architecture: str
    device: str


class ModelFiles(msgspec.Struct, frozen=True, kw_only=True):
    """A checkpoint (a folder, or one GGUF file), the mapped weights' folder, an adapter: each file's
    size and mtime (a folder's top-level files), and a sha256 over their contents (`content_hash`)."""

    path: str
    files: dict[str, tuple[int, int]]  # name -> (size, mtime_ns)
    content_hash: str


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    schema_version: int = SCHEMA_VERSION
    complete: bool = False
    created_at: str = ""
    identity: Identity
    snapshot_dir: str  # where it was made: the image holds paths under it, so it cannot move
    model: ModelFiles
    argv: list[str]  # the serve arguments given to `ember snapshot create`
    cwd: str
    environment: dict[str, str]
    host: str  # the default address of a restore (the create's --host/--port)
    port: int
    mode: str = "full"  # "full": the weights are inside the image; "mapped": in weights/, mapped
    weights: ModelFiles | None = None  # the mapped weights' folder ("mapped" mode)
    adapters: dict[str, ModelFiles] = {}  # the LoRA adapters loaded at start (--lora-modules), by name
    runtime_dir: str = ""  # the engine's IPC directory, recreated before each restore
    canary: Canary | None = None
    init_seconds: float = 0.0  # launch to parked (load, warm-up, canary)
    dump_seconds: float = 0.0
    image_bytes: int = 0


def criu_version(criu: str = "criu") -> str:
    """`criu --version`'s number, or "" when CRIU is missing."""
    try:
        out = subprocess.run([criu, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    for line in out.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return ""


def version_at_least(have: str, want: tuple[int, ...]) -> bool:
    parts = []
    for p in have.split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return bool(have) and tuple(parts) >= want


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "unknown"


def device_identity() -> str:
    """The CPU model and count (the engine is CPU-only under snapshots in this version)."""
    model = "unknown"
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return f"cpu: {model} x {os.cpu_count()}"


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def host_identity(criu: str) -> Identity:
    return Identity(
        engine_version=_package_version("ember-serve"),
        python_version=platform.python_version(),
        python_prefix=sys.prefix,
        torch_version=_package_version("torch"),
        criu_version=criu,
        kernel_release=platform.release(),
        machine_id=_read("/etc/machine-id"),
        architecture=platform.machine(),
        device=device_identity(),
    )


def differences(recorded: Identity, current: Identity) -> list[str]:
    """One phrase per differing field: "kernel_release: 6.1.0 in the snapshot, 6.18.4 here"."""
    out = []
    for field in recorded.__struct_fields__:
        a, b = getattr(recorded, field), getattr(current, field)
        if a != b:
            out.append(f"{field}: {a!r} in the snapshot, {b!r} here")
    return out


def _members(path: Path) -> list[Path]:
    """The files a model path stands for: a file itself, a folder's top-level files."""
    return [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())


def _model_stats(path: Path) -> dict[str, tuple[int, int]]:
    stats = {p.name: p.stat() for p in _members(path)}
    return {name: (st.st_size, st.st_mtime_ns) for name, st in stats.items()}


def _content_hash(path: Path) -> str:
    """sha256 over the files' names and contents; a weights file (safetensors shard, GGUF file) counts
    by the identity the preload fingerprint gives it (header and samples: no read of the weights)."""
    from workers.weight_cache.fingerprint import weights_identity

    h = hashlib.sha256()
    for p in _members(path):
        h.update(p.name.encode() + b"\0")
        if not weights_identity(p, h):
            with open(p, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
    return h.hexdigest()


def model_files(model: str) -> ModelFiles:
    """What a snapshot records of a model path: a folder or one file (a GGUF checkpoint)."""
    path = Path(model).resolve()
    if not path.exists():
        raise SnapshotError(f"model not found: {path}")
    return ModelFiles(path=str(path), files=_model_stats(path), content_hash=_content_hash(path))


def folder_changes(recorded: ModelFiles, what: str = "model") -> list[str]:
    """Why the model path on disk is not the one the image was made with (empty when it is). Files
    whose size and mtime are unchanged are trusted; otherwise the whole path is hashed again."""
    path = Path(recorded.path)
    if not path.exists():
        return [f"{what}: {path} is gone"]
    stats = _model_stats(path)
    if stats == recorded.files:
        return []
    if sorted(stats) != sorted(recorded.files):
        added, gone = sorted(set(stats) - set(recorded.files)), sorted(set(recorded.files) - set(stats))
        return [f"{what}: files added {added} / removed {gone} in {path}"]
    if _content_hash(path) != recorded.content_hash:
        changed = [n for n in stats if stats[n] != tuple(recorded.files[n])]
        return [f"{what}: the content of {path} changed ({', '.join(changed)})"]
    return []


def relevant_environment() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def write_manifest(snapshot_dir: Path, manifest: Manifest) -> None:
    write_atomic(
        snapshot_dir / MANIFEST, msgspec.json.format(msgspec.json.encode(manifest), indent=2) + b"\n"
    )


def read_manifest(snapshot_dir: Path) -> Manifest:
    path = snapshot_dir / MANIFEST
    if not path.is_file():
        raise SnapshotError(f"{snapshot_dir} is not a snapshot (no {MANIFEST})")
    try:
        manifest = msgspec.json.decode(path.read_bytes(), type=Manifest)
    except msgspec.DecodeError as e:
        raise SnapshotError(f"{path} is damaged: {e}") from None
    if manifest.schema_version != SCHEMA_VERSION:
        raise SnapshotError(
            f"{path} has schema version {manifest.schema_version}; this Ember reads {SCHEMA_VERSION}"
        )
    return manifest
