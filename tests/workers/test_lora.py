"""LoRA adapters: greedy tokens equal transformers + PEFT (`PeftModel`), adapters mixed in one batch.

Adapters are made here with `peft` (random non-zero A and B, several ranks and target sets), on a tiny
random Llama and on the real SmolLM2-135M. Also: more adapters than slots (the scheduler mixes at most
`max_loras` per step), reloading a name with other weights (no stale KV), an adapter named like a
cache salt, and the refusals (missing folder, rank above the limit, unsupported targets, DoRA, too many
adapters, unknown names, LoRA not enabled). Run: `pytest -q tests/workers/test_lora.py`.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from coreproc import LLM, SamplingParams
from coreproc.base.lora import LoRAError

pytestmark = pytest.mark.model

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
ATTENTION = ["q_proj", "v_proj"]
EVERYTHING = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, targets, rsLoRA) of the adapters a mixed batch uses
ADAPTERS = {
    "attn-r2": (2, ATTENTION, False),
    "all-r8": (8, EVERYTHING, False),
    "mlp-r4": (4, ["gate_proj", "up_proj", "down_proj"], True),
    "out-r16": (16, ["o_proj", "down_proj", "k_proj"], False),
}


def make_adapter(
    base: Path, out: Path, rank: int, targets: list[str], seed: int, rslora: bool = False, **kw
) -> Path:
    """A PEFT LoRA folder with random (non-zero) A and B, scaled so it changes the output visibly."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, use_rslora=rslora, **kw
    )
    peft.get_peft_model(model, config).save_pretrained(out)
    return out


@lru_cache(maxsize=16)
def _peft_model(base: str, adapter: str | None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is None:
        return model.eval()
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter).eval()


@torch.inference_mode()
def peft_greedy(base: Path, adapter: Path | None, prompt: list[int]) -> list[int]:
    model = _peft_model(str(base), None if adapter is None else str(adapter))
    ids = torch.tensor([prompt])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=MAX_NEW,
        min_new_tokens=MAX_NEW,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def base(make_ckpt) -> Path:
    return make_ckpt("llama")


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(base, root / name, rank, targets, seed, rslora)
        for seed, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items())
    }


def prompts(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok(t).input_ids for t in ("def add(a, b):", "import numpy as np\n", "class Tree:", "for x in")]


def engine(base: Path, adapters: dict[str, Path], **kw) -> LLM:
    modules = [f"{name}={path}" for name, path in adapters.items()]
    return LLM(str(base), dtype="float32", enable_lora=True, lora_modules=modules, show_progress=False, **kw)


@pytest.mark.parametrize("max_loras", [4, 2])
def test_mixed_adapters_equal_peft(base: Path, adapters: dict[str, Path], max_loras: int) -> None:
    """Every prompt with every adapter and without, in one generate call: four adapters and the base
    model mixed in the batch (with 2 slots, the scheduler holds back requests of a third adapter)."""
    with engine(base, adapters, max_loras=max_loras, max_cpu_loras=4) as llm:
        ps = prompts(llm)
        names = [None, *adapters]
        jobs = [(p, name) for p in ps for name in names]
        outs = llm.generate([p for p, _ in jobs], GREEDY, use_tqdm=False, lora_request=[n for _, n in jobs])
        for (p, name), out in zip(jobs, outs):
            expected = peft_greedy(base, None if name is None else adapters[name], p)
            assert out.outputs[0].token_ids == expected, name
        base_tokens = [o.outputs[0].token_ids for (_, n), o in zip(jobs, outs) if n is None]
        adapted = [o.outputs[0].token_ids for (_, n), o in zip(jobs, outs) if n == "all-r8"]
        assert base_tokens != adapted  # the adapters matter


