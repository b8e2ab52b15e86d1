"""Pipeline parallelism: stages of layers in worker processes, micro-batches in flight, faults.

Greedy tokens (and logprobs) with `--pipeline-parallel-size 2` equal transformers' and the single-device
engine's, with several micro-batches really in flight, under chunked prefill and preemption, with a
custom layer partition, a tied LM head on the last stage, tensor parallelism inside each stage, n-gram
speculation, structured outputs and logits processors; bad partitions and unsupported features are
refused in one line; a killed stage fails its requests instead of hanging. The scheduler's pipelined
order is checked without a model: micro-batches are disjoint, in-flight requests are never preempted,
every request finishes.
Run: `pytest -q tests/workers/test_pipeline_parallel.py`.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import deque
from pathlib import Path

import pytest
import torch

from coreproc import LLM, SamplingParams
from coreproc.base.config import ConfigError, EngineConfig, ParallelConfig
from coreproc.base.protocol import EngineRequest, StructuredSpec
from coreproc.core.scheduler import Scheduler
from kernels import AttentionMetadata
from tests.e2e.test_multiproc import check_killed_worker
from tests.hf_ref import PROMPT_TEXTS, check_logprobs_close, check_outputs_equal, hf_greedy
from tests.sched_util import VOCAB, check_invariants, fake_runner_output, make_config
from workers.models import fused_decode
from workers.parallel import PPGroup
from workers.pipeline import StageForward
from workers.worker import Worker

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=0)
LONG = SamplingParams(temperature=0.0, max_tokens=800, ignore_eos=True)


@pytest.fixture(scope="module")
def llama4(make_ckpt) -> Path:
    """A four-layer Llama: room for uneven partitions."""
    return make_ckpt("llama", layers=4)


def generate(
    path: Path, prompts: list[str], params: SamplingParams = GREEDY, **engine
) -> tuple[list, object]:
    """(outputs, stats) of one engine run."""
    with LLM(str(path), dtype="float32", show_progress=False, **engine) as llm:
        return llm.generate(prompts, params, use_tqdm=False), llm.stats()


def check_matches_hf(path: Path, outs: list) -> None:
    """Tokens equal transformers' greedy ones, logprobs within 1e-4."""
    ref = [hf_greedy(str(path), o.prompt_token_ids, MAX_NEW) for o in outs]
    check_outputs_equal([o.outputs[0].token_ids for o in outs], [r[0] for r in ref])
    ours = [[next(iter(pos.values())).logprob for pos in o.outputs[0].logprobs] for o in outs]
    check_logprobs_close(ours, [r[1] for r in ref])


SETUPS = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=16),
    "preempting": dict(block_size=8, max_model_len=128, num_kv_blocks=20, max_num_batched_tokens=64),
}


@pytest.mark.e2e
@pytest.mark.parametrize(
    "arch, setup", [("llama", "default"), ("qwen2", "default"), ("llama", "chunked"), ("llama", "preempting")]
)
def test_two_stages_equal_transformers_and_one_stage(make_ckpt, arch, setup):
    """10 prompts of different lengths; qwen2 ties its head to the embedding, which the last stage then
    holds too. Several micro-batches are in flight at once."""
    path = make_ckpt(arch, layers=4)
    outs, stats = generate(path, PROMPT_TEXTS, pipeline_parallel_size=2, **SETUPS[setup])
    check_matches_hf(path, outs)
    assert stats.max_steps_in_flight == 2, "both stages should have had a micro-batch"
    assert stats.num_blocks_in_use == 0
    if setup == "preempting":
        assert stats.num_preemptions > 0, "the tiny KV cache should force preemption"
    if setup == "default":
        one, one_stats = generate(path, PROMPT_TEXTS, **SETUPS[setup])
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in one]
        assert one_stats.max_steps_in_flight == 1


@pytest.mark.e2e
@pytest.mark.parametrize("partition", ["1,3", "3,1"])
def test_custom_layer_partition(llama4, partition):
    outs, stats = generate(llama4, PROMPT_TEXTS[:6], pipeline_parallel_size=2, pp_layer_partition=partition)
    check_matches_hf(llama4, outs)
    assert stats.max_steps_in_flight == 2


