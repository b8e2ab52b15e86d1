"""`ember serve` forked by the preload zygote: the same answers, signals and exit status as a server
started in the launcher's own process, and the server gone when its launcher is; the worker the zygote
prepares for the next restart taken by a restart with the same config (the same tokens as a fresh
engine), never when the checkpoint changed or the request differs.

A real `ember preload` (tiny Llama, private socket directory) per module; the servers are launched as
the `ember` command runs them (`python -m frontend.launch`) and found through /proc.
Run: `pytest -q tests/e2e/test_serve_zygote.py`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import pytest

from coreproc import LLM, SamplingParams
from coreproc.base.config import EngineConfig
from coreproc.base.protocol import SpawnServe, SpawnWorker, ZygoteRequest
from coreproc.startup import zygote
from coreproc.startup.prepared import preparable
from coreproc.startup.spawn import wait_prepared, zygote_state
from coreproc.startup.zygote_link import ZYGOTE_SOCKET, code_stamp
from frontend.argv import flag_value
from frontend.launch import zygote_for
from tests.server_util import eventually
from tests.workers.test_preload import _children, start_preload, stop

pytestmark = pytest.mark.e2e

PROMPTS = ["def f(x):", "import os\n"]


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def titled(title: str) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and comm(int(p.name)) == title]


@pytest.fixture(scope="module")
def model(make_ckpt) -> str:
    return str(make_ckpt("llama", hidden=128, layers=2, intermediate=256, vocab=512, heads=4, kv_heads=2))


@pytest.fixture(scope="module")
def preloaded(model, tmp_path_factory):
    sockdir = tmp_path_factory.mktemp("zygote-sockets")
    sockdir.chmod(0o700)
    proc = start_preload(model, sockdir)
    yield sockdir
    stop(proc)


@pytest.fixture(scope="module")
def fresh_texts(model) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model, dtype="float32", show_progress=False) as llm:
        return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def launch(model: str, sockdir: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "frontend.launch", "serve", model, "--dtype", "float32", "--port", "0"]
    cmd += ["--load-format", "ipc_cache", "--socket-dir", str(sockdir), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def listening(proc: subprocess.Popen) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            return found.group(1)
    raise AssertionError(
        f"the server did not listen: {proc.wait(30)} {proc.stderr.read() if proc.stderr else ''}"
    )


def served_texts(url: str, model: str) -> list[str]:
    out = []
    for prompt in PROMPTS:
        body = {
            "model": Path(model).name,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        out.append(reply.json()["choices"][0]["text"])
    return out


def test_the_server_is_forked_by_the_zygote_and_answers_like_a_fresh_engine(
    model, preloaded, fresh_texts, tmp_path
):
    trace = tmp_path / "trace.jsonl"
    before = set(titled("ember-serve"))
    proc = launch(model, preloaded, env={**os.environ, "EMBER_STARTUP_TRACE": str(trace)})
    try:
        url = listening(proc)
        (server,) = set(titled("ember-serve")) - before
        zygote_pid = parent(server)
        assert comm(zygote_pid) == "ember-zygote"
        assert _children(proc.pid) == []  # the launcher only stands in
        assert "ember-core" not in [comm(p) for p in _children(server)]  # the core is forked too
        (core,) = [p for p in _children(zygote_pid) if comm(p) == "ember-core"]
        assert served_texts(url, model) == fresh_texts
    finally:
        proc.send_signal(signal.SIGTERM)  # relayed: the server drains and stops its core
        code = proc.wait(60)
    assert code == 0, proc.stderr.read() if proc.stderr else ""
    assert eventually(lambda: alive(server) or alive(core), lambda up: not up, timeout=30) is False
    phases = {(r["process"], r["phase"]) for r in map(json.loads, trace.read_text().splitlines())}
    assert ("ember (launcher)", "fork the server from the zygote") in phases
    assert ("ember serve", "tokenizer") not in phases  # the zygote built it before the launch


def cpus(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list"))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to restrict to one")
def test_the_forked_processes_run_on_the_launchers_cpus(model, preloaded):
    """`taskset -c N ember serve ...`: the server, its core and its worker, all forked by the zygote,
    run on CPU N as a server started by the launcher itself would."""
    first = min(os.sched_getaffinity(0))
    before = set(titled("ember-serve"))
    cmd = [sys.executable, "-m", "frontend.launch", "serve", model, "--dtype", "float32", "--port", "0"]
    cmd += ["--load-format", "ipc_cache", "--socket-dir", str(preloaded)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, preexec_fn=lambda: os.sched_setaffinity(0, {first})
    )
    try:
        listening(proc)
        (server,) = set(titled("ember-serve")) - before
        forked = [p for p in _children(parent(server)) if comm(p) in ("ember-core", "ember-worker-0")]
        assert len(forked) == 2 and {cpus(p) for p in [server, *forked]} == {str(first)}
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_a_killed_launcher_takes_its_server_down(model, preloaded):
    before = set(titled("ember-serve"))
    proc = launch(model, preloaded)
    listening(proc)
    (server,) = set(titled("ember-serve")) - before
    proc.kill()
    proc.wait(10)
    assert eventually(lambda: alive(server), lambda up: not up, timeout=60) is False


def test_a_failing_server_exits_with_its_status_and_one_line(model, preloaded):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = launch(model, preloaded, "--port", str(port))
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert f"ember serve: error: cannot listen on 127.0.0.1:{port}" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("flags", [["--no-serve-zygote"], ["--no-serve-zygote", "--no-worker-zygote"]])
def test_without_the_zygote_the_server_runs_in_the_launcher(model, preloaded, flags):
    """--no-serve-zygote: the launcher serves itself (its core still forked by the zygote);
    --no-worker-zygote as well: every process is a fresh child, as without `ember preload`."""
    before = set(titled("ember-serve"))
    proc = launch(model, preloaded, *flags)
    try:
        url = listening(proc)
        assert set(titled("ember-serve")) == before
        children = [comm(p) for p in _children(proc.pid)]
        assert children == (["ember-core"] if "--no-worker-zygote" in flags else [])
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


@pytest.mark.unit
@pytest.mark.parametrize(
    "argv, forked",
    [
        (["serve", "m", "--load-format", "ipc_cache"], True),
        (["serve", "m", "--load-format=ipc_cache"], True),
        (["--log-level", "INFO", "serve", "--load-format", "ipc_cache"], True),
        (["serve", "m"], False),
        (["serve", "m", "--load-format", "auto"], False),
        (["generate", "hi", "--load-format", "ipc_cache"], False),
        (["serve", "m", "--load-format", "ipc_cache", "--no-serve-zygote"], False),
        (["serve", "m", "--load-format", "ipc_cache", "--snapshot-park", "d"], False),
        (["serve", "--load-format", "ipc_cache", "--help"], False),
    ],
)
def test_which_commands_are_forked(argv, forked, tmp_path):
    (tmp_path / "zygote.sock").touch()
    assert (zygote_for([*argv, "--socket-dir", str(tmp_path)]) is not None) is forked
    assert zygote_for(["serve", "--load-format", "ipc_cache", "--socket-dir", str(tmp_path / "none")]) is None
    assert flag_value(["--a", "1", "--a=2"], "--a") == "2"


@pytest.mark.unit
def test_the_zygote_refuses_another_python_install_or_code():
    import frontend

    package, code = str(Path(frontend.__file__).parent), code_stamp()
    mine = SpawnServe(argv=[], env={}, cwd="/", executable=sys.executable, package=package, code=code)
    assert zygote.refusal(mine, code) is None
    other_python = msgspec.structs.replace(mine, executable="/bin/sh")
    assert "not /bin/sh" in (zygote.refusal(other_python, code) or "")
    other_install = msgspec.structs.replace(mine, package="/elsewhere")
    assert "/elsewhere" in (zygote.refusal(other_install, code) or "")
    assert "code changed" in (zygote.refusal(mine, "0-1") or "")
    worker = SpawnWorker(argv=[], config=b"", code=code)
    assert zygote.refusal(worker, code) is None
    assert "code changed" in (zygote.refusal(worker, "0-1") or "")
    assert "unknown role" in (zygote.refusal(msgspec.structs.replace(worker, role="x"), code) or "")


@pytest.mark.unit
def test_the_launchers_json_request_is_the_protocols_spawn_serve(monkeypatch):
    """The launcher writes `SpawnServe` with the standard library: the zygote must read the same
    message the protocol defines (every field, no extra one)."""
    import frontend
    from frontend.launch import spawn_serve

    monkeypatch.setenv("EMBER_X", "1")
    argv = ["serve", "m", "--load-format", "ipc_cache"]
    body = json.dumps(spawn_serve(argv, "123-4")).encode()
    got = msgspec.json.decode(body, type=ZygoteRequest)
    assert got == SpawnServe(
        argv=argv,
        env=dict(os.environ),
        cwd=os.getcwd(),
        executable=sys.executable,
        package=str(Path(frontend.__file__).parent),
        code="123-4",
        affinity=sorted(os.sched_getaffinity(0)),
    )
    assert set(json.loads(body)) == {"type", *SpawnServe.__struct_fields__}


@pytest.mark.unit
def test_a_zygote_of_an_older_ember_is_refused_in_one_line(tmp_path):
    """A zygote started before an upgrade that changed its wire (it answered msgpack) makes the
    requester start its process itself: a RuntimeError its callers handle, not a decode error."""
    import threading

    from coreproc.base.channel import recv_frame, send_msg
    from coreproc.base.protocol import SpawnReply
    from coreproc.startup.zygote_link import fork_from

    path = tmp_path / "zygote.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def old_zygote() -> None:
        conn, _ = listener.accept()
        with conn:
            recv_frame(conn)
            send_msg(conn, SpawnReply(error="no"))  # msgpack, as zygotes did before

    serving = threading.Thread(target=old_zygote)
    serving.start()
    try:
        with pytest.raises(RuntimeError, match="restart ember preload"):
            fork_from(path, b'{"type": "SpawnServe"}', [])
    finally:
        serving.join(10)
        listener.close()


# ------------------------------------------------- the worker the zygote prepares for the next restart

PREPARED_WAIT_S = 120.0  # a slow host prepares a tiny model in a second or two


def serve_once(model: str, sockdir: Path, trace: Path | None = None) -> tuple[list[str], int]:
    """One server's answers to PROMPTS and its worker's pid; the server stopped after."""
    env = {**os.environ, "EMBER_STARTUP_TRACE": str(trace)} if trace else None
    before = set(titled("ember-worker-0"))
    proc = launch(model, sockdir, env=env)
    try:
        url = listening(proc)
        (worker,) = set(titled("ember-worker-0")) - before
        return served_texts(url, model), worker
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""


def prepared_pid(sockdir: Path) -> int:
    assert wait_prepared(sockdir / ZYGOTE_SOCKET, PREPARED_WAIT_S), "the zygote prepared no worker"
    pid = zygote_state(sockdir / ZYGOTE_SOCKET).prepared_pid
    assert comm(pid) == "ember-prepared" and comm(parent(pid)) == "ember-zygote"
    return pid


def test_a_restart_takes_the_prepared_worker_and_answers_like_a_fresh_engine(
    model, preloaded, fresh_texts, tmp_path
):
    texts, first = serve_once(model, preloaded)  # the first start after preload: a forked worker
    assert texts == fresh_texts
    waiting = prepared_pid(preloaded)
    assert waiting != first
    trace = tmp_path / "trace.jsonl"
    texts, worker = serve_once(model, preloaded, trace)
    assert worker == waiting  # the restart's worker is the one prepared before it came
    assert texts == fresh_texts
    phases = [(r["process"], r["phase"]) for r in map(json.loads, trace.read_text().splitlines())]
    worker_phases = [phase for process, phase in phases if process == "ember-worker-0"]
    assert worker_phases[0] == "take the prepared worker"
    assert "load weights" not in worker_phases  # mapped, built and faulted in before the launch
    assert prepared_pid(preloaded) not in (first, worker)  # and the next restart's is prepared


def test_a_checkpoint_changed_since_is_loaded_afresh(model, preloaded, fresh_texts):
    serve_once(model, preloaded)
    waiting = prepared_pid(preloaded)
    config = Path(model) / "config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 1_000_000_000))
    texts, worker = serve_once(model, preloaded)
    assert worker != waiting  # it refused (the file's stamp changed) and exited
    assert texts == fresh_texts  # the same content: the forked worker still maps the cache


@pytest.mark.unit
def test_what_a_worker_is_prepared_for(model):
    config = EngineConfig.create(model=model, dtype="float32", load_format="ipc_cache")
    argv = ["--rank", "0", "--endpoint", "ipc:///x", "--runtime-dir", "/x", "--parent-pid", "1"]

    def key(cfg: EngineConfig = config, **changes: object) -> str:
        fields = {"argv": argv, "config": msgspec.json.encode(cfg), "env": {"OMP_NUM_THREADS": "2"}}
        return preparable(SpawnWorker(**{**fields, **changes}))  # type: ignore[arg-type]

    assert key() and key() == key(env={"OMP_NUM_THREADS": "2", "EMBER_STARTUP_TRACE": "/t"})
    assert key() == key(argv=[*argv[:3], "ipc:///y", *argv[4:]])  # the launch's own paths
    assert key() != key(env={"OMP_NUM_THREADS": "1"})
    assert key() != key(affinity=[0])
    other = EngineConfig.create(model=model, dtype="float32", load_format="ipc_cache", max_model_len=64)
    assert key() != key(config=msgspec.json.encode(other))
    assert key(role="core") == ""
    for changed in (
        EngineConfig.create(model=model, dtype="float32"),  # weights from disk
        EngineConfig.create(model=model, dtype="float32", load_format="ipc_cache", tensor_parallel_size=2),
    ):
        assert key(config=msgspec.json.encode(changed)) == ""


@pytest.mark.unit
def test_a_worker_prepared_only_from_the_cache_never_loads_from_disk(model, tmp_path, monkeypatch):
    """Where the cache does not answer, preparing fails at once: a prepared worker holding a private
    copy of the weights read from disk would double the host's memory."""
    import workers.worker as worker_module
    from workers.worker import Worker

    def no_disk(*_: object, **__: object) -> None:
        raise AssertionError("loaded from disk")

    monkeypatch.setattr(worker_module, "build_model", no_disk)
    sockets = tmp_path / "none"
    sockets.mkdir(mode=0o700)
    config = EngineConfig.create(
        model=model, dtype="float32", load_format="ipc_cache", socket_dir=str(sockets)
    )
    with pytest.raises(RuntimeError, match="not the preload cache's"):
        Worker(config).prepare(show_progress=False, cache_only=True)