def test_reloading_a_name_never_reuses_old_kv_and_names_never_meet_salts(
    base: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    other = make_adapter(base, tmp_path / "other", 8, EVERYTHING, seed=99)
    with engine(base, {"x": adapters["all-r8"]}) as llm:
        prompt = prompts(llm)[2] * 3  # several full blocks
        first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request="x")[0]
        again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request="x")[0]
        assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
        plain = llm.generate([prompt], GREEDY, use_tqdm=False)[0]  # the base model: none of x's KV
        assert plain.num_cached_tokens == 0
        llm.load_lora("x", str(other))  # the same name, other weights
        reloaded = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request="x")[0]
        assert reloaded.num_cached_tokens == 0
        assert reloaded.outputs[0].token_ids == peft_greedy(base, other, prompt)
        llm.unload_lora("x")
        with pytest.raises(ValueError, match="no LoRA adapter named 'x'"):
            llm.generate([prompt], GREEDY, use_tqdm=False, lora_request="x")


@pytest.mark.unit
def test_adapter_name_and_cache_salt_never_share_a_key() -> None:
    from coreproc.base.protocol import EngineRequest, LoRARef
    from coreproc.core.kv_cache import block_extra_keys
    from coreproc.core.request import Request

    def keys(**kw) -> tuple | None:
        req = Request(
            EngineRequest(request_id="r", prompt_token_ids=[1] * 16, sampling_params=GREEDY, **kw), 0
        )
        return block_extra_keys(req, 0, 16)

    assert keys(lora=LoRARef("x", "d")) != keys(cache_salt="x")
    assert keys(lora=LoRARef("x", "d")) != keys(lora=LoRARef("x", "other weights"))


def test_refusals(base: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    big = make_adapter(base, tmp_path / "big", 32, ATTENTION, seed=5)
    embeddings = make_adapter(base, tmp_path / "emb", 4, ["q_proj", "embed_tokens"], seed=6)
    dora = make_adapter(base, tmp_path / "dora", 4, ATTENTION, seed=7, use_dora=True)
    with engine(base, {"a": adapters["attn-r2"]}, max_cpu_loras=4) as llm:
        cases = {
            str(tmp_path / "missing"): "no adapter_config.json",
            str(big): "rank 32 exceeds --max-lora-rank 16",
            str(embeddings): "embed_tokens",
            str(dora): "DoRA adapters are not supported",
        }
        for path, message in cases.items():
            with pytest.raises(LoRAError, match=message):
                llm.load_lora("bad", path)
        for k in range(3):
            llm.load_lora(f"more{k}", str(adapters["mlp-r4"]))
        with pytest.raises(ValueError, match="at most 4 adapters"):
            llm.load_lora("one-too-many", str(adapters["mlp-r4"]))
        with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
            llm.generate([prompts(llm)[0]], GREEDY, use_tqdm=False, lora_request="nope")
        assert llm.stats().num_blocks_in_use == 0
    with LLM(str(base), dtype="float32", show_progress=False) as plain:
        with pytest.raises(ValueError, match="--enable-lora"):
            plain.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request="a")
    cfg = json.loads((adapters["attn-r2"] / "adapter_config.json").read_text())
    assert cfg["r"] == 2  # the fixture made what the names say


@pytest.mark.real
def test_real_smollm2_with_mixed_adapters_equals_peft(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The real SmolLM2-135M: the four adapters of ADAPTERS and the base, in one batch, each prompt's
    greedy tokens equal to PeftModel's."""
    from tools.real_models import prepare

    smollm2 = prepare("smollm2")["hf-v5"]
    root = tmp_path_factory.mktemp("smollm2-adapters")
    made = {
        name: make_adapter(smollm2, root / name, rank, targets, seed, rslora)
        for seed, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items())
    }
    with engine(smollm2, made, max_model_len=512) as llm:
        tok = llm.get_tokenizer()
        texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
        jobs = [(tok(t).input_ids, name) for t in texts for name in (None, *made)]
        outs = llm.generate([p for p, _ in jobs], GREEDY, use_tqdm=False, lora_request=[n for _, n in jobs])
        for (p, name), out in zip(jobs, outs):
            assert out.outputs[0].token_ids == peft_greedy(
                smollm2, None if name is None else made[name], p
            ), name


