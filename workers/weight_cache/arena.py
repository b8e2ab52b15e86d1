"""Sharing a model's processed tensors between processes without copying them.

Runs in preload daemons (export) and engine workers (import). CPU: every tensor is placed in one
memfd "arena" at an aligned offset, keeping its exact shape and strides; the daemon passes the file
descriptor over its Unix socket (SCM_RIGHTS) and the engine maps it copy-on-write, so reads share the
daemon's pages and a stray write can never reach them. CUDA: each tensor's storage is shared through
a CUDA IPC handle. Tied tensors are exported once; the others are listed as aliases. `map_to_file`
puts a model's tensors in a file in the same layout and maps it copy-on-write: CRIU then leaves the
weights out of a snapshot's image and maps the file again on restore.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import torch
from torch import nn

from coreproc.base.protocol import CacheTensor
from workers.models.layers import VocabEmbedding
from workers.quant.base import QuantLayer

ALIGN = 64

MAPPING_ATTR = "weight_mapping"  # the model attribute holding the mapping its CPU tensors live in


def span_elements(shape: list[int] | tuple[int, ...], stride: list[int] | tuple[int, ...]) -> int:
    """Elements of storage a strided tensor covers."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride))


def strided_view(
    base: torch.Tensor, offset: int, dtype: torch.dtype, shape: list[int], stride: list[int]
) -> torch.Tensor:
    """A tensor of `dtype` with exact `shape`/`stride` over bytes of `base` (uint8) at `offset`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    span = span_elements(shape, stride)
    flat = base[offset : offset + span * itemsize].view(dtype)
    return flat.as_strided(shape, stride)


def named_tensors(model: nn.Module) -> tuple[list[tuple[str, str, torch.Tensor]], dict[str, str]]:
    """Every parameter once, plus aliases for names that share a tensor (tied weights), and the derived
    tables of modules that can rebuild them (`materialize`: rotary cos/sin): an engine keeps those it
    can use (same rope, as many positions or fewer) and builds the others."""
    seen: dict[tuple[int, int], str] = {}
    entries: list[tuple[str, str, torch.Tensor]] = []
    aliases: dict[str, str] = {}
    items = [(n, "param", t) for n, t in model.named_parameters(remove_duplicate=False)]
    for owner, module in model.named_modules(remove_duplicate=False):
        if callable(getattr(module, "materialize", None)):
            items += [(f"{owner}.{n}", "buffer", t) for n, t in module.named_buffers(recurse=False)]
    for name, kind, t in items:
        key = (t.data_ptr(), t.numel())
        if key in seen and t.numel():
            aliases[name] = seen[key]
            continue
        seen[key] = name
        entries.append((name, kind, t))
    return entries, aliases


def module_attrs(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Each quantized layer's (and a GGUF embedding's) non-empty `quant_attrs`, by module name."""
    return {
        name: dict(m.quant_attrs)
        for name, m in model.named_modules()
        if isinstance(m, (QuantLayer, VocabEmbedding)) and getattr(m, "quant_attrs", None)
    }


def keep_mapping(model: nn.Module, mm: mmap.mmap) -> None:
    """Keep `mm` mapped as long as `model` lives (as its `weight_mapping` attribute), replacing (and so
    releasing) the one held before."""
    setattr(model, MAPPING_ATTR, mm)  # not a tensor or module: a plain attribute of the model


