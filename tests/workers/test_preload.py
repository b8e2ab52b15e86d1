"""`ember preload` and the `ipc_cache` load format: real daemons, real Unix sockets, shared memory.

Daemons are started through the CLI in a private socket directory per test module; engines map their
weights (checked zero-copy: the tensors live in the daemon's memfd) and must generate exactly what a
disk load generates, or fall back to disk with the right reason.
Run: `pytest -q tests/workers/test_preload.py`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import torch

from coreproc import LLM, SamplingParams
from coreproc.base.config import EngineConfig
from coreproc.base.protocol import CacheRequest
from coreproc.client.dp_engine import DPEngine
from coreproc.startup.zygote_link import ForkedProcess
from kernels import select_backend
from workers.parallel import TPGroup
from workers.weight_cache.client import CacheUnavailable, cache_socket, load_from_cache, request
from workers.weight_cache.fingerprint import check_socket_dir

pytestmark = pytest.mark.e2e

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = ["def f(x):", "import os\n", "class A:"]


def start_preload(model: str, socket_dir: Path, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "frontend.cli",
        "preload",
        model,
        "--dtype",
        "float32",
        "--socket-dir",
        str(socket_dir),
    ]
    proc = subprocess.Popen([*cmd, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if "ember preload: ready:" in line:
            return proc
    raise AssertionError(f"preload did not start: {proc.stderr.read()}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def engine(model: str, sock: Path, **kw) -> LLM:
    return LLM(
        model, dtype="float32", load_format="ipc_cache", socket_dir=str(sock), show_progress=False, **kw
    )


def source(llm: LLM) -> tuple[str, str]:
    """Where the weights came from (with data parallelism: the last engine's)."""
    core = llm.engine.cores[-1] if isinstance(llm.engine, DPEngine) else llm.engine
    ready = core.executor.ready[0]
    return ready.weight_source, ready.cache_fallback_reason


@pytest.fixture(scope="module")
def model(make_ckpt) -> str:
    # big enough that the weights (~50 MB) dominate the process's own memory changes
    return str(make_ckpt("llama", hidden=512, layers=4, intermediate=1024, vocab=4096, heads=8, kv_heads=4))


@pytest.fixture(scope="module")
def sockdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sockets")
    path.chmod(0o700)
    return path


@pytest.fixture(scope="module")
def daemon(model, sockdir):
    proc = start_preload(model, sockdir, "--health-port", str(free_port()))
    yield proc
    stop(proc)


@pytest.fixture(scope="module")
def disk_tokens(model) -> list[list[int]]:
    with LLM(model, dtype="float32", show_progress=False) as llm:
        return tokens(llm)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def private_bytes() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:])
    return sum(int(fields[k].split()[0]) * 1024 for k in ("Private_Clean", "Private_Dirty"))