@pytest.mark.e2e
def test_tensor_parallel_adapters_equal_peft(base: Path, adapters: dict[str, Path]) -> None:
    """Two ranks: A whole and B's rows sharded on column layers, A's columns sharded on row layers."""
    with engine(base, adapters, tensor_parallel_size=2) as llm:
        ps = prompts(llm)[:2]
        jobs = [(p, name) for p in ps for name in (None, "all-r8", "out-r16")]
        outs = llm.generate([p for p, _ in jobs], GREEDY, use_tqdm=False, lora_request=[n for _, n in jobs])
        for (p, name), out in zip(jobs, outs):
            assert out.outputs[0].token_ids == peft_greedy(
                base, None if name is None else adapters[name], p
            ), name


def test_adapters_with_speculation_structured_outputs_and_a_quantized_base(
    base: Path, adapters: dict[str, Path]
) -> None:
    """n-gram speculation keeps PEFT's greedy tokens; a constraint holds with an adapter; an int8 base
    serves adapters (its tokens follow its own weights, so only that it runs and differs is checked)."""
    from coreproc.base.protocol import StructuredSpec

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    with engine(base, adapters, speculative_config=spec) as llm:
        ps = prompts(llm)
        outs = llm.generate(ps, GREEDY, use_tqdm=False, lora_request="all-r8")
        for p, out in zip(ps, outs):
            assert out.outputs[0].token_ids == peft_greedy(base, adapters["all-r8"], p)
    with engine(base, adapters) as llm:
        choice = StructuredSpec(kind="choice", spec=json.dumps(["yes", "no"]))
        params = SamplingParams(temperature=0.0, max_tokens=8, structured=choice)
        out = llm.generate([prompts(llm)[0]], params, use_tqdm=False, lora_request="out-r16")[0]
        assert out.outputs[0].text in ("yes", "no")
    with engine(base, adapters, quantization="int8") as llm:
        ps = prompts(llm)[:2]
        adapted = llm.generate(ps, GREEDY, use_tqdm=False, lora_request="all-r8")
        plain = llm.generate(ps, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in adapted] != [o.outputs[0].token_ids for o in plain]


def test_a_draft_model_speculates_without_the_adapter(tmp_path: Path, steady_step_costs: None) -> None:
    """The bundled model and its draft: the target verifies with the adapter, the draft proposes
    without it, and the greedy tokens stay PEFT's."""
    from coreproc.base.host import default_draft_dir, default_model_dir

    target = default_model_dir()
    adapter = make_adapter(target, tmp_path / "a", 8, EVERYTHING, seed=21)
    spec = {"method": "draft_model", "model": str(default_draft_dir()), "num_speculative_tokens": 3}
    with engine(target, {"a": adapter}, speculative_config=spec) as llm:
        ps = prompts(llm)
        outs = llm.generate(ps, GREEDY, use_tqdm=False, lora_request="a")
        for p, out in zip(ps, outs):
            assert out.outputs[0].token_ids == peft_greedy(target, adapter, p)
        assert llm.stats().spec_num_proposed > 0


def test_reloading_a_name_mid_run_keeps_each_request_on_its_weights(
    base: Path, adapters: dict[str, Path]
) -> None:
    """One slot: a request runs on x's first weights while x is reloaded; the next request with x gets
    the new weights only once the first has finished (two weights of one name never share a step)."""
    from coreproc.base.protocol import EngineRequest, LoRARef

    with engine(base, {"x": adapters["all-r8"]}, max_loras=1) as llm:
        core = llm.engine
        p1, p2 = prompts(llm)[:2]

        def submit(rid: str, prompt: list[int]) -> None:
            core.add_requests(
                [
                    EngineRequest(
                        request_id=rid, prompt_token_ids=prompt, sampling_params=GREEDY, lora=LoRARef("x", "")
                    )
                ]
            )

        submit("old", p1)
        tokens: dict[str, list[int]] = {"old": [], "new": []}
        for out in core.step() + core.step():
            tokens[out.request_id] += out.new_token_ids
        llm.load_lora("x", str(adapters["out-r16"]))
        submit("new", p2)
        while core.has_unfinished_requests():
            for out in core.step():
                assert out.error is None, out.error
                tokens[out.request_id] += out.new_token_ids
        assert tokens["old"] == peft_greedy(base, adapters["all-r8"], p1)
        assert tokens["new"] == peft_greedy(base, adapters["out-r16"], p2)
