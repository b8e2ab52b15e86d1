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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from frontend.bench.throughput import make_prompts
from tools.peers import install
from tools.peers.install import PeerError, log

REPO = Path(__file__).resolve().parents[1]
PEERS_DIR = REPO / "tools" / "peers"
PEERS = ("ember", "transformers", "vllm", "llamacpp")
GGUF_TYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
RESULT_PREFIX = "PEER_RESULT "


@dataclass
class PeerResult:
    """One row of the table. ``status`` is "ok" or why there are no figures."""

    peer: str
    status: str
    version: str = ""
    batch_tps: float | None = None
    single_tps: float | None = None
    ready_s: float | None = None
    detail: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


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
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every peer (also OMP_NUM_THREADS)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
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
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1 or args.threads < 1:
        p.error("--num-prompts, --input-len, --output-len and --threads must be >= 1")
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
    }


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
    from coreproc.text.tokenizer import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    vocab = min(int(config.get("vocab_size") or len(tok)), len(tok))
    prompts = make_prompts(vocab, set(tok.all_special_ids), args.num_prompts + 3, args.input_len, args.seed)
    n = args.num_prompts
    job = {
        "model": str(model_dir),
        "dtype": args.dtype,
        "threads": args.threads,
        "seed": args.seed,
        "num_prompts": n,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_model_len": args.input_len + args.output_len,
        "batch_prompts": prompts[:n],
        "single_prompt": prompts[n],
        "warmup_prompts": prompts[n + 1 :],
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


# ----------------------------------------------------------------------------------------------- report


def ratio(ember: float | None, peer: float | None) -> float | None:
    return ember / peer if ember and peer else None


def render_table(results: list[PeerResult], n: int) -> list[str]:
    """Rows of the table, columns padded; numbers right-aligned, '-' where there is no figure."""
    ember = next((r for r in results if r.peer == "ember" and r.ok), None)
    eb, es = (ember.batch_tps, ember.single_tps) if ember else (None, None)
    head = ["peer", "version", f"batch-{n} tok/s", "batch-1 tok/s", "ready s"]
    head += [f"ember/peer b{n}", "ember/peer b1", "status"]

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    rows = [head] + [
        [
            r.peer,
            r.version or "-",
            num(r.batch_tps, ".1f"),
            num(r.single_tps, ".1f"),
            num(r.ready_s, ".1f"),
            num(ratio(eb, r.batch_tps), ".2f"),
            num(ratio(es, r.single_tps), ".2f"),
            r.status[:160],
        ]
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    left = {0, 1, 7}
    lines = []
    for k, row in enumerate(rows):
        cells = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def header_lines(machine: dict, model: dict, args: argparse.Namespace) -> list[str]:
    return [
        f"machine: {machine['cpu']}, {machine['cores']} cores ({machine['usable_cores']} usable), "
        f"{machine['memory_gib']} GiB RAM, {machine['os']}, Python {machine['python']}, "
        f"ISA {' '.join(machine['isa']) or '?'}, load average {machine['load_average']} at the start",
        f"model: {model['path']} ({model['architecture']}, {model['params'] / 1e6:.1f}M params, "
        f"{model['dtype']})",
        f"workload: greedy, ignore EOS, {args.num_prompts} prompts x {args.input_len} in / "
        f"{args.output_len} out (batch-{args.num_prompts}) and 1 prompt alone (batch-1), "
        f"{args.threads} threads, prompt seed {args.seed}",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = Path(args.model).resolve()
    if not (model_dir / "config.json").is_file():
        print(f"error: {model_dir} is not a checkpoint folder (no config.json)", file=sys.stderr)
        return 2
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.work_dir).expanduser() / "runs" / f"{stamp}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    machine, model = machine_info(), model_info(model_dir, args.dtype)
    job = write_job(args, model_dir, run_dir)
    results = [run_peer(peer, args, job, run_dir) for peer in args.peers]
    lines = header_lines(machine, model, args) + render_table(results, args.num_prompts)
    print("\n".join(lines), flush=True)
    ember = next((r for r in results if r.peer == "ember"), None)
    if args.result_json:
        workload = {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "threads": args.threads,
            "dtype": args.dtype,
            "seed": args.seed,
            "greedy": True,
            "ignore_eos": True,
        }
        peers = []
        for r in results:
            eb = ember.batch_tps if ember else None
            es = ember.single_tps if ember else None
            ratios = {"batch": ratio(eb, r.batch_tps), "single": ratio(es, r.single_tps)}
            peers.append(asdict(r) | {"ember_over_peer": ratios})
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
