"""Ember's native CPU ops: one small C++ library, built once per machine, and the switch that enables it.

Used by worker processes (and the preload daemon) on CPU devices. `load_native` compiles
csrc/*.cpp with torch.utils.cpp_extension (only light ATen headers: 30-60 s on 2 cores, once) into
$XDG_CACHE_HOME/ember/kernels/<key>, where the key pins the sources, torch and the CPU's feature
flags (the build uses -march=native; $EMBER_CPU_MARCH names another target, e.g. haswell, to build
and measure the 256-bit kernels on an AVX-512 machine, icelake-server the AVX-512 FMA ones on an
AMX machine), and registers torch.ops.ember.{gemm_bf16 (on AMX tiles where the build targets them:
csrc/cpu_amx.cpp), gemm_fp8, qgemm, decode_attention, rms_norm, rotary_, silu_and_mul, write_kv}.
The K-quants' few-row products walk a weight the way this CPU streams best (one block and the
hardware prefetcher on AMD, several blocks and software prefetch elsewhere; $EMBER_QWALK="blocks:ahead"
overrides, for benchmarks). `use_native` decides once per process; $EMBER_CPU_KERNELS=torch turns the
native ops off (the torch references then run everywhere), =native makes their absence an error.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

import torch

log = logging.getLogger("ember.kernels")

ENV_VAR = "EMBER_CPU_KERNELS"
CHOICES = ("auto", "native", "torch")
SOURCES = tuple(
    Path(__file__).with_name("csrc") / f
    for f in (
        "cpu_gemm.cpp",
        "cpu_amx.cpp",
        "cpu_dpbf16.cpp",
        "cpu_qgemm.cpp",
        "cpu_gguf.cpp",
        "cpu_weights.cpp",
        "cpu_attention.cpp",
        "cpu_layer_ops.cpp",
        "cpu_moe.cpp",
        "cpu_decoder.cpp",
    )
)
HEADERS = tuple(
    Path(__file__).with_name("csrc") / f
    for f in (
        "cpu_vec.h",
        "cpu_ops.h",
        "cpu_qblocks.h",
        "cpu_qfew.h",
        "cpu_qsuper.h",
        "cpu_qamx.h",
        "cpu_gemm512.h",
    )
)
LIBRARY = "ember_cpu_ops"
REQUIRED_FLAGS = ("avx2", "fma", "f16c")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (from /proc/cpuinfo; empty where unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def march() -> str:
    """The compiler's target: this CPU unless $EMBER_CPU_MARCH names another (one that it can run)."""
    return os.environ.get("EMBER_CPU_MARCH", "").strip() or "native"


def build_dir() -> Path:
    """Where this machine's build lives: the folder's name pins sources, torch and CPU flags."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ember" / "kernels"
    key = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        key.update(source.read_bytes())
    flags = " ".join(sorted(cpu_flags()))
    key.update(f"|{torch.__version__}|{platform.machine()}|{flags}|{march()}".encode())
    return base / key.hexdigest()[:16]


@functools.cache
def load_native() -> str | None:
    """Build (first time) or load the library; None when its ops are registered, else why not."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the native CPU ops are x86-64 only (this is {platform.machine()})"
    missing = [f for f in REQUIRED_FLAGS if f not in cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    folder = build_dir()
    built = folder / f"{LIBRARY}.so"
    if built.exists():
        try:
            torch.ops.load_library(str(built))
            return None
        except OSError:  # another process is still linking it: build below waits on its lock
            pass
    from torch.utils import cpp_extension

    log.info("building Ember's native CPU ops into %s (once per machine, up to a minute)", folder)
    path = os.environ.get("PATH", "")
    # the ninja that ships with this environment, also when its bin folder is not on PATH
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
    try:
        folder.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=LIBRARY,
            sources=[str(s) for s in SOURCES],
            extra_cflags=["-O3", f"-march={march()}", "-fopenmp"],
            extra_ldflags=["-fopenmp"],  # resolves to the libgomp torch already loaded (same soname)
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as e:
        lines = str(e).strip().splitlines()
        return f"building them failed: {lines[0] if lines else type(e).__name__}"
    finally:
        os.environ["PATH"] = path
    return None


def use_native(device: torch.device | str, override: str | None = None) -> bool:
    """override > $EMBER_CPU_KERNELS > auto (native on a CPU device that can build them)."""
    choice = (override or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if choice not in CHOICES:
        raise ValueError(f"{ENV_VAR}={choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "torch" or torch.device(device).type != "cpu":
        return False
    reason = load_native()
    if reason is None:
        return True
    if choice == "native":
        raise ValueError(f"{ENV_VAR}=native, but the native CPU ops are not available: {reason}")
    log.warning("native CPU ops not available (%s); using the torch references", reason)
    return False
