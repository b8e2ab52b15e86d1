"""What this machine and installation are: CUDA present, fast half-precision CPU math, Ember's version,
the bundled model. Part of the shared base, read in every process; nothing here imports torch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def cuda_present() -> bool:
    """Whether the installed torch was built with CUDA and the host has an NVIDIA device."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    version_file = Path(spec.submodule_search_locations[0]) / "version.py"
    try:
        built_with_cuda = re.search(r"^cuda\b.*=\s*['\"]", version_file.read_text(), re.MULTILINE) is not None
    except OSError:
        return False
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return built_with_cuda and bool(glob.glob("/dev/nvidia[0-9]*"))


def engine_version() -> str:
    """The installed ember-serve version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ember-serve")
    except PackageNotFoundError:
        return "0+unknown"


def cpu_has_fast_half(dtype: str = "bfloat16") -> bool:
    """Whether this CPU computes `dtype` (bfloat16 / float16) fast: natively (AVX-512 BF16 / FP16, AMX),
    or, for bfloat16, through Ember's native CPU ops (AVX2 + FMA; not with EMBER_CPU_KERNELS=torch).
    Otherwise torch emulates it, many times slower than float32."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split())
                    break
    except OSError:
        pass
    if flags & {"avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"}:
        return True
    native = os.environ.get("EMBER_CPU_KERNELS", "auto").strip().lower() != "torch"
    return dtype == "bfloat16" and native and {"avx2", "fma"} <= flags


def default_model_dir() -> Path:
    """The small model bundled with Ember, used whenever no model is given."""
    return Path(__file__).resolve().parents[1] / "assets" / "default_model"


def default_draft_dir() -> Path:
    """The draft model bundled with Ember for speculative decoding with the bundled model."""
    return Path(__file__).resolve().parents[1] / "assets" / "default_draft"


# OpenMP threads of a CPU worker spin this many rounds after a parallel region before they sleep
# (libgomp's default is 300,000: on a host shared with another busy process, the spinning threads
# take the cores the descheduled ones need, and a worker ran 8-10x slower; at 3,000 a worker alone is
# as fast, and beside one busy process on 2 cores keeps about 0.45 of its speed; docs/RELIABILITY.md)
WORKER_SPINCOUNT = "3000"


def worker_openmp_env(environ: dict[str, str]) -> dict[str, str]:
    """The environment for processes that run CPU workers (set before torch loads OpenMP): the user's
    OMP_WAIT_POLICY / GOMP_SPINCOUNT if set, else a short spin."""
    env = dict(environ)
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = WORKER_SPINCOUNT
    return env
