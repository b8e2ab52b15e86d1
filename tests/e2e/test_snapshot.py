"""`ember snapshot` end to end with real CRIU: create, restore (twice), serve, and every refusal.

`pytest -q tests/e2e/test_snapshot.py`. Needs root and CRIU >= 4.1 (`tools/install_criu.sh`, which CI
runs); skipped otherwise, with the reason. One snapshot of a tiny Llama (a private copy of the
checkpoint, so a test may change its files) is made per module and restored by each test; a tampered
image must fail its canary, and every restored server is killed at the end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file

from frontend.snapshot.manifest import criu_version, version_at_least

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root"),
    pytest.mark.skipif(
        not version_at_least(criu_version(), (4, 1)), reason="CRIU >= 4.1 missing (tools/install_criu.sh)"
    ),
]

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def ember(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "frontend.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def model(make_ckpt, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(shutil.copytree(make_ckpt("llama"), tmp_path_factory.mktemp("snapmodel") / "llama"))


@pytest.fixture(scope="module")
def snap(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("snapshots") / "tiny"
    done = ember(
        "snapshot", "create", str(root), "--", str(model), "--dtype", "float32", "--max-model-len", "256"
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"created \(mapped mode: weights mapped from weights/\), image \d+ MiB", done.stdout)
    return root


@pytest.fixture(scope="module")
def snap_image(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("snapshots") / "tiny-image"
    argv = ["snapshot", "create", "--weights", "image", str(root), str(model), "--dtype", "float32"]
    done = ember(*argv, "--max-model-len", "256")
    assert done.returncode == 0, done.stderr
    assert re.search(r"created \(full mode: weights inside the image\), image \d+ MiB", done.stdout)
    return root


@pytest.fixture
def restored(snap: Path):
    """restore() -> (url, pid); every server restored through it is killed afterwards."""
    pids: list[int] = []

    def restore(*extra: str) -> tuple[str, int]:
        done = ember("snapshot", "restore", str(snap), "--port", "0", *extra)
        assert done.returncode == 0, done.stderr
        found = re.search(
            r"listening on (http://\S+) \(pid (\d+)\); canary token \d+ .* matches", done.stdout
        )
        assert found, done.stdout
        pids.append(int(found.group(2)))
        return found.group(1), int(found.group(2))

    yield restore
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def running(pid: int) -> bool:
    """Alive and not a zombie (whoever adopted the restored process may reap it late)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def greedy_ids(url: str) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0, "ignore_eos": True}
        reply = httpx.post(
            f"{url}/v1/completions", json={**body, "return_tokens_as_token_ids": True}, timeout=60
        )
        reply.raise_for_status()
        tokens = reply.json()["choices"][0]["logprobs"]["tokens"]
        out.append([int(t.removeprefix("token_id:")) for t in tokens])
    return out


def test_restored_server_generates_what_the_engine_generates(model: Path, restored) -> None:
    from coreproc import LLM, SamplingParams

    url, _ = restored()
    llm = LLM(str(model), dtype="float32", max_model_len=256, show_progress=False)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]
    assert greedy_ids(url) == expected


def test_bf16_snapshot_restores_on_the_native_kernels(model: Path, tmp_path: Path) -> None:
    """bf16 runs the native matmuls: AMX tiles where the build has them, whose grant by the OS a CRIU
    restore does not carry back (the first tile instruction would kill the worker): workers claim it
    again each step, and the restored server generates what the engine does."""
    from coreproc import LLM, SamplingParams

    root = tmp_path / "bf16"
    done = ember(
        "snapshot", "create", str(root), "--", str(model), "--dtype", "bfloat16", "--max-model-len", "256"
    )
    assert done.returncode == 0, done.stderr
    done = ember("snapshot", "restore", str(root), "--port", "0")
    assert done.returncode == 0, done.stderr
    found = re.search(r"listening on (http://\S+) \(pid (\d+)\); canary token \d+ .* matches", done.stdout)
    assert found, done.stdout
    try:
        llm = LLM(str(model), dtype="bfloat16", max_model_len=256, show_progress=False)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        expected = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]
        assert greedy_ids(found.group(1)) == expected
    finally:
        os.kill(int(found.group(2)), signal.SIGKILL)


def test_one_snapshot_restores_twice_side_by_side(snap: Path, restored) -> None:
    (url1, pid1), (url2, pid2) = restored(), restored()
    assert url1 != url2 and pid1 != pid2
    assert greedy_ids(url1) == greedy_ids(url2)
    assert not list((snap / "work").glob("restore-*")), "a successful restore leaves no CRIU log"
    os.kill(pid1, signal.SIGTERM)  # a restored server shuts down cleanly; the other keeps serving
    deadline = time.monotonic() + 60
    while running(pid1) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(pid1), "SIGTERM stops a restored server"
    assert httpx.get(f"{url2}/health", timeout=10).status_code == 200


