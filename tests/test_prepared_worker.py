"""The worker the preload zygote prepares for the next restart: taken by a restart with the same
config, giving the same tokens as a fresh engine; never taken when the checkpoint changed or the
request differs.

A real `ember preload` (tiny Llama, private socket directory) for the module; servers launched as the
`ember` command runs them. Run: `pytest -q tests/test_prepared_worker.py`.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import msgspec
import pytest
from test_preload import start_preload, stop
from test_serve_zygote import comm, launch, listening, parent, served_texts, titled

from coreproc import LLM, SamplingParams
from coreproc.config import EngineConfig
from coreproc.protocol import SpawnWorker
from coreproc.startup.prepared import preparable
from coreproc.startup.spawn import wait_prepared, zygote_state
from coreproc.startup.zygote_link import ZYGOTE_SOCKET

pytestmark = pytest.mark.e2e

PROMPTS = ["def f(x):", "import os\n"]
PREPARED_WAIT_S = 120.0  # a slow host prepares a tiny model in a second or two


@pytest.fixture(scope="module")
def model(make_ckpt) -> str:
    return str(make_ckpt("llama", hidden=128, layers=2, intermediate=256, vocab=512, heads=4, kv_heads=2))


@pytest.fixture(scope="module")
def preloaded(model, tmp_path_factory):
    sockdir = tmp_path_factory.mktemp("prepared-sockets")
    sockdir.chmod(0o700)
    proc = start_preload(model, sockdir)
    yield sockdir
    stop(proc)


@pytest.fixture(scope="module")
def fresh_texts(model) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model, dtype="float32", show_progress=False) as llm:
        return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


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
