"""The `ember snapshot` controller against a fake of the CRIU tools (no root, no CRIU needed).

`pytest -q tests/frontend/test_snapshot_unit.py`. The fake launches a small Python process that plays
the parked server (writes the canary, then waits), "dumps" by writing an image file and killing it,
and "restores" by starting a tiny HTTP server that answers /health and the canary with a chosen token.
What is real: preflight, the manifest and its identity checks, port checks, cleanup after failures, the canary
comparison and the killing of a restored process whose canary does not match.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from frontend.snapshot import commands as snapshot
from frontend.snapshot.criu import SnapshotTools, parse_serve_args, preflight
from frontend.snapshot.manifest import (
    MANIFEST,
    SnapshotError,
    differences,
    host_identity,
    read_manifest,
    version_at_least,
    write_manifest,
)
from tests.server_util import eventually

pytestmark = pytest.mark.unit

PARKED = textwrap.dedent(
    """
    import json, os, sys, time
    state = sys.argv[sys.argv.index("--snapshot-park") + 1]
    rt = os.path.join(os.environ["XDG_RUNTIME_DIR"], "ember-fake")
    os.makedirs(rt, exist_ok=True)
    canary = {"token_id": 7, "text": "x", "logprob": -1.25, "runtime_dir": rt, "pid": 1}
    with open(os.path.join(state, ".c.tmp"), "w") as f:
        json.dump(canary, f)
    os.replace(os.path.join(state, ".c.tmp"), os.path.join(state, "canary.json"))
    time.sleep(600)
    """
)

SERVER = textwrap.dedent(
    """
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    host, port, token = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    class H(BaseHTTPRequestHandler):
        def _send(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            self._send({"status": "ok"})
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            lp = {"tokens": [f"token_id:{token}"], "token_logprobs": [-1.25]}
            self._send({"choices": [{"text": "x", "logprobs": lp}]})
        def log_message(self, *a):
            pass
    HTTPServer((host, port), H).serve_forever()
    """
)


class FakeTools(SnapshotTools):
    """CRIU stand-in; `fail_dump` makes the dump fail, `token` is what restored servers answer."""

    def __init__(self, version: str = "4.1.1", fail_dump: bool = False, token: int = 7) -> None:
        super().__init__("criu-fake")
        self._version, self.fail_dump, self.token = version, fail_dump, token
        self.dumped: list[int] = []
        self.restored: list[subprocess.Popen] = []

    def version(self) -> str:
        return self._version

    def launch(self, argv, env, cwd, log):
        # a parent that waits, like `unshare --fork`, so the controller finds the "namespace init"
        script = f"{sys.executable} -c '{PARKED}' {' '.join(argv[1:])} & wait"
        with open(log, "ab") as out:
            return subprocess.Popen(["sh", "-c", script], env=env, cwd=cwd, stdout=out, stderr=out)

    def dump(self, pid, images, work, log, tcp_established):
        self.dumped.append(pid)
        if self.fail_dump:
            raise SnapshotError("criu dump failed (1): fake")
        (images / "pages-1.img").write_bytes(b"\0" * 4096)
        os.kill(pid, signal.SIGKILL)

    def restore(self, images, work, log, pidfile):
        handoff = json.loads((images.parent / "state" / "handoff.json").read_text())
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, handoff["host"], str(handoff["port"]), str(self.token)]
        )
        self.restored.append(proc)
        return proc.pid


@pytest.fixture
def root_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)


@pytest.fixture
def made(tmp_path: Path, root_user: None) -> tuple[Path, FakeTools]:
    tools = FakeTools()
    snapshot.create(tmp_path / "snap", ["--max-model-len", "64"], tools, timeout=60)
    return tmp_path / "snap", tools


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.split(") ")[1][0] != "Z"


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def test_versions_and_differences() -> None:
    assert version_at_least("4.1.1", (4, 1)) and version_at_least("4.2", (4, 1))
    assert not version_at_least("3.17.1", (4, 1)) and not version_at_least("", (4, 1))
    here = host_identity("4.1.1")
    there = msgspec.structs.replace(here, kernel_release="5.10.0", machine_id="abc")
    diffs = differences(there, here)
    assert len(diffs) == 2
    assert diffs[0].startswith("kernel_release: '5.10.0' in the snapshot")
    assert diffs[1].startswith("machine_id: 'abc' in the snapshot")


@pytest.mark.parametrize(
    "argv, version, expected",
    [
        ([], "3.17.1", "CRIU 3.17.1 is too old"),
        ([], "", "CRIU is not installed"),
        (["--api-key", "k"], "4.1.1", "one plain unauthenticated HTTP server"),
        (["--api-key-file", "/keys"], "4.1.1", "one plain unauthenticated HTTP server"),
        (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"], "4.1.1", "serves plain HTTP"),
        (["-tp", "2"], "4.1.1", "tensor, pipeline and data parallelism"),
        (["-pp", "2"], "4.1.1", "tensor, pipeline and data parallelism"),
        (["--api-server-count", "2"], "4.1.1", "one HTTP server process"),
        (["--speculative-config", '{"method": "ngram"}'], "4.1.1", "speculative decoding"),
        (["--device", "cuda"], "4.1.1", "CUDA plugin"),
    ],
)
def test_preflight_refusals(root_user: None, argv: list[str], version: str, expected: str) -> None:
    reasons, _ = preflight(parse_serve_args(argv), FakeTools(version))
    assert any(expected in r for r in reasons), reasons


def test_preflight_needs_root_and_linux_x86(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    reasons, _ = preflight(parse_serve_args([]), FakeTools())
    assert "CRIU needs root" in reasons
    assert any("Linux on x86-64" in r for r in reasons)


def test_preflight_passes_plain_cpu_server(root_user: None) -> None:
    reasons, config = preflight(parse_serve_args(["--max-model-len", "64"]), FakeTools())
    assert reasons == [] and config.model.max_model_len == 64
    with pytest.raises(SnapshotError, match="unknown serve arguments: --bogus"):
        parse_serve_args(["--bogus"])


def test_create_writes_a_complete_manifest(made: tuple[Path, FakeTools]) -> None:
    root, tools = made
    m = read_manifest(root)
    assert m.complete and m.mode == "mapped" and m.snapshot_dir == str(root.resolve())
    assert m.weights is not None and m.weights.path == str(root.resolve() / "weights")
    assert (m.canary.token_id, m.canary.text, m.canary.logprob) == (7, "x", -1.25)
    assert m.argv == ["--max-model-len", "64"] and m.image_bytes == 4096
    assert m.runtime_dir.endswith("ember-fake") and m.model.content_hash
    assert m.identity == host_identity("4.1.1")
    assert not _alive(tools.dumped[0]), "the dumped tree is gone"
    assert not list(root.glob(".*.tmp")), "no temporary manifest left behind"
    assert root.stat().st_mode & 0o777 == 0o700, "the image and weights are private"


def test_failed_create_leaves_nothing(tmp_path: Path, root_user: None) -> None:
    tools = FakeTools(fail_dump=True)
    with pytest.raises(SnapshotError, match="criu dump failed"):
        snapshot.create(tmp_path / "snap", ["--max-model-len", "64"], tools, timeout=60)
    assert not (tmp_path / "snap").exists()
    parked = tools.dumped[0]
    assert not eventually(lambda: _alive(parked), lambda alive: not alive), "the parked process was killed"


def test_create_in_image_mode_and_bad_modes(tmp_path: Path, root_user: None) -> None:
    m = snapshot.create(tmp_path / "snap", ["--max-model-len", "64"], FakeTools(), 60, weights="image")
    assert m.mode == "full" and m.weights is None
    with pytest.raises(SnapshotError, match="--weights must be one of mapped, image"):
        snapshot.create(tmp_path / "other", [], FakeTools(), 60, weights="disk")


def test_create_refuses_a_non_empty_directory(tmp_path: Path, root_user: None) -> None:
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "keep.txt").write_text("mine")
    with pytest.raises(SnapshotError, match="not an empty directory"):
        snapshot.create(tmp_path / "snap", [], FakeTools(), timeout=60)
    assert (tmp_path / "snap" / "keep.txt").read_text() == "mine"


def test_restore_checks_the_canary(made: tuple[Path, FakeTools]) -> None:
    root, tools = made
    try:
        restored = snapshot.restore(root, tools, port=0, timeout=30)
        assert restored.canary.token_id == 7 and _alive(restored.pid)
        assert not (root / "state" / "handoff.json").exists()
        assert Path(read_manifest(root).runtime_dir).is_dir()
        tools.token = 8
        with pytest.raises(SnapshotError, match="canary mismatch after restore: token 8 instead of 7"):
            snapshot.restore(root, tools, port=0, timeout=30)
        bad = tools.restored[-1]
        assert bad.wait(10) == -signal.SIGKILL, "a restored engine with a wrong canary is killed"
    finally:
        _stop(tools.restored)


def _edit_manifest(root: Path, **changes: object) -> None:
    m = read_manifest(root)
    write_manifest(root, msgspec.structs.replace(m, **changes))


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"complete": False}, "incomplete snapshot"),
        ({"snapshot_dir": "/elsewhere/snap"}, "moved to"),
    ],
)
def test_restore_refusals(made: tuple[Path, FakeTools], change: dict, expected: str) -> None:
    root, tools = made
    _edit_manifest(root, **change)
    with pytest.raises(SnapshotError, match=expected):
        snapshot.restore(root, tools, port=0)
    assert tools.restored == []


def test_restore_names_each_identity_difference(made: tuple[Path, FakeTools]) -> None:
    root, tools = made
    m = read_manifest(root)
    _edit_manifest(root, identity=msgspec.structs.replace(m.identity, kernel_release="1.0", device="cpu: x"))
    with pytest.raises(SnapshotError, match="kernel_release: '1.0' in the snapshot.*device: 'cpu: x'"):
        snapshot.restore(root, tools, port=0)
    assert tools.restored == []


def test_restore_refuses_a_busy_port(made: tuple[Path, FakeTools]) -> None:
    root, tools = made
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(SnapshotError, match=f"127.0.0.1:{s.getsockname()[1]}: Address already in use"):
            snapshot.restore(root, tools, port=s.getsockname()[1])
    assert tools.restored == []


def test_restore_refuses_a_damaged_or_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="is not a snapshot"):
        snapshot.restore(tmp_path, FakeTools())
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(SnapshotError, match="is damaged"):
        snapshot.restore(tmp_path, FakeTools())


HOLDER = textwrap.dedent(
    """
    import socket, sys, time, uvloop
    loop = uvloop.new_event_loop()  # libuv keeps an io_uring descriptor on recent kernels
    conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    print("ready", flush=True)
    time.sleep(600)
    """
)


def test_dump_problems_names_io_uring_and_external_tcp() -> None:
    from frontend.snapshot.criu import dump_problems

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(port)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            peer, _ = listener.accept()
            problems, internal = dump_problems(proc.pid)
            fds = [os.readlink(f) for f in Path(f"/proc/{proc.pid}/fd").iterdir()]
            peer.close()
        finally:
            proc.kill()
            proc.wait()
    assert not internal
    assert any(f"-> 0100007F:{port:04X} leaves the process tree" in p for p in problems), problems
    # reported exactly when the process holds one (libuv opens it on kernels that have io_uring)
    assert any("io_uring descriptor" in p for p in problems) == ("anon_inode:[io_uring]" in fds)


def test_restore_refuses_a_changed_adapter(made: tuple[Path, FakeTools], tmp_path: Path) -> None:
    """The image holds the adapters of --lora-modules as they were: a changed folder refuses the restore."""
    from frontend.snapshot.manifest import model_files

    root, tools = made
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    _edit_manifest(root, adapters={"a": model_files(str(adapter))})
    (adapter / "adapter_model.safetensors").write_bytes(b"other weights")
    with pytest.raises(SnapshotError, match="LoRA adapter 'a': the content of .* changed"):
        snapshot.restore(root, tools, port=0)
    assert tools.restored == []