def test_restore_refuses_a_busy_port(snap: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        done = ember("snapshot", "restore", str(snap), "--port", str(s.getsockname()[1]))
    assert done.returncode == 2
    assert "Address already in use" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def _with_manifest(snap: Path, edit) -> subprocess.CompletedProcess:
    path = snap / "manifest.json"
    original = path.read_text()
    try:
        data = json.loads(original)
        edit(data)
        path.write_text(json.dumps(data))
        return ember("snapshot", "restore", str(snap), "--port", "0")
    finally:
        path.write_text(original)


def test_restore_refuses_another_machine_or_an_incomplete_snapshot(snap: Path) -> None:
    done = _with_manifest(snap, lambda m: m["identity"].update(kernel_release="5.10.0-old"))
    assert done.returncode == 2 and "kernel_release: '5.10.0-old' in the snapshot" in done.stderr
    done = _with_manifest(snap, lambda m: m.update(complete=False))
    assert done.returncode == 2 and "incomplete snapshot" in done.stderr


def test_restore_refuses_a_changed_model(snap: Path, model: Path, restored) -> None:
    config = model / "config.json"
    original = config.read_text()
    config.write_text(original.replace('"rms_norm_eps"', '"rms_norm_eps" ', 1))
    try:
        done = ember("snapshot", "restore", str(snap), "--port", "0")
        assert (
            done.returncode == 2 and "model: the content of" in done.stderr and "config.json" in done.stderr
        )
    finally:
        config.write_text(original)
    restored()  # same bytes again (a newer mtime): the content hash decides


def _lm_head(model: Path) -> bytes:
    return load_file(str(model / "model.safetensors"))["lm_head.weight"].astype(np.float32).tobytes()


def _find(files: list[Path], data: bytes) -> tuple[Path, int]:
    for path in files:
        at = path.read_bytes().find(data)
        if at >= 0:
            return path, at
    pytest.fail("the LM head is not in " + ", ".join(map(str, files)))


def _overwrite(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def test_tampered_image_fails_its_canary(snap_image: Path, model: Path) -> None:
    """Negate the LM head inside the worker's memory image: the restored engine must be refused."""
    head = _lm_head(model)
    image, at = _find(sorted((snap_image / "images").glob("pages-*.img")), head)
    _overwrite(image, at, (-np.frombuffer(head, dtype=np.float32)).tobytes())
    try:
        done = ember("snapshot", "restore", str(snap_image), "--port", "0")
    finally:
        _overwrite(image, at, head)
    assert done.returncode == 2
    assert "canary mismatch after restore" in done.stderr and "killed" in done.stderr
    done = ember("snapshot", "restore", str(snap_image), "--port", "0")  # the intact image restores
    assert done.returncode == 0, done.stderr
    os.kill(int(re.search(r"\(pid (\d+)\)", done.stdout).group(1)), signal.SIGKILL)


def test_changed_mapped_weights_are_refused_or_fail_the_canary(snap: Path, model: Path) -> None:
    head = _lm_head(model)
    weights, at = _find([snap / "weights" / "rank0.bin"], head)
    stat = weights.stat()
    _overwrite(weights, at, (-np.frombuffer(head, dtype=np.float32)).tobytes())
    try:
        done = ember("snapshot", "restore", str(snap), "--port", "0")
        assert done.returncode == 2 and "mapped weights: the content of" in done.stderr
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # a change the file times hide
        done = ember("snapshot", "restore", str(snap), "--port", "0")
        assert done.returncode == 2 and "canary mismatch after restore" in done.stderr
    finally:
        _overwrite(weights, at, head)
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_inspect_prints_the_manifest(snap: Path) -> None:
    done = ember("snapshot", "inspect", str(snap))
    assert done.returncode == 0
    m = json.loads(done.stdout)
    assert m["complete"] and m["schema_version"] == 1 and m["mode"] == "mapped"
    assert m["weights"]["files"]["rank0.bin"][0] > 0
    assert m["identity"]["criu_version"] == criu_version() and m["canary"]["prompt"]
    assert m["argv"][-2:] == ["--max-model-len", "256"] and m["image_bytes"] > 0


def test_create_refusals_and_failed_create(tmp_path: Path, model: Path) -> None:
    done = ember("snapshot", "create", str(tmp_path / "a"), str(model), "--api-key", "k", "-tp", "2")
    assert done.returncode == 2 and not (tmp_path / "a").exists()
    assert "--api-key" in done.stderr and "tensor, pipeline and data parallelism" in done.stderr
    # passes preflight, then the engine refuses to start (no room for one sequence): nothing is left
    done = ember("snapshot", "create", str(tmp_path / "b"), str(model), "--num-kv-blocks", "1")
    assert done.returncode == 2 and "before parking" in done.stderr
    assert not (tmp_path / "b").exists()
    kept = re.search(r"logs kept in (\S+)\)", done.stderr)  # the half-made snapshot goes, its logs stay
    assert kept and "KV cache holds 1 blocks" in (Path(kept.group(1)) / "serve.log").read_text()
    shutil.rmtree(kept.group(1))


def test_bench_restart_adds_a_snapshot_row(model: Path, tmp_path: Path) -> None:
    plot = tmp_path / "timeline.png"
    flags = ["--dtype", "float32", "--max-model-len", "256", "--mode", "snapshot"]
    done = ember("bench", "restart", str(model), *flags, "--trace", "--trace-plot", str(plot))
    assert done.returncode == 0, done.stderr
    # the breakdown: each kind of start, its processes' phases against the launch, drawn too
    for kind in ("cold", "warm", "snapshot"):
        assert re.search(rf"^breakdown of the {kind} start: [\d.]+ s from launch", done.stdout, re.M)
    for row in ("ember-worker-0 +load weights", "ember-core +build the engine", "criu restore"):
        assert re.search(row, done.stdout), row
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {
        ln.split()[0]: ln.split()
        for ln in done.stdout.splitlines()
        if ln.split()[:1] in (["cold"], ["warm"], ["snapshot"])
    }
    assert set(rows) == {"cold", "warm", "snapshot"}, done.stdout
    cold, snap = float(rows["cold"][1]), float(rows["snapshot"][1])
    assert 0 < snap and 0 < cold and "(mapped mode, image" in done.stdout
    found = re.search(r"snapshot restore ([\d.]+)x faster \(([\d.]+)s\)", done.stdout)
    assert found and float(found.group(2)) == snap
    assert abs(float(found.group(1)) - cold / snap) < 0.1 + 0.01 * cold / snap


def test_snapshot_of_a_server_fed_by_the_preload_daemon(model: Path, tmp_path: Path) -> None:
    """Weights from the preload cache; workers started as the tree's own children (not by the zygote)."""
    from tests.workers.test_preload import start_preload, stop

    sockets = tmp_path / "sockets"
    sockets.mkdir(mode=0o700)
    daemon = start_preload(str(model), sockets, "--max-model-len", "256")
    try:
        root = tmp_path / "snap"
        serve = [str(model), "--dtype", "float32", "--max-model-len", "256"]
        serve += ["--load-format", "ipc_cache", "--socket-dir", str(sockets)]
        done = ember("snapshot", "create", str(root), "--", *serve)
        assert done.returncode == 0, done.stderr
        assert "from ipc_cache, mapped from" in (root / "logs" / "serve.log").read_text()
    finally:
        stop(daemon)
    done = ember("snapshot", "restore", str(root), "--port", "0")  # the daemon is gone: no matter
    assert done.returncode == 0, done.stderr
    os.kill(int(re.search(r"\(pid (\d+)\)", done.stdout).group(1)), signal.SIGKILL)


@pytest.mark.parametrize("given", ["file", "folder"])
def test_a_gguf_checkpoint_snapshots_and_restores(model: Path, tmp_path: Path, given: str) -> None:
    """A GGUF file, named itself or as the one file of a folder: created (the manifest records the
    file, hashed as the preload fingerprint hashes it), inspected, restored with its canary checked,
    and the restored server generates what the engine does on the file's own Q8_0 bits (bf16)."""
    from coreproc import LLM, SamplingParams
    from tools.hf_to_gguf import write_gguf

    folder = tmp_path / "gguf"
    folder.mkdir()
    gguf = write_gguf(model, folder / "tiny-q8_0.gguf", "Q8_0")
    target = str(gguf if given == "file" else folder)
    serve = [target, "--dtype", "bfloat16", "--max-model-len", "256"]
    root = tmp_path / "snap"
    done = ember("snapshot", "create", str(root), "--", *serve)
    assert done.returncode == 0, done.stderr
    done = ember("snapshot", "inspect", str(root))
    assert done.returncode == 0, done.stderr
    recorded = json.loads(done.stdout)["model"]
    assert recorded["path"] == str(gguf.resolve()) and list(recorded["files"]) == [gguf.name]
    done = ember("snapshot", "restore", str(root), "--port", "0")
    assert done.returncode == 0, done.stderr
    found = re.search(r"listening on (http://\S+) \(pid (\d+)\); canary token \d+ .* matches", done.stdout)
    assert found, done.stdout
    try:
        with LLM(target, dtype="bfloat16", max_model_len=256, show_progress=False) as llm:
            params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
            expected = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert greedy_ids(found.group(1)) == expected
    finally:
        os.kill(int(found.group(2)), signal.SIGKILL)
    from coreproc.base.gguf_file import open_gguf

    start = open_gguf(gguf).data_start  # other weights where the identity samples them, same size
    _overwrite(gguf, start, bytes(64))
    done = ember("snapshot", "restore", str(root), "--port", "0")
    assert done.returncode == 2 and f"model: the content of {gguf.resolve()} changed" in done.stderr


def _restore(root: Path) -> tuple[str, int]:
    done = ember("snapshot", "restore", str(root), "--port", "0")
    assert done.returncode == 0, done.stderr
    found = re.search(r"listening on (http://\S+) \(pid (\d+)\); canary token \d+ .* matches", done.stdout)
    assert found, done.stdout
    return found.group(1), int(found.group(2))


def _answers(url: str, bodies: list[dict]) -> list[str]:
    out = []
    for body in bodies:
        route = "chat/completions" if "messages" in body else "completions"
        reply = httpx.post(f"{url}/v1/{route}", json={**body, "temperature": 0, "max_tokens": 8}, timeout=60)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        out.append(choice["message"]["content"] if "messages" in body else choice["text"])
    return out


def _same_as_a_fresh_server(root: Path, serve: list[str], bodies: list[dict]) -> list[str]:
    """The restored snapshot's answers, checked equal to those of `ember serve SERVE` started fresh."""
    from tests.server_util import start_server, stop_server

    url, pid = _restore(root)
    try:
        restored = _answers(url, bodies)
    finally:
        os.kill(pid, signal.SIGKILL)
    proc, fresh_url = start_server(*serve)
    try:
        assert restored == _answers(fresh_url, bodies)
    finally:
        stop_server(proc)
    return restored


def test_a_vision_model_snapshots_and_answers_images_once_restored(tmp_path: Path) -> None:
    """A LLaVA server parks without its image processes (their POSIX semaphores cannot be dumped) and
    starts them once restored: an image request then gets what a fresh server answers."""
    import base64
    import io

    from PIL import Image

    from frontend.make_model import main as make_model

    llava = tmp_path / "llava"
    assert make_model([str(llava), "--arch", "llava"]) == 0
    root = tmp_path / "snap"
    serve = [str(llava), "--max-model-len", "512", "--served-model-name", "llama"]
    done = ember("snapshot", "create", str(root), "--", *serve, "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    picture = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 90)).save(picture, "PNG")
    url = "data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    bodies = [{"model": "llama", "messages": [{"role": "user", "content": content}]}]
    _same_as_a_fresh_server(root, serve, bodies)


def test_a_lora_engine_snapshots_with_its_adapters(model: Path, tmp_path: Path) -> None:
    """--enable-lora with --lora-modules: the manifest records the adapter, the restored server answers
    for it as a fresh one does (and unlike the base model); a changed adapter is refused."""
    from tests.workers.test_lora import ATTENTION, make_adapter

    adapter = make_adapter(model, tmp_path / "a", 4, ATTENTION, seed=3)
    flags = ["--max-model-len", "256", "--enable-lora", "--lora-modules", f"a={adapter}"]
    root = tmp_path / "snap"
    done = ember("snapshot", "create", str(root), "--", str(model), "--dtype", "float32", *flags)
    assert done.returncode == 0, done.stderr
    assert list(json.loads(ember("snapshot", "inspect", str(root)).stdout)["adapters"]) == ["a"]
    bodies = [{"model": name, "prompt": p} for name in ("a", "llama") for p in PROMPTS]
    with_a, base = _same_as_a_fresh_server(
        root, [str(model), *flags, "--served-model-name", "llama"], bodies
    )[::2]
    assert with_a != base
    weights = next(adapter.glob("*.safetensors"))
    _overwrite(weights, weights.stat().st_size - 64, bytes(64))
    done = ember("snapshot", "restore", str(root), "--port", "0")
    assert done.returncode == 2 and "changed" in done.stderr, done.stderr


def test_a_sliding_window_model_snapshots_and_restores(make_ckpt, tmp_path: Path) -> None:
    """Gemma 3 (sliding and global layers: KV groups with their own block tables, the null block
    reserved) snapshots and restores; the restored server answers long prompts, twice (the second
    time from its prefix cache), as a fresh server does."""
    from tests.workers.test_architectures import FAMILIES, SHAPES

    model = make_ckpt("gemma3", **{**SHAPES, **FAMILIES["gemma3"]})
    serve = [str(model), "--dtype", "float32", "--max-model-len", "256", "--block-size", "4"]
    root = tmp_path / "snap"
    done = ember("snapshot", "create", str(root), "--", *serve)
    assert done.returncode == 0, done.stderr
    long = " ".join(f"item{i}" for i in range(40))
    bodies = [{"model": str(model), "prompt": p} for p in (long, long + " and", PROMPTS[1])]
    _same_as_a_fresh_server(root, serve, bodies + bodies)