@pytest.mark.e2e
def test_pipeline_with_tensor_parallel_stages(make_ckpt):
    """PP=2 x TP=2: four workers; each stage's pair shards its layers (qwen2: q/k/v bias, tied head)."""
    path = make_ckpt("qwen2", layers=4)
    outs, stats = generate(path, PROMPT_TEXTS[:6], pipeline_parallel_size=2, tensor_parallel_size=2)
    check_matches_hf(path, outs)
    assert stats.max_steps_in_flight == 2


@pytest.mark.e2e
def test_speculation_grammars_and_logits_processors_run_on_the_last_stage(llama4):
    """N-gram proposals are verified, grammars and logits processors applied where sampling happens;
    the tokens are the single-device engine's. With adaptive proposal lengths the plans follow the
    measured step times (a micro-batch holds half the requests, and timings vary by CPU and load), so
    their counters are printed, not compared; with a fixed plan (every request proposes 3 tokens each
    step) the counters depend on the tokens alone and are equal."""
    prompts = ["x x x x x x", "import os\nimport sys\nimport os\n", "for i in range(3): for i in"]
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    for adaptive in (True, False):
        spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "adaptive": adaptive})
        one, one_stats = generate(llama4, prompts, params, speculative_config=spec)
        two, two_stats = generate(llama4, prompts, params, speculative_config=spec, pipeline_parallel_size=2)
        assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
        print(
            f"adaptive={adaptive}: accepted {one_stats.spec_num_accepted}/{one_stats.spec_num_proposed} "
            f"on one stage, {two_stats.spec_num_accepted}/{two_stats.spec_num_proposed} on two"
        )
    # the fixed plan: proposals were made and verified on the last stage, exactly as on one device
    counters = [(s.spec_num_proposed, s.spec_num_accepted) for s in (one_stats, two_stats)]
    assert counters[0] == counters[1] and counters[0][1] > 0, counters
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    constrained = SamplingParams(
        temperature=0.0, max_tokens=30, structured=StructuredSpec(kind="json", spec=json.dumps(schema))
    )
    one, _ = generate(llama4, prompts, constrained)
    two, _ = generate(llama4, prompts, constrained, pipeline_parallel_size=2)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    assert all(o.outputs[0].text.lstrip().startswith("{") for o in two)
    allowed = SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=[7, 11, 13])
    two, _ = generate(llama4, prompts, allowed, pipeline_parallel_size=2)
    assert all(set(o.outputs[0].token_ids) <= {7, 11, 13} for o in two)


@pytest.mark.model
def test_stages_compose_to_the_whole_model_on_the_one_call_layers(make_ckpt, monkeypatch):
    """In one process, no links: stage 0's output fed to stage 1 equals the whole model's hidden states
    bit for bit, each stage running its own layers through the one-call decode path (bf16 on CPU)."""
    from kernels.native import load_native

    if load_native() is not None:
        pytest.skip(f"native CPU ops unavailable: {load_native()}")
    monkeypatch.setenv("EMBER_CPU_KERNELS", "native")  # the path under test, whatever the suite runs
    path = str(make_ckpt("llama", layers=4, dtype="bfloat16"))
    setup = dict(dtype="bfloat16", device="cpu", num_kv_blocks=8, max_model_len=128)
    whole = Worker(EngineConfig.create(path, **setup))
    config = EngineConfig.create(path, pipeline_parallel_size=2, pp_layer_partition="1,3", **setup)
    stages = [Worker(config, pp=PPGroup(s, 2, *config.parallel.stage_layers(4)[s])) for s in (0, 1)]
    hidden = None
    for worker in [whole, *stages]:
        worker.load(show_progress=False)
    ids = torch.arange(5, 15)  # a 10-token prefill: short enough for the one-call layers
    for stage in stages:
        assert stage.runner is not None and isinstance(stage.runner.forward, StageForward)
        assert isinstance(stage.runner.forward.body, fused_decode.FusedDecode)
        meta = AttentionMetadata.build([10], [10], [[0]], 16, torch.device("cpu"))
        hidden = stage.runner.forward.body(ids, torch.arange(10), stage.runner.kv_caches, meta, hidden)
    assert whole.runner is not None
    meta = AttentionMetadata.build([10], [10], [[0]], 16, torch.device("cpu"))
    assert torch.equal(hidden, whole.runner.forward(ids, torch.arange(10), whole.runner.kv_caches, meta))


