"""Which processed weights a rank needs: the cache key shared by preload daemons and engines.

Runs in preload daemons and engine workers. The checkpoint's identity is a sha256 over its shard
names, raw safetensors headers (names, dtypes, shapes, offsets) or a GGUF file's whole header, and a
few small samples of the data, so it does not read the weights and does not depend on the folder's
path. The device identity is the GPU UUID on CUDA and the host's machine id plus boot id on CPU
(shared memory does not survive a reboot). The global placement counts too: the rank, and across
nodes the number of nodes and the node holding the rank (where a rank sits and its GPU:
workers/parallel.py). Also here: socket paths and the private socket directory's safety checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from pathlib import Path

from coreproc.base.config import EngineConfig
from coreproc.base.gguf_file import is_gguf, open_gguf
from coreproc.base.host import engine_version
from coreproc.base.protocol import Fingerprint

SAMPLES_PER_SHARD = 16
SAMPLE_BYTES = 4096


def checkpoint_hash(model_dir: str) -> str:
    """sha256 over sorted shard basenames, each shard's header (length prefix + JSON), and a few
    evenly spaced 4 KiB samples of its data: headers alone cannot tell two trainings of the same
    architecture apart, while 64 KiB per shard is no real read of the weights. A GGUF file: the same
    over its header (metadata, tensor table) and samples."""
    h = hashlib.sha256()
    shards = [Path(model_dir)] if is_gguf(model_dir) else Path(model_dir).glob("*.safetensors")
    for path in sorted(shards, key=lambda p: p.name):
        weights_identity(path, h)
    return h.hexdigest()


def weights_identity(path: Path, h: hashlib._Hash) -> bool:
    """Feed `h` one weights file's identity (its name, header and samples) if it is a safetensors
    shard or a GGUF file; False (nothing fed) for any other file, and for one whose header does not
    fit in it (not what its name says: the caller hashes it whole). Also what `ember snapshot`
    records of a checkpoint's weights."""
    if is_gguf(path):
        gguf = open_gguf(path)
        h.update(path.name.encode() + b"\0" + gguf.header)
        step = max(1, (gguf.size - gguf.data_start) // SAMPLES_PER_SHARD)
        for offset in range(gguf.data_start, gguf.size, step):
            h.update(gguf.sample(offset, SAMPLE_BYTES))
        return True
    if path.suffix != ".safetensors":
        return False
    with open(path, "rb") as f:
        prefix, size = f.read(8), os.fstat(f.fileno()).st_size
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else size
        if 8 + length > size:
            return False
        h.update(path.name.encode() + b"\0" + prefix + f.read(length))
        data_start = 8 + length
        step = max(1, (size - data_start) // SAMPLES_PER_SHARD)
        for offset in range(data_start, size, step):
            f.seek(offset)
            h.update(f.read(SAMPLE_BYTES))
    return True


def config_hash(model_dir: str) -> str:
    """sha256 of config.json's canonical JSON (for a GGUF file: of the config its metadata implies)."""
    if is_gguf(model_dir):
        cfg = open_gguf(model_dir).hf_config
    else:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg.pop("transformers_version", None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()


def device_identity(device_type: str, index: int = 0) -> str:
    """GPU UUID on CUDA; machine id + boot id on the host."""
    if device_type == "cuda":
        import torch

        return f"gpu-{torch.cuda.get_device_properties(index).uuid}"
    parts = []
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            parts.append(Path(path).read_text().strip())
        except OSError:
            parts.append("unknown")
    return "host-" + "-".join(parts)


def linear_kernel(config: EngineConfig) -> str:
    """The linear kernel an engine (or daemon) with `config` uses: it decides the processed layout."""
    import torch

    from kernels.cpu_gemm import select_linear_kernel

    return select_linear_kernel(config.device.resolved, getattr(torch, config.model.dtype))


def fingerprint(config: EngineConfig, tp_rank: int, device: str, role: str = "target") -> Fingerprint:
    """The key of one rank's processed weights under `config` on `device` (see `device_identity`)."""
    from workers.quant import make_method

    model = config.model
    return Fingerprint(
        checkpoint=checkpoint_hash(model.model),
        architecture=model.architecture,
        model_config=config_hash(model.model),
        tp_size=config.parallel.tensor_parallel_size,
        tp_rank=tp_rank,
        dp_size=config.parallel.data_parallel_size,
        dp_rank=config.parallel.data_parallel_rank,
        dtype=model.dtype,
        quantization=model.quantization or "none",
        quant_config=make_method(model.quantization, linear_kernel(config)).config_hash(),
        revision=model.revision or "",
        engine_version=engine_version(),
        device=device,
        role=role,
        nnodes=config.parallel.nnodes,
        node_rank=config.parallel.node_of(tp_rank),
    )


def differences(a: Fingerprint, b: Fingerprint) -> list[str]:
    """Names of the fields that differ."""
    return [f for f in a.__struct_fields__ if getattr(a, f) != getattr(b, f)]


def socket_path(socket_dir: Path, device: str, dp_rank: int, tp_rank: int, role: str = "target") -> Path:
    """One socket per (device, DP rank, TP rank, role); short names (Unix socket paths are limited)."""
    name = device.split("-", 1)[0] + "-" + hashlib.sha256(device.encode()).hexdigest()[:12]
    suffix = "" if role == "target" else f"-{role}"
    return socket_dir / f"{name}-dp{dp_rank}-tp{tp_rank}{suffix}.sock"


def check_socket_dir(path: Path, create: bool, strict: bool) -> None:
    """A real directory (not a symlink) owned by us that no one else may write into (unless sticky); with
    `strict`, no group/other access at all."""
    if create and not path.exists():
        path.mkdir(mode=0o700, parents=True)
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"{path} is not a real directory")
    if info.st_uid != os.getuid():
        raise PermissionError(f"{path} is owned by uid {info.st_uid}, not by us ({os.getuid()})")
    mode = oct(info.st_mode & 0o777)
    if strict and info.st_mode & 0o077:
        raise PermissionError(f"{path} is accessible to other users (mode {mode}); want 0700")
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:  # they could replace our sockets
        raise PermissionError(f"{path} is writable by other users (mode {mode})")
