"""`ember snapshot` end to end with real CRIU: create, restore (twice), serve, and every refusal.

`pytest -q tests/test_snapshot.py`. Needs root and CRIU >= 4.1 (`tools/install_criu.sh`, which CI
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

from frontend.snapshot_manifest import criu_version, version_at_least

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
    assert re.search(r"created \(full mode: weights inside the image\), \d+ MiB", done.stdout), done.stdout
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


def test_one_snapshot_restores_twice_side_by_side(restored) -> None:
    (url1, pid1), (url2, pid2) = restored(), restored()
    assert url1 != url2 and pid1 != pid2
    assert greedy_ids(url1) == greedy_ids(url2)
    os.kill(pid1, signal.SIGTERM)  # a restored server shuts down cleanly; the other keeps serving
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid1}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
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


def test_restore_refuses_changed_weights(snap: Path, model: Path, restored) -> None:
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


def test_tampered_image_fails_its_canary(snap: Path, model: Path) -> None:
    """Negate the LM head inside the worker's memory image: the restored engine must be refused."""
    head = load_file(str(model / "model.safetensors"))["lm_head.weight"].astype(np.float32).tobytes()
    for image in sorted((snap / "images").glob("pages-*.img")):
        data = image.read_bytes()
        at = data.find(head)
        if at >= 0:
            break
    else:
        pytest.fail("the LM head is not in the image")
    tampered = (-np.frombuffer(head, dtype=np.float32)).tobytes()
    with open(image, "r+b") as f:
        f.seek(at)
        f.write(tampered)
    try:
        done = ember("snapshot", "restore", str(snap), "--port", "0")
    finally:
        with open(image, "r+b") as f:
            f.seek(at)
            f.write(head)
    assert done.returncode == 2
    assert "canary mismatch after restore" in done.stderr and "killed" in done.stderr


def test_inspect_prints_the_manifest(snap: Path) -> None:
    done = ember("snapshot", "inspect", str(snap))
    assert done.returncode == 0
    m = json.loads(done.stdout)
    assert m["complete"] and m["schema_version"] == 1 and m["mode"] == "full"
    assert m["identity"]["criu_version"] == criu_version() and m["canary"]["prompt"]
    assert m["argv"][-2:] == ["--max-model-len", "256"] and m["image_bytes"] > 0


def test_create_refusals_and_failed_create(tmp_path: Path, model: Path) -> None:
    done = ember("snapshot", "create", str(tmp_path / "a"), str(model), "--api-key", "k", "-tp", "2")
    assert done.returncode == 2 and not (tmp_path / "a").exists()
    assert "--api-key" in done.stderr and "tensor and data parallelism" in done.stderr
    # passes preflight, then the engine refuses to start (no room for one sequence): nothing is left
    done = ember("snapshot", "create", str(tmp_path / "b"), str(model), "--num-kv-blocks", "1")
    assert done.returncode == 2 and "before parking" in done.stderr
    assert not (tmp_path / "b").exists()