@pytest.mark.unit
@pytest.mark.parametrize(
    "options, message",
    [
        (dict(pipeline_parallel_size=3), "exceeds the model's 2 layers"),
        (dict(pipeline_parallel_size=2, pp_layer_partition="1,2"), "covers 3 layers; the model has 2"),
        (dict(pipeline_parallel_size=2, pp_layer_partition="2"), "has 1 stages"),
        (dict(pipeline_parallel_size=2, pp_layer_partition="0,2"), "at least one layer"),
        (dict(pipeline_parallel_size=2, pp_layer_partition="a,b"), "comma-separated integers"),
        (dict(pipeline_parallel_size=2, load_format="ipc_cache"), "does not support pipeline parallelism"),
        (dict(pipeline_parallel_size=2, enable_lora=True), "LoRA adapters .* does not support pipeline"),
        (dict(pipeline_parallel_size=2, kv_cache_dtype="fp8"), "fp8 KV cache .* does not support pipeline"),
    ],
)
def test_bad_partitions_and_unsupported_features_are_refused(make_ckpt, options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.create(str(make_ckpt("llama")), **options)


@pytest.mark.unit
@pytest.mark.parametrize(
    "layers, pp, partition, stages",
    [
        (4, 2, None, [(0, 2), (2, 4)]),
        (5, 2, None, [(0, 3), (3, 5)]),  # the spare layer goes before the last stage (it has the head)
        (4, 3, None, [(0, 1), (1, 3), (3, 4)]),
        (4, 2, "1,3", [(0, 1), (1, 4)]),
    ],
)
def test_stage_layers(layers, pp, partition, stages):
    assert (
        ParallelConfig(pipeline_parallel_size=pp, pp_layer_partition=partition).stage_layers(layers) == stages
    )


@pytest.mark.e2e
@pytest.mark.parametrize("victim", [0, 1])
def test_killed_stage_fails_requests_and_leaves_no_process(llama4, victim):
    """A stage killed while the other waits on it (or sends to it): errors within seconds, no hang."""
    prompts = [[5 + i, 6, 7, 8] for i in range(3)]
    check_killed_worker(
        EngineConfig.create(str(llama4), dtype="float32", pipeline_parallel_size=2), prompts, victim
    )


@pytest.mark.unit
@pytest.mark.parametrize("seed", range(6))
def test_pipelined_schedule_keeps_micro_batches_disjoint(seed):
    """The engine's pipelined order without a model: up to `depth` steps in flight, outputs applied
    oldest first. In-flight requests are never scheduled again or preempted (a small KV cache forces
    preemption), one step takes at most 1/depth of the active requests, and everything finishes."""
    rng = random.Random(seed)
    depth = 2 + seed % 2
    cfg = make_config(budget=24, max_num_seqs=6, max_model_len=64)
    cfg = dataclasses.replace(cfg, parallel=ParallelConfig(pipeline_parallel_size=depth))
    sched = Scheduler(cfg, 24)
    for i in range(10):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 30))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 20), ignore_eos=True)
        sched.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params))
    in_flight: deque = deque()
    most_in_flight = 0
    for _ in range(2000):
        if not sched.has_unfinished_requests() and not in_flight:
            break
        busy = {rid for out, _ in in_flight for rid in out.num_scheduled_tokens}
        blocks = {rid: [list(g) for g in b] for rid, b in sched.kv.req_blocks.items() if rid in busy}
        active = len(sched.running) + len(sched.waiting)
        out = sched.schedule()
        check_invariants(sched, out)
        assert not busy & set(out.num_scheduled_tokens), "a request in flight was scheduled again"
        assert all(sched.kv.req_blocks.get(rid) == b for rid, b in blocks.items()), (
            "in-flight request lost blocks"
        )
        assert len(out.num_scheduled_tokens) <= -(-active // depth)
        if out.total_num_scheduled_tokens:
            in_flight.append((out, fake_runner_output(sched, out, rng)))
            most_in_flight = max(most_in_flight, len(in_flight))
        if len(in_flight) == depth or (in_flight and not out.total_num_scheduled_tokens):
            done, output = in_flight.popleft()
            sched.update_from_output(done, output)
    assert not sched.has_unfinished_requests() and not in_flight
    assert sched.kv.num_blocks_in_use() == 0
    assert most_in_flight == depth
    assert sched.counters.num_preemptions > 0, "the small KV cache should force preemption"