def test_engine_maps_weights_zero_copy_and_generates_like_disk(model, sockdir, daemon, disk_tokens):
    before = private_bytes()
    with engine(model, sockdir) as llm:
        assert source(llm) == ("ipc_cache", "")
        assert tokens(llm) == disk_tokens
        runner = llm.engine.executor.worker.runner
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        assert weight_bytes > 40 * 2**20
        grown = private_bytes() - before
        assert grown < weight_bytes / 2, (
            f"private memory grew {grown / 2**20:.0f} MiB for {weight_bytes / 2**20:.0f}"
        )
        ptr = runner.model.model.layers[0].mlp.down_proj.weight.data_ptr()
        maps = [
            line for line in Path("/proc/self/maps").read_text().splitlines() if "memfd:ember-weights" in line
        ]
        spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in maps]
        assert any(lo <= ptr < hi for lo, hi in spans), "weights must live in the daemon's shared memory"
    with LLM(model, dtype="float32", show_progress=False) as disk, engine(model, sockdir) as cached:
        a = dict(disk.engine.executor.worker.runner.model.named_parameters())
        b = dict(cached.engine.executor.worker.runner.model.named_parameters())
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_health_and_wait(model, sockdir, daemon):
    port = int(daemon.args[daemon.args.index("--health-port") + 1])
    assert httpx.get(f"http://127.0.0.1:{port}/health").json() == {"status": "ok"}
    cmd = [
        sys.executable,
        "-m",
        "frontend.cli",
        "preload",
        model,
        "--dtype",
        "float32",
        "--socket-dir",
        str(sockdir),
    ]
    done = subprocess.run([*cmd, "--wait", "--timeout", "30"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    missing = subprocess.run(
        [*cmd, "-tp", "2", "--wait", "--timeout", "1"], capture_output=True, text=True, timeout=120
    )
    assert missing.returncode == 1 and "tp1" in missing.stderr


FIELDS = [
    ("checkpoint", "0" * 64),
    ("architecture", "MistralForCausalLM"),
    ("model_config", "1" * 64),
    ("tp_size", 2),
    ("tp_rank", 1),
    ("dp_size", 2),
    ("dp_rank", 1),
    ("dtype", "bfloat16"),
    ("quantization", "int8"),
    ("quant_config", "2" * 64),
    ("revision", "v2"),
    ("engine_version", "9.9.9"),
    ("device", "gpu-someone-else"),
    ("role", "draft"),
]


@pytest.mark.parametrize("field,value", FIELDS)
def test_every_fingerprint_field_is_checked(model, sockdir, daemon, field, value):
    config = EngineConfig.create(model, dtype="float32", socket_dir=str(sockdir))
    path = cache_socket(config, torch.device("cpu"), 0)
    held, _ = request(path, CacheRequest(kind="ping"))
    wrong = msgspec.structs.replace(held.fingerprint, **{field: value})
    reply, fds = request(path, CacheRequest(kind="state", fingerprint=wrong))
    assert reply.status == "mismatch" and reply.fields == [field] and fds == []


def test_unknown_and_incomplete_requests_are_answered(model, sockdir, daemon):
    config = EngineConfig.create(model, dtype="float32", socket_dir=str(sockdir))
    path = cache_socket(config, torch.device("cpu"), 0)
    reply, _ = request(path, CacheRequest(kind="evict"))  # type: ignore[arg-type]
    assert reply.status == "error" and "evict" in reply.message
    reply, _ = request(path, CacheRequest(kind="state"))
    assert reply.status == "error" and "fingerprint" in reply.message


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        ({"dtype": "bfloat16"}, "dtype"),
        ({"quantization": "int8"}, "quantization"),
        ({"revision": "v2"}, "revision"),
        ({"data_parallel_size": 2}, "no preload daemon"),  # the daemons serve DP rank 0 only
    ],
)
def test_engine_falls_back_to_disk_with_the_reason(model, sockdir, daemon, kwargs, reason):
    kwargs.setdefault("dtype", "float32")
    with LLM(model, load_format="ipc_cache", socket_dir=str(sockdir), show_progress=False, **kwargs) as llm:
        where, why = source(llm)
        assert where == "disk" and reason in why
        assert len(tokens(llm)[0]) == GREEDY.max_tokens


def test_other_checkpoint_is_a_mismatch(make_ckpt, sockdir, daemon):
    other = str(
        make_ckpt("llama", hidden=512, layers=4, intermediate=1024, vocab=4096, heads=8, kv_heads=4, seed=9)
    )
    with engine(other, sockdir) as llm:
        where, why = source(llm)
        assert where == "disk" and "checkpoint" in why and "model_config" not in why


def test_socket_security(model, sockdir, daemon, tmp_path):
    config = EngineConfig.create(model, dtype="float32", socket_dir=str(sockdir))
    path = cache_socket(config, torch.device("cpu"), 0)
    # another user cannot reach the daemon (0700 directory, 0600 socket; SO_PEERCRED behind them)
    probe = "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])"
    interpreter = "/usr/bin/python3"  # our venv may live where another user cannot execute it
    if os.getuid() != 0 or not os.access(interpreter, os.X_OK):
        pytest.skip("needs root and a system python3 to act as another user")
    other = subprocess.run(
        [interpreter, "-c", probe, str(path)], user=65534, capture_output=True, text=True, timeout=60
    )
    assert other.returncode != 0 and "Permission" in other.stderr
    # a socket file that belongs to someone else is refused by the engine
    fake_dir = tmp_path / "fake"
    fake_dir.mkdir(mode=0o700)
    fake = fake_dir / path.name
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(fake))
    with pytest.raises(CacheUnavailable, match="stale socket"):
        request(fake, CacheRequest(kind="ping"))
    os.chown(fake, 65534, 65534)
    with pytest.raises(CacheUnavailable, match="owned by uid 65534"):
        request(fake, CacheRequest(kind="ping"))
    # symlinked or shared directories are refused for the default location
    link = tmp_path / "link"
    link.symlink_to(sockdir)
    with pytest.raises(PermissionError, match="not a real directory"):
        check_socket_dir(link, create=False, strict=True)
    (tmp_path / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "open", 0o777)
    with pytest.raises(PermissionError, match="other users"):
        check_socket_dir(tmp_path / "open", create=False, strict=True)


