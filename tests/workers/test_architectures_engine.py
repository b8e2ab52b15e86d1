"""What works for Llama works for the architectures beyond its shape: quantized weights, an fp8 KV
cache, LoRA adapters (against PEFT), structured outputs and weights mapped from `ember preload`.

The same tiny checkpoints as tests/workers/test_architectures.py (built with transformers' classes).
Per family: int8 weights and an fp8 KV cache keep float32's next token teacher-forced (top-1 agreement
over the continuation, as quantization moves near-ties); a JSON schema and a regex hold; LoRA
adapters on q/v give PEFT's greedy tokens; the preload daemon's mapped weights give the disk
engine's tokens. Run: `pytest -q tests/workers/test_architectures_engine.py`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from coreproc import LLM, SamplingParams
from coreproc.base.protocol import StructuredSpec
from tests.hf_ref import PROMPT_TEXTS, teacher_forced, top1_agreement
from tests.workers import test_moe
from tests.workers.test_architectures import FAMILIES, MAX_NEW, SHAPES
from tests.workers.test_lora import ATTENTION, make_adapter, peft_greedy
from tests.workers.test_preload import free_port, start_preload, stop

pytestmark = pytest.mark.model

QUANTIZED_MIN_TOP1 = 0.85  # int8 weights / fp8 keys and values move a tiny random model's near-ties


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, make_ckpt) -> tuple[str, Path]:
    return request.param, make_ckpt(request.param, **{**SHAPES, **FAMILIES[request.param]})


@pytest.fixture(scope="module")
def continued(family) -> list[tuple[list[int], list[int]]]:
    """Prompts and float32 greedy continuations of them."""
    _, path = family
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    with LLM(str(path), dtype="float32", show_progress=False) as llm:
        prompts = [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS[:6]]
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]


@pytest.mark.parametrize(
    "setup", [{"quantization": "int8"}, {"kv_cache_dtype": "fp8"}], ids=["int8", "fp8-kv"]
)
def test_quantized_weights_and_fp8_kv_agree_teacher_forced(family, continued, setup) -> None:
    """Prompt + float32 continuation through the quantized engine: its top-1 next token at each
    position of the continuation against float32's."""
    _, path = family
    seqs = [p + c for p, c in continued]
    with LLM(str(path), dtype="float32", show_progress=False, **setup) as llm:
        ours = teacher_forced(llm, seqs)
    hits, total, _ = top1_agreement(ours, seqs, [len(p) for p, _ in continued])
    print(f"{family[0]} {setup}: top-1 {hits / total:.3f} over {total} positions")
    assert hits / total >= QUANTIZED_MIN_TOP1


def test_structured_outputs_hold(family) -> None:
    """A JSON schema, a regex and a choice constrain each family's output: the regex and the choice
    complete, the object validates when finished (a random model may pad it with whitespace until
    max_tokens: then it is the start of an object)."""
    _, path = family
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    specs = [
        StructuredSpec(kind="json", spec=json.dumps(schema)),
        StructuredSpec(kind="regex", spec=r"[a-f]{3}-\d{2}"),
        StructuredSpec(kind="choice", spec='["red", "green", "blue"]'),
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=200, structured=s) for s in specs]
    with LLM(str(path), dtype="float32", show_progress=False) as llm:
        outs = [r.outputs[0] for r in llm.generate(PROMPT_TEXTS[:3], params, use_tqdm=False)]
    if outs[0].finish_reason == "stop":
        value = json.loads(outs[0].text)
        assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99 and isinstance(value["ok"], bool)
    else:
        assert outs[0].finish_reason == "length" and outs[0].text.lstrip().startswith("{")
    assert re.fullmatch(r"[a-f]{3}-\d{2}", outs[1].text) and outs[2].text in ("red", "green", "blue")
    assert outs[1].finish_reason == outs[2].finish_reason == "stop"


def test_lora_adapters_give_pefts_tokens(family, tmp_path: Path) -> None:
    """A rank-4 adapter on q_proj and v_proj (Phi-3's fused qkv_proj: the whole projection) served beside
    the base model: each request gets PEFT's greedy tokens for its own weights, and the adapter moves
    the logprobs."""
    arch, path = family
    targets = ["qkv_proj"] if arch == "phi3" else ATTENTION
    adapter = make_adapter(path, tmp_path / "a", 4, targets, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=0)
    runs = {}
    with LLM(str(path), dtype="float32", enable_lora=True, max_lora_rank=8, show_progress=False) as llm:
        llm.load_lora("a", str(adapter))
        prompts = [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS[:2]]
        for name in ("a", None):
            outs = [o.outputs[0] for o in llm.generate(prompts, params, lora_request=name, use_tqdm=False)]
            runs[name] = [list(o.token_ids) for o in outs], [o.logprobs for o in outs]
    assert runs["a"][0] == [peft_greedy(path, adapter, p)[:8] for p in prompts]
    assert runs[None][0] == [peft_greedy(path, None, p)[:8] for p in prompts]
    assert runs["a"][1] != runs[None][1]


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "olmo2", "glm4_moe"])
def test_preload_daemon_weights_give_the_disk_tokens(arch: str, make_ckpt, tmp_path: Path) -> None:
    """`ember preload` holds the weights (Gemma's 1 + w norms folded, Phi-3's fused projections, OLMo 2's
    norms, GLM-4.5's experts packed for the native one-call MoE layer in bf16) and an engine mapping
    them generates what one loading from disk does."""
    moe = arch in test_moe.FAMILIES
    shape = {**test_moe.SHAPES, **test_moe.FAMILIES[arch]} if moe else {**SHAPES, **FAMILIES[arch]}
    path = str(make_ckpt(arch, **shape))
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)

    def run(**kw) -> tuple[list[list[int]], str]:
        with LLM(path, dtype="bfloat16" if moe else "float32", show_progress=False, **kw) as llm:
            outs = llm.generate(PROMPT_TEXTS[:3], params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs], llm.engine.executor.ready[0].weight_source

    sockets = tmp_path / "sockets"
    sockets.mkdir(mode=0o700)
    dtype = ["--dtype", "bfloat16"] if moe else []
    daemon = start_preload(path, sockets, "--health-port", str(free_port()), *dtype)
    try:
        mapped, source = run(load_format="ipc_cache", socket_dir=str(sockets))
    finally:
        stop(daemon)
    assert source == "ipc_cache"
    assert mapped == run()[0]


@pytest.mark.parametrize("target", ["gemma3", "mistral"])
def test_a_draft_model_speculates_for_a_sliding_window_target(
    target: str, make_ckpt, steady_step_costs
) -> None:
    """A Llama draft proposing for Gemma 3 (its KV on the global group's block tables) and for an
    all-sliding Mistral (whose windows then keep every block, as the draft reads every position):
    greedy tokens are the target's alone, with proposals accepted."""
    shape = {**SHAPES, **FAMILIES["gemma3"]} if target == "gemma3" else {**SHAPES, "sliding_window": 8}
    path = str(make_ckpt(target, **shape))
    draft = str(make_ckpt("llama", **SHAPES, layers=1))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    runs = []
    for extra in ({}, {"speculative_config": spec}):
        with LLM(path, dtype="float32", block_size=4, show_progress=False, **extra) as llm:
            prompts = [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS[:4]]
            runs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])
            stats, windows = llm.stats(), set(llm.engine.scheduler.kv.windows)
    assert windows == ({None, 8} if target == "gemma3" else {None})
    assert runs[0] == runs[1]
    assert stats.spec_num_proposed > 0