def fault_in(model: nn.Module) -> bool:
    """Map every page of `model`'s kept mapping (`keep_mapping`) into this process now, one read per
    page, so that its first step does not take the page faults; False when it keeps none."""
    mm = getattr(model, MAPPING_ATTR, None)
    if not isinstance(mm, mmap.mmap):
        return False
    torch.frombuffer(mm, dtype=torch.uint8)[:: mmap.PAGESIZE].sum()
    return True


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layout(entries: list[tuple[str, str, torch.Tensor]]) -> tuple[list[int], int]:
    """Each tensor's aligned byte offset, and the total size."""
    offsets, total = [], 0
    for _, _, t in entries:
        offsets.append(total)
        nbytes = span_elements(t.shape, t.stride()) * t.element_size()
        total += -(-nbytes // ALIGN) * ALIGN
    return offsets, max(total, ALIGN)


class CpuArena:
    """The daemon's shared memory: one memfd (or a file) holding every tensor of the model."""

    def __init__(self, entries: list[tuple[str, str, torch.Tensor]], fd: int | None = None) -> None:
        offsets, self.size = _layout(entries)
        self.fd = os.memfd_create("ember-weights", os.MFD_CLOEXEC) if fd is None else fd
        os.ftruncate(self.fd, self.size)
        self.mm = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        base = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.specs: list[CacheTensor] = []
        self.views: dict[str, torch.Tensor] = {}
        for (name, kind, t), off in zip(entries, offsets):
            view = strided_view(base, off, t.dtype, list(t.shape), list(t.stride()))
            view.copy_(t)
            self.views[name] = view
            nbytes = span_elements(t.shape, t.stride()) * t.element_size()
            self.specs.append(
                CacheTensor(name, kind, list(t.shape), list(t.stride()), dtype_name(t.dtype), off, nbytes)
            )


def map_to_file(model: nn.Module, path: str) -> mmap.mmap:
    """Move `model`'s parameters into the file at `path` (written, synced, then mapped copy-on-write
    like `import_cpu`), so they are file pages rather than anonymous memory. The mapping is kept with
    the model (`keep_mapping`), replacing (and so releasing) a preload cache's mapping."""
    entries, aliases = named_tensors(model)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        arena = CpuArena(entries, fd)
        arena.mm.flush()
        os.fsync(fd)
        views, mm = import_cpu(fd, arena.size, arena.specs)
    finally:
        os.close(fd)
    repoint(model, views, aliases)
    keep_mapping(model, mm)
    return mm


def export_cuda(entries: list[tuple[str, str, torch.Tensor]]) -> list[CacheTensor]:
    """CUDA IPC handles for each tensor's storage (fresh handles per call)."""
    specs = []
    for name, kind, t in entries:
        fields = list(t.untyped_storage()._share_cuda_())
        specs.append(
            CacheTensor(
                name,
                kind,
                list(t.shape),
                list(t.stride()),
                dtype_name(t.dtype),
                int(t.storage_offset()),
                0,
                fields,
            )
        )
    return specs


def import_cpu(fd: int, size: int, specs: list[CacheTensor]) -> tuple[dict[str, torch.Tensor], mmap.mmap]:
    """Map the arena copy-on-write and view every tensor in it (no copy)."""
    mm = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    base = torch.frombuffer(mm, dtype=torch.uint8)
    out = {s.name: strided_view(base, s.offset, getattr(torch, s.dtype), s.shape, s.stride) for s in specs}
    return out, mm


def import_cuda(specs: list[CacheTensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Open each CUDA IPC handle on this process's device index."""
    out = {}
    for s in specs:
        fields = list(s.ipc)
        fields[0] = device.index if device.index is not None else torch.cuda.current_device()
        storage = torch.UntypedStorage._new_shared_cuda(*fields)
        t = torch.empty((0,), dtype=getattr(torch, s.dtype), device=device)
        out[s.name] = t.set_(storage, s.offset, s.shape, s.stride)
    return out


def install(
    model: nn.Module, tensors: dict[str, torch.Tensor], specs: list[CacheTensor], aliases: dict[str, str]
) -> None:
    """Put imported tensors into a model built on the meta device (parameters stay frozen)."""
    params: dict[str, nn.Parameter] = {}
    buffers: dict[str, torch.Tensor] = {}
    for s in specs:
        if s.kind == "param":
            params[s.name] = nn.Parameter(tensors[s.name], requires_grad=False)
        else:
            buffers[s.name] = tensors[s.name]
    for name, target in [(s.name, s.name) for s in specs] + list(aliases.items()):
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if target in params:
            owner._parameters[leaf] = params[target]  # tied names share one Parameter
        else:
            owner._buffers[leaf] = buffers[target]


def repoint(model: nn.Module, views: dict[str, torch.Tensor], aliases: dict[str, str]) -> None:
    """Make a model use the arena's copies of its tensors (so a daemon holds one copy, not two)."""
    for name, view in views.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if leaf in owner._parameters:
            param = owner._parameters[leaf]
            assert param is not None, f"{name} is listed as a tensor but its parameter is None"
            param.data = view
        else:
            owner._buffers[leaf] = view