def test_second_daemon_and_stale_socket(model, tmp_path):
    sock = tmp_path / "s"
    sock.mkdir(mode=0o700)
    first = start_preload(model, sock)
    try:
        cmd = [
            sys.executable,
            "-m",
            "frontend.cli",
            "preload",
            model,
            "--dtype",
            "float32",
            "--socket-dir",
            str(sock),
        ]
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1 and "another preload daemon already serves" in second.stderr
        daemon_pid = next(p for p in _children(first.pid) if "ember-preload-target" in _cmd(p))
        os.kill(daemon_pid, signal.SIGKILL)  # leaves a stale socket file behind
        time.sleep(0.5)
        assert any(sock.glob("*.sock"))
    finally:
        stop(first)
    again = start_preload(model, sock)  # the stale socket does not stop a new daemon
    stop(again)


def test_pipeline_parallel_is_refused(model, sockdir):
    cmd = [sys.executable, "-m", "frontend.cli", "preload", model, "--pipeline-parallel-size", "2"]
    out = subprocess.run([*cmd, "--socket-dir", str(sockdir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "pipeline parallelism" in out.stderr


def test_daemon_killed_before_and_after_engine_start(model, tmp_path, disk_tokens):
    sock = tmp_path / "k"
    sock.mkdir(mode=0o700)
    proc = start_preload(model, sock)
    with engine(model, sock) as llm:
        assert source(llm)[0] == "ipc_cache"
        stop(proc)  # the daemon goes away; the engine's mapping stays valid
        assert tokens(llm) == disk_tokens
        restarted = start_preload(model, sock)  # a new daemon does not touch the running engine
        assert tokens(llm) == disk_tokens
        stop(restarted)
    with engine(model, sock) as llm:
        assert source(llm)[0] == "disk" and "no preload daemon" in source(llm)[1]


def test_tensor_parallel_data_parallel_and_quantized(make_ckpt, tmp_path):
    tiny = str(make_ckpt("qwen3"))
    sock = tmp_path / "tp"
    sock.mkdir(mode=0o700)
    proc = start_preload(tiny, sock, "-tp", "2", "-dp", "2", "-q", "int8")
    try:
        assert len([p for p in sock.glob("*.sock") if p.name != "zygote.sock"]) == 4
        kw = dict(dtype="float32", quantization="int8", tensor_parallel_size=2, show_progress=False)
        with LLM(tiny, **kw) as disk:
            want = tokens(disk)
        # two data-parallel engines, each mapping its own rank's daemons
        with LLM(tiny, load_format="ipc_cache", socket_dir=str(sock), data_parallel_size=2, **kw) as llm:
            assert isinstance(llm.engine, DPEngine)
            for core in llm.engine.cores:
                assert [r.weight_source for r in core.executor.ready] == ["ipc_cache", "ipc_cache"]
                # workers were forked by the preload zygote (torch already imported), not started fresh
                assert all(isinstance(p, ForkedProcess) for p in core.executor.procs)
            assert tokens(llm) == want
    finally:
        stop(proc)


def test_a_gguf_checkpoint_is_cached_and_sharded_like_a_folder(make_ckpt, tmp_path):
    from tools.hf_to_gguf import write_gguf

    path = str(write_gguf(make_ckpt("qwen2"), tmp_path / "tiny.gguf", "Q8_0"))
    sock = tmp_path / "gguf"
    sock.mkdir(mode=0o700)
    proc = start_preload(path, sock, "-tp", "2")
    try:
        with LLM(path, dtype="float32", show_progress=False) as disk:
            want = tokens(disk)
        with engine(path, sock, tensor_parallel_size=2) as llm:
            assert [r.weight_source for r in llm.engine.executor.ready] == ["ipc_cache", "ipc_cache"]
            assert tokens(llm) == want
    finally:
        stop(proc)


def test_draft_weights_are_held_beside_the_target(make_ckpt, model, tmp_path):
    draft = str(make_ckpt("llama", seed=5))
    sock = tmp_path / "d"
    sock.mkdir(mode=0o700)
    proc = start_preload(model, sock, "--draft-model", draft)
    try:
        config = EngineConfig.create(draft, dtype="float32", load_format="ipc_cache", socket_dir=str(sock))
        cpu = torch.device("cpu")
        cached = load_from_cache(config, cpu, TPGroup(), select_backend(cpu), role="draft")
        with LLM(draft, dtype="float32", show_progress=False) as disk:
            ref = dict(disk.engine.executor.worker.runner.model.named_parameters())
        assert all(torch.equal(p, ref[n]) for n, p in cached.named_parameters())
        with pytest.raises(CacheUnavailable, match="mismatch"):  # the target socket does not serve the draft
            load_from_cache(dataclasses.replace(config), cpu, TPGroup(), select_backend(cpu), role="target")
    finally:
        stop(proc)


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, ValueError):
                continue
    return out


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


PACKED_DTYPES = {
    None: torch.bfloat16,
    "fp8_per_tensor": torch.float8_e4m3fn,
    "int8": torch.uint8,
    "int4": torch.uint8,
}


@pytest.mark.parametrize("quantization", list(PACKED_DTYPES))
def test_packed_weights_come_from_the_cache(model, tmp_path, monkeypatch, quantization):
    """bf16 on the CPU fast path: the daemon holds the packed layout (bf16, or fp8 / int8 / int4 with a
    packed bf16 head), an engine maps it and generates what a disk-loaded engine does; an engine on
    the torch kernels does not take it (layout differs)."""
    from kernels.native import load_native

    if load_native() is not None:
        pytest.skip(f"native CPU ops unavailable: {load_native()}")
    monkeypatch.setenv("EMBER_CPU_KERNELS", "native")  # the path under test, whatever the suite runs
    sock = tmp_path / "sockets"
    sock.mkdir(mode=0o700)
    quant = ["--quantization", quantization] if quantization else []
    proc = start_preload(model, sock, "--dtype", "bfloat16", *quant)
    try:
        opts = dict(dtype="bfloat16", quantization=quantization, show_progress=False)
        with LLM(model, **opts) as disk:
            expected = tokens(disk)
        cache = dict(opts, load_format="ipc_cache", socket_dir=str(sock))
        with LLM(model, **cache) as cached:
            assert source(cached) == ("ipc_cache", "")
            net = cached.engine.executor.worker.runner.model
            assert net.lm_head.weight.dim() == 3 and net.lm_head.quant_attrs == {"out_features": 4096}
            down = net.model.layers[0].mlp.down_proj.weight
            assert down.dim() == 3 and down.dtype == PACKED_DTYPES[quantization]
            assert tokens(cached) == expected
        monkeypatch.setenv("EMBER_CPU_KERNELS", "torch")
        with LLM(model, **cache) as plain:
            weight_source, reason = source(plain)
            assert weight_source == "disk" and "quant_config" in reason
    finally:
        stop(proc)


def test_gguf_own_bits_come_from_the_cache(make_ckpt, tmp_path, monkeypatch):
    """A GGUF file on the CPU fast path: the daemon holds its repacked layers (segments and formats in
    the layers' attributes), an engine maps them and generates what a disk-loaded engine does."""
    from kernels.native import load_native
    from tools.hf_to_gguf import write_gguf

    if load_native() is not None:
        pytest.skip(f"native CPU ops unavailable: {load_native()}")
    monkeypatch.setenv("EMBER_CPU_KERNELS", "native")  # the path under test, whatever the suite runs
    path = str(write_gguf(make_ckpt("qwen2"), tmp_path / "qwen2-q5_0.gguf", "Q5_0"))
    sock = tmp_path / "sockets"
    sock.mkdir(mode=0o700)
    proc = start_preload(path, sock, "--dtype", "bfloat16")
    try:
        with LLM(path, dtype="bfloat16", show_progress=False) as disk:
            expected = tokens(disk)
        cache = dict(dtype="bfloat16", load_format="ipc_cache", socket_dir=str(sock), show_progress=False)
        with LLM(path, **cache) as cached:
            assert source(cached) == ("ipc_cache", "")
            net = cached.engine.executor.worker.runner.model
            qkv = net.model.layers[0].self_attn.qkv_proj
            assert type(qkv.quant).__name__ == "GGUFPacked" and qkv.weight.dtype == torch.uint8
            assert [s["kind"] for s in qkv.quant_attrs["segments"]] == ["u5"]
            embedding = net.model.embed_tokens  # its rows as stored, decoded at lookup
            assert embedding.weight.dtype == torch.uint8 and embedding.out_dtype == torch.bfloat16
            assert tokens(cached) == expected
    finally:
        stop(proc)
