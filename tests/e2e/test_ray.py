"""The `ray` executor backend on a real two-node Ray cluster started on this host.

Each node of `ray.cluster_utils.Cluster` has its own raylet, object store and one CPU, so TP=2 puts one
rank on each node and the ranks' gloo group crosses nodes. Shown: greedy outputs equal the local (mp)
TP=2 engine through the offline `LLM` (the caller already runs Ray, as inside a Ray job) and through a
real `ember-core` (which joins the cluster by RAY_ADDRESS); a node killed while requests run fails
them with an error naming the rank and node, within a bound, and frees the cluster; without Ray the
flag is one line saying what to install. Run: `pytest -q tests/e2e/test_ray.py` (Ray: `pip install
'ember-serve[ray]'`; the cluster tests skip without it).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from coreproc import LLM, SamplingParams
from coreproc.base.config import EngineConfig
from coreproc.base.errors import ConfigError
from coreproc.client.sdk import EngineClient, EngineDeadError
from coreproc.startup.launcher import CoreProcess
from tests.hf_ref import PROMPT_TEXTS

pytestmark = pytest.mark.e2e
requires_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
LONG = SamplingParams(temperature=0.0, max_tokens=800, ignore_eos=True)
NODE_ARGS = {"num_cpus": 1, "object_store_memory": 100 * 2**20}
KILL_BOUND_S = 30.0  # a node's death must end its requests within this


@pytest.fixture(scope="module")
def cluster():
    """A head and one more node, one CPU each; this test process is a driver connected to it."""
    import ray
    from ray.cluster_utils import Cluster

    head = {**NODE_ARGS, "resources": {"head": 1}, "include_dashboard": False}
    c = Cluster(initialize_head=True, head_node_args=head)
    c.add_node(**NODE_ARGS, resources={"other": 1})
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def llama(make_ckpt) -> Path:
    return make_ckpt("llama")


def greedy(llama: Path, **options) -> list[list[int]]:
    with LLM(str(llama), dtype="float32", show_progress=False, **options) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPT_TEXTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def local_tp2(llama) -> list[list[int]]:
    """Greedy tokens of the local multiprocess TP=2 engine: the reference."""
    return greedy(llama, tensor_parallel_size=2)


def wait_cpus_free(total: float, timeout: float = 20.0) -> bool:
    """True once the cluster's CPUs are all free again (actors gone, placement group removed)."""
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) == total:
            return True
        time.sleep(0.2)
    return False


def test_without_ray_the_flag_is_one_line_naming_the_extra(llama, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "ray" else find_spec(n, *a))
    with pytest.raises(ConfigError, match=r"pip install 'ember-serve\[ray\]'") as e:
        EngineConfig.create(str(llama), distributed_executor_backend="ray")
    assert "\n" not in str(e.value)
    from coreproc.core.ray_executor import import_ray

    monkeypatch.setitem(__import__("sys").modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'ember-serve\[ray\]'"):
        import_ray()


@requires_ray
@pytest.mark.parametrize("strategy", ["PACK", "SPREAD"])
def test_offline_tp2_one_rank_per_node_equals_local(cluster, llama, local_tp2, strategy):
    options = {"distributed_executor_backend": "ray", "placement_strategy": strategy}
    with LLM(str(llama), dtype="float32", tensor_parallel_size=2, show_progress=False, **options) as llm:
        executor = llm.engine.executor
        assert type(executor).__name__ == "RayExecutor"
        assert len(set(executor.nodes)) == 2, f"one rank per node, got {executor.nodes}"
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPT_TEXTS, GREEDY, use_tqdm=False)]
    assert got == local_tp2
    assert wait_cpus_free(2.0), "shutdown must kill the actors and remove the placement group"


@requires_ray
def test_offline_pipeline_stage_per_node_equals_local(cluster, llama):
    """PP=2: each stage on its own node, hidden states sent between the nodes' actors."""
    got = greedy(llama, pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert got == greedy(llama, pipeline_parallel_size=2)
    assert wait_cpus_free(2.0)


def kill_other_node(cluster) -> float:
    """SIGKILL the raylet and processes of the node that is not the head; returns when it was done."""
    (victim,) = cluster.list_all_nodes()[1:]  # not the head, which holds the cluster's control
    killed_at = time.monotonic()
    cluster.remove_node(victim, allow_graceful=False)
    return killed_at


def replace_other_node(cluster) -> None:
    cluster.add_node(**NODE_ARGS, resources={"other": 1})
    cluster.wait_for_nodes()


@requires_ray
def test_idle_core_notices_a_killed_node(cluster, llama, monkeypatch):
    """No request running: the core's liveness probes find the dead rank and the core exits 1."""
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    options = {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}
    config = EngineConfig.create(str(llama), dtype="float32", **options)
    proc = CoreProcess(config)
    try:
        killed_at = kill_other_node(cluster)
        assert proc.proc.wait(KILL_BOUND_S) == 1
        print(f"idle core: node killed -> core exited in {time.monotonic() - killed_at:.2f}s")
        assert wait_cpus_free(1.0)
    finally:
        proc.stop(grace=0)
        replace_other_node(cluster)


@requires_ray
def test_core_process_on_the_cluster_and_a_killed_node_fails_requests(cluster, llama, local_tp2, monkeypatch):
    """Last in the file: it takes a node away (and puts a fresh one back)."""
    from coreproc.base.tokenizer import load_tokenizer

    tok = load_tokenizer(str(llama))
    prompts = [tok(t).input_ids for t in PROMPT_TEXTS]
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    config = EngineConfig.create(
        str(llama), dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray",
        placement_strategy="SPREAD",
    )  # fmt: skip
    proc = CoreProcess(config)
    try:
        client = EngineClient(proc.address)
        got = [[t for out in client.generate(p, GREEDY) for t in out.new_token_ids] for p in prompts]
        assert got == local_tp2
        streams = [client.generate(p, LONG) for p in prompts[:3]]
        for s in streams:
            next(s)
        killed_at = kill_other_node(cluster)
        for s in streams:
            with pytest.raises(EngineDeadError, match=r"worker [01] on .* \(node [0-9a-f]{8}\)"):
                for _ in s:
                    pass
        elapsed = time.monotonic() - killed_at
        print(f"node killed -> requests failed in {elapsed:.2f}s")
        assert elapsed < KILL_BOUND_S
        assert proc.proc.wait(20) == 1
        client.close()
        assert wait_cpus_free(1.0), "the surviving rank's actor and the placement group must go"
    finally:
        proc.stop(grace=0)
        replace_other_node(cluster)
