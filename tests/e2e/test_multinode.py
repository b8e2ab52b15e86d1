"""Several nodes without Ray: `ember core --nnodes 2` on the head, `ember worker --headless` on the other.

The nodes are two network namespaces joined by a veth pair (made here as root, removed afterwards; the
tests skip with the reason when that is not possible). The head's `ember core` listens for clients on
an ipc path (a file: this test process reaches it from the root namespace); the ranks meet over
torch.distributed (gloo) at the head's address, and the other node's rank reaches the core over TCP
with CurveZMQ keys. Shown: greedy tokens equal the local TP=2 engine (and PP=2, one stage per node);
a link cut (`ip link set ... down`) or the other node killed while requests stream fails every request
within LOST_BOUND_S and the core exits 1, leaving no process behind.
Run: `pytest -q tests/e2e/test_multinode.py` (as root).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coreproc import LLM, SamplingParams
from coreproc.base.ipc import generate_curve_keys
from coreproc.client.sdk import EngineClient, EngineDeadError
from tests.hf_ref import PROMPT_TEXTS
from tests.proc_util import children, cmdline, gone

pytestmark = pytest.mark.e2e

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
LONG = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
# a cut link (3 s heartbeat timeout) or a killed node must fail requests within this: about 3 s here,
# never without the heartbeat; the bound leaves a loaded host room
LOST_BOUND_S = 20.0
START_TIMEOUT_S = 120.0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Namespaces:
    head: str  # namespace names
    other: str
    head_addr: str
    other_addr: str
    head_veth: str
    other_veth: str


@pytest.fixture(scope="module")
def netns() -> Iterator[Namespaces]:
    """Two network namespaces joined by a veth pair on a random 10.231.X.0/24."""
    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root")
    tag = secrets.token_hex(3)
    subnet = f"10.231.{secrets.randbelow(250) + 1}"
    ns = Namespaces(f"emb{tag}h", f"emb{tag}w", f"{subnet}.1", f"{subnet}.2", f"vh{tag}", f"vw{tag}")
    made: list[str] = []
    try:
        for name in (ns.head, ns.other):
            _ip("netns", "add", name)
            made.append(name)
        _ip("link", "add", ns.head_veth, "netns", ns.head, "type", "veth", "peer", "name", ns.other_veth,
            "netns", ns.other)  # fmt: skip
        ends = ((ns.head, ns.head_veth, ns.head_addr), (ns.other, ns.other_veth, ns.other_addr))
        for name, veth, addr in ends:
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", veth)
            _ip("-n", name, "link", "set", veth, "up")
            _ip("-n", name, "link", "set", "lo", "up")
    except (OSError, subprocess.CalledProcessError) as e:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        detail = getattr(e, "stderr", "") or str(e)
        pytest.skip(f"cannot make network namespaces: {detail.strip()}")
    try:
        yield ns
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("keys")
    generate_curve_keys(directory)
    return directory


@pytest.fixture(scope="module")
def llama(make_ckpt) -> Path:
    return make_ckpt("llama")


@pytest.fixture(scope="module")
def prompts(llama: Path) -> list[list[int]]:
    from coreproc.base.tokenizer import load_tokenizer

    tok = load_tokenizer(str(llama))
    return [tok(t).input_ids for t in PROMPT_TEXTS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    core: subprocess.Popen
    worker: subprocess.Popen
    address: str
    client: EngineClient

    def stop(self) -> None:
        self.client.close()
        for proc in (self.core, self.worker):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (self.core, self.worker):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_cluster(ns: Namespaces, keys: Path, llama: Path, tmp_path: Path, *parallel: str) -> Cluster:
    """`ember core` in the head's namespace and `ember worker --headless` in the other's."""
    nodes = ["--nnodes", "2", "--master-addr", ns.head_addr, "--master-port", str(free_port())]
    common = [str(llama), "--dtype", "float32", "--curve-keys", str(keys), *nodes, *parallel]
    cli = [sys.executable, "-m", "frontend.cli"]
    listen = f"ipc://{tmp_path / 'core'}"
    core = subprocess.Popen(
        ["ip", "netns", "exec", ns.head, *cli, "core", *common, "--node-rank", "0", "--listen", listen],
        stdout=subprocess.PIPE,
        text=True,
    )
    worker = subprocess.Popen(["ip", "netns", "exec", ns.other, *cli, "worker", "--headless", *common,
                               "--node-rank", "1"])  # fmt: skip
    assert core.stdout is not None
    line = ""
    deadline = time.monotonic() + START_TIMEOUT_S
    while "listening on" not in line and core.poll() is None and time.monotonic() < deadline:
        line = core.stdout.readline()
    if "listening on" not in line:
        for proc in (core, worker):
            proc.kill()
        raise AssertionError(f"the head did not start (exit {core.poll()})")
    address = line.rsplit(" ", 1)[1].strip()
    client = EngineClient(address, server_key=keys / "server.key", client_key=keys / "client.key_secret")
    return Cluster(core, worker, address, client)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPT_TEXTS, GREEDY, use_tqdm=False)]


def local_greedy(llama: Path, **options: int) -> list[list[int]]:
    with LLM(str(llama), dtype="float32", show_progress=False, **options) as llm:
        return tokens(llm)


def greedy(client: EngineClient, prompts: list[list[int]]) -> list[list[int]]:
    return [[t for out in client.generate(p, GREEDY) for t in out.new_token_ids] for p in prompts]


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def stream_then(cluster: Cluster, prompts: list[list[int]], fault) -> float:
    """Start three long streams, apply `fault`, and return the seconds until every stream failed."""
    streams = [cluster.client.generate(p, LONG) for p in prompts[:3]]
    for s in streams:
        next(s)
    at = time.monotonic()
    fault()
    for s in streams:
        with pytest.raises(EngineDeadError, match=r"lost node 1 at 10\.231\.\d+\.2 \(ranks 1\)"):
            for _ in s:
                pass
    return time.monotonic() - at


@pytest.mark.parametrize("parallel", [("-tp", "2"), ("-pp", "2")], ids=["tp2", "pp2"])
def test_two_nodes_equal_the_local_engine(netns, keys, llama, prompts, tmp_path, parallel):
    size = {"-tp": "tensor_parallel_size", "-pp": "pipeline_parallel_size"}[parallel[0]]
    want = local_greedy(llama, **{size: 2})
    cluster = start_cluster(netns, keys, llama, tmp_path, *parallel)
    try:
        assert greedy(cluster.client, prompts) == want
    finally:
        cluster.stop()
    assert cluster.core.returncode == 0 and cluster.worker.returncode == 0, "SIGTERM: both nodes exit clean"


def test_cut_link_fails_requests_and_nothing_hangs(netns, keys, llama, prompts, tmp_path):
    cluster = start_cluster(netns, keys, llama, tmp_path, "-tp", "2")
    procs = descendants(cluster.core.pid) + descendants(cluster.worker.pid)
    try:

        def cut() -> None:
            _ip("-n", netns.head, "link", "set", netns.head_veth, "down")

        elapsed = stream_then(cluster, prompts, cut)
        print(f"link cut -> every request failed in {elapsed:.2f} s")
        assert elapsed < LOST_BOUND_S
        assert cluster.core.wait(15) == 1, "the core exits 1 once its engine is dead"
        assert cluster.worker.wait(15) == 1, "the other node's ranks give up on the lost head"
        assert gone(procs)
    finally:
        subprocess.run(["ip", "-n", netns.head, "link", "set", netns.head_veth, "up"], capture_output=True)
        cluster.stop()


def test_killed_node_fails_requests_and_nothing_hangs(netns, keys, llama, prompts, tmp_path):
    cluster = start_cluster(netns, keys, llama, tmp_path, "-tp", "2")
    node = [cluster.worker.pid, *descendants(cluster.worker.pid)]
    ranks = [p for p in node if "ember-worker-1" in cmdline(p)]
    assert ranks, "the headless node runs rank 1 as ember-worker-1"
    core_procs = descendants(cluster.core.pid)
    try:

        def kill_node() -> None:
            for pid in node:
                os.kill(pid, signal.SIGKILL)

        elapsed = stream_then(cluster, prompts, kill_node)
        print(f"node killed -> every request failed in {elapsed:.2f} s")
        assert elapsed < LOST_BOUND_S
        assert cluster.core.wait(15) == 1
        assert gone(core_procs)
    finally:
        cluster.stop()


def test_preload_on_each_node_serves_that_nodes_ranks(llama, tmp_path):
    """Two nodes on one host (loopback): each node's `ember preload` holds only its own rank, an engine
    spanning both nodes maps both ranks, and a one-node engine is refused by the fingerprint's placement
    and loads from disk."""
    from tests.workers.test_preload import start_preload, stop

    port = free_port()
    nodes = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    dirs = [tmp_path / f"node{n}" for n in (0, 1)]
    for d in dirs:
        d.mkdir(mode=0o700)
    daemons = [start_preload(str(llama), d, *nodes, "--node-rank", str(n)) for n, d in enumerate(dirs)]
    worker = None
    try:
        for n, d in enumerate(dirs):
            held = [p.name for p in d.glob("*.sock") if p.name != "zygote.sock"]
            assert len(held) == 1 and held[0].endswith(f"-dp0-tp{n}.sock"), held
        want = local_greedy(llama, tensor_parallel_size=2)
        cache = ["--load-format", "ipc_cache"]
        cli = [sys.executable, "-m", "frontend.cli", "worker", "--headless", str(llama), "--dtype", "float32"]
        worker = subprocess.Popen([*cli, *nodes, *cache, "--node-rank", "1", "--socket-dir", str(dirs[1])])
        kw = dict(nnodes=2, master_addr="127.0.0.1", master_port=port, tensor_parallel_size=2)
        with LLM(str(llama), dtype="float32", load_format="ipc_cache", socket_dir=str(dirs[0]),
                 show_progress=False, **kw) as llm:  # fmt: skip
            assert [r.weight_source for r in llm.engine.executor.ready] == ["ipc_cache", "ipc_cache"]
            assert tokens(llm) == want
        worker.wait(20)
        # node 1's daemon holds rank 1 of a two-node engine: a one-node engine's rank 1 must not take it
        with LLM(str(llama), dtype="float32", load_format="ipc_cache", socket_dir=str(dirs[1]),
                 tensor_parallel_size=2, show_progress=False) as llm:  # fmt: skip
            rank1 = llm.engine.executor.ready[1]
            assert rank1.weight_source == "disk"
            assert "nnodes" in rank1.cache_fallback_reason and "node_rank" in rank1.cache_fallback_reason
            assert tokens(llm) == want
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        for proc in daemons:
            stop(proc)
