"""The CPU fast path end to end: bf16 engines on the native ops against Hugging Face and the torch ops.

On the bundled (trained) model in bf16, Ember with the native matmul, decode attention and norm stays
on Hugging Face's float32 greedy path at least as long as Hugging Face's own bf16 `generate()` does,
with logprobs within bf16 noise; and the same engine with EMBER_CPU_KERNELS=torch (every op on its
torch reference) gives the same tokens up to a near-tie (other sum orders round bf16 apart).
fp8_per_tensor on the native fp8 matmul stays as close to the float32 run of the same quantized
weights as fp8 on torch's bf16 ops. Skips where the native ops cannot be built.
Run: `pytest -q tests/workers/test_cpu_fast_path.py`.
"""

from __future__ import annotations

import pytest
import torch

from coreproc import LLM, SamplingParams
from coreproc.base.host import default_model_dir
from tests.hf_ref import PROMPT_TEXTS, Greedy, check_greedy_close, greedy_runs, hf_greedy
from workers.models import fused_decode
from workers.models.ops import NativeCpuOps

pytestmark = pytest.mark.model

MAX_NEW = 16
BF16_LOGPROB_TOL = 0.1  # bf16 rounds every layer's output to 8 bits of mantissa


@pytest.fixture(scope="module", autouse=True)
def native(native_kernels: None) -> None:
    """Every test here is about the native ops (their torch references are asked for by name)."""


def run_greedy(llm: LLM, prompts: list[list[int]]) -> list[Greedy]:
    """Greedy tokens with the top two logprobs at each (a near-tie shows as two close ones)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=2)
    return greedy_runs(llm.generate(prompts, params, use_tqdm=False))


def run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and the logprob of each."""
    runs = run_greedy(llm, prompts)
    return [t for t, _ in runs], [[top[t] for t, top in zip(toks, tops)] for toks, tops in runs]


def assert_logprobs_close(a: list[list[float]], b: list[list[float]]) -> None:
    worst = max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    assert worst <= BF16_LOGPROB_TOL, f"logprobs differ by {worst:.3f}"


def bf16_engine(quantization: str | None = None) -> LLM:
    return LLM(
        str(default_model_dir()),
        dtype="bfloat16",
        quantization=quantization,
        max_num_batched_tokens=64,
        show_progress=False,
    )


@pytest.fixture(scope="module")
def native_run() -> tuple[list[list[int]], list[list[int]], list[list[float]], object, list[Greedy]]:
    with bf16_engine() as llm:
        worker = llm.engine.executor.worker
        prompts = [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS]
        runs = run_greedy(llm, prompts)
        toks = [t for t, _ in runs]
        lps = [[top[t] for t, top in zip(ts, tops)] for ts, tops in runs]
        return prompts, toks, lps, (worker.linear_kernel, worker.backend.name, worker.runner), runs


def agreed(ours: list[list[int]], ref: list[list[int]]) -> list[int]:
    """Per prompt, how many leading tokens two greedy runs share."""
    return [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ours, ref)]


def test_bf16_native_engine_tracks_hf(native_run) -> None:
    """bf16 greedy runs part ways with float32 ones after a while, Hugging Face's own included, so the
    bar is: Ember bf16 follows HF float32 at least as far as HF bf16 does, and its logprobs along the
    shared prefix are within bf16 noise of HF float32's."""
    prompts, toks, lps, (kernel, backend, runner), _ = native_run
    assert (kernel, backend) == ("cpu_bf16", "cpu")
    assert runner.model.model.layers[0].mlp.down_proj.weight.dim() == 3, "linear weights must be packed"
    assert isinstance(runner.model.model.norm.ops, NativeCpuOps)
    assert isinstance(runner.forward, fused_decode.FusedDecode), "decode steps must take the one-call layers"
    ref32 = [hf_greedy(str(default_model_dir()), p, MAX_NEW) for p in prompts]
    ref16 = [hf_greedy(str(default_model_dir()), p, MAX_NEW, torch.bfloat16) for p in prompts]
    ours = agreed(toks, [r[0] for r in ref32])
    theirs = agreed([r[0] for r in ref16], [r[0] for r in ref32])
    assert sum(ours) >= sum(theirs), f"Ember bf16 follows float32 for {ours}, HF bf16 for {theirs}"
    assert sum(ours) >= 0.75 * MAX_NEW * len(prompts)
    assert_logprobs_close([lp[:n] for lp, n in zip(lps, ours)], [r[1][:n] for r, n in zip(ref32, ours)])


def test_bf16_native_matches_torch_ops(native_run, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both round to bf16 after every op but sum in other orders (and the native ones differ by ISA):
    greedy tokens equal with logprobs within bf16 noise, up to a near-tie a rounding may break either
    way."""
    prompts, native = native_run[0], native_run[4]
    monkeypatch.setenv("EMBER_CPU_KERNELS", "torch")
    with bf16_engine() as llm:
        worker = llm.engine.executor.worker
        assert (worker.linear_kernel, worker.backend.name) == ("torch", "torch")
        assert worker.runner.forward is worker.runner.model, "no one-call layers on the torch ops"
        ref = run_greedy(llm, prompts)
    parted = check_greedy_close(native, ref, tie=BF16_LOGPROB_TOL, atol=BF16_LOGPROB_TOL)
    print(f"native against torch ops: {len(prompts) - parted} of {len(prompts)} prompts identical")


def forced_logprobs(llm: LLM, seqs: list[list[int]], skip: list[int]) -> list[float]:
    """Teacher-forced: the logprob of each token of each sequence after its first `skip` tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(seqs, params, use_tqdm=False)
    return [
        lp[tok].logprob
        for o, seq, n in zip(outs, seqs, skip, strict=True)
        for tok, lp in zip(seq[n:], o.prompt_logprobs[n:], strict=True)
    ]


def native_and_torch_errors(
    method: str, seqs: list[list[int]], skip: list[int], ref: list[float], monkeypatch: pytest.MonkeyPatch
) -> tuple[list[float], list[float]]:
    """|logprob - ref| of `method` in bf16 on the native matmul (its weights packed, 3-D) and on the
    torch ops (EMBER_CPU_KERNELS=torch, 2-D weights), teacher-forced along `seqs`."""
    errors = []
    for kernels, dims in ((None, 3), ("torch", 2)):
        if kernels is not None:
            monkeypatch.setenv("EMBER_CPU_KERNELS", kernels)
        with bf16_engine(method) as llm:
            assert llm.engine.executor.worker.runner.model.model.layers[0].mlp.down_proj.weight.dim() == dims
            errors.append([abs(a - b) for a, b in zip(forced_logprobs(llm, seqs, skip), ref, strict=True)])
    return errors[0], errors[1]


def test_fp8_native_tracks_fp8_in_float32(native_run, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_per_tensor on the native fp8 matmul (bf16 activations, float32 accumulation) against the same
    quantized weights computed in float32, teacher-forced along the float32 greedy continuations: its
    logprobs are within bf16 noise and on average about as far from float32 as fp8 on torch's bf16 ops
    (weights dequantized to bf16, then torch's matmul)."""
    prompts = native_run[0]
    fp32 = dict(
        dtype="float32", quantization="fp8_per_tensor", max_num_batched_tokens=64, show_progress=False
    )
    with LLM(str(default_model_dir()), **fp32) as llm:
        toks, _ = run(llm, prompts)
        seqs = [p + t for p, t in zip(prompts, toks, strict=True)]
        skip = [len(p) for p in prompts]
        ref = forced_logprobs(llm, seqs, skip)
    err_ours, err_theirs = native_and_torch_errors("fp8_per_tensor", seqs, skip, ref, monkeypatch)
    assert max(err_ours) <= BF16_LOGPROB_TOL, f"native fp8 logprobs differ by up to {max(err_ours):.3f}"
    # both runs carry bf16 activations, whose rounding dominates (mean ~0.009 each when written)
    assert sum(err_ours) <= 1.25 * sum(err_theirs), (
        f"mean error native {sum(err_ours) / len(ref):.4f}, torch {sum(err_theirs) / len(ref):.4f}"
    )


GEMMA2_CAPS = {"attn_logit_softcapping": 0.5, "final_logit_softcapping": 1.5}  # caps that bind


@pytest.mark.parametrize(
    ("arch", "kwargs", "quantization", "fused"),
    [
        ("bundled", {}, None, True),
        ("bundled", {}, "fp8_per_tensor", True),  # the native fp8 matmul inside the layer
        ("mistral", {"sliding_window": 6}, None, True),  # the window cuts into prompt and output
        ("qwen3", {}, None, True),  # q/k norms per head
        ("gemma3", {"layers": 6, "sliding_window": 6}, None, True),  # sandwich norms, 1 + w, GeGLU, 2 ropes
        ("gemma2", {"layers": 4, "sliding_window": 6, "extra_config": GEMMA2_CAPS}, None, True),  # soft caps
        ("gemma3", {"layers": 6, "sliding_window": 6, "gguf": "Q8_0"}, None, True),  # KV groups, own bits
        ("phi3", {"sliding_window": 6, "gguf": "Q4_0"}, None, True),  # fused qkv / gate_up in own bits
        ("smollm3", {"layers": 4}, None, True),  # a layer without rotary
        ("olmo2", {}, "int8", True),  # post-norms, q/k norms over all heads
        ("granite", {}, None, True),  # the residual multiplier (and the others, outside the layers)
        ("phi3", {"sliding_window": 6}, None, True),  # fused projections, a window on every layer
        ("qwen2", {}, None, True),  # qkv bias
        ("llama", {}, "int8", True),  # the integer-dot matmul inside the layer
        ("llama", {}, "int4", True),
        ("qwen2", {"gguf": "Q5_0"}, None, True),  # a GGUF file's own bits
        ("llama", {"gguf": "Q4_1"}, None, True),
        ("qwen2", {"kv": "fp8"}, None, True),  # an fp8 KV cache: quantized writes, scaled reads
        ("bundled", {"kv": "fp8"}, "int8", True),
    ],
)
def test_fused_decoder_layers_equal_the_module_path(
    make_ckpt,
    tmp_path,
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    kwargs: dict,
    quantization: str | None,
    fused: bool,
) -> None:
    """Decode steps through torch.ops.ember.decoder_layer give bit-identical tokens and logprobs to the
    same engine with the one-call layers switched off (prompts longer than MAX_QUERY, so both prefill
    on the module path), for every architecture's parts."""
    calls = []
    real_run = fused_decode.run
    monkeypatch.setattr(fused_decode, "run", lambda *a: calls.append(a[3].shape[0]) or real_run(*a))
    gguf, kv = kwargs.pop("gguf", None), kwargs.pop("kv", "auto")
    model_dir = default_model_dir() if arch == "bundled" else make_ckpt(arch, dtype="bfloat16", **kwargs)
    if gguf is not None:
        from tools.hf_to_gguf import write_gguf

        model_dir = write_gguf(model_dir, tmp_path / f"{arch}.gguf", gguf)
    prompts = [[1, *range(40, 40 + n)] for n in (fused_decode.MAX_QUERY, 23, 31)]
    args = {"dtype": "bfloat16", "quantization": quantization, "enable_prefix_caching": False}
    args["kv_cache_dtype"] = kv
    with LLM(str(model_dir), show_progress=False, **args) as llm:
        runner = llm.engine.executor.worker.runner
        assert isinstance(runner.forward, fused_decode.FusedDecode) == fused
        first = run(llm, prompts)
        assert len(calls) == (MAX_NEW - 1 if fused else 0)  # one per decode step
        runner.forward = runner.model  # the module path, on the same native ops
        second = run(llm, prompts)
    assert len(calls) == (MAX_NEW - 1 if fused else 0) and first == second


def test_speculative_verification_rows_equal_plain_decode(
    monkeypatch: pytest.MonkeyPatch, steady_step_costs: None
) -> None:
    """With the one-call layers, a verification step runs each proposed position as a decode row of
    its own, so n-gram speculation gives exactly the tokens and logprobs of plain decoding."""
    sizes = []
    real_run = fused_decode.run
    monkeypatch.setattr(fused_decode, "run", lambda *a: sizes.append(a[3].shape[0]) or real_run(*a))
    loop = [1, *[40, 41, 42, 43, 44, 45] * 4]  # repeats: the n-gram proposer finds matches
    prompts = [loop, [1, *range(300, 320)], loop[:18]]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    args = {"dtype": "bfloat16", "enable_prefix_caching": False, "show_progress": False}
    with LLM(str(default_model_dir()), **args) as llm:
        plain = run(llm, prompts)
    sizes.clear()
    with LLM(str(default_model_dir()), speculative_config=spec, **args) as llm:
        speculative = run(llm, prompts)
        stats = llm.engine.stats()
    assert any(n > len(prompts) for n in sizes), "no verification step took the one-call layers"
    assert stats.spec_num_accepted > 0
    assert speculative == plain


def test_short_prompts_prefill_as_decode_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts of at most MAX_QUERY tokens prefill through the one-call layers (a decode row per token);
    their first tokens and logprobs match the module path's prefill (SDPA) within bf16 noise."""
    sizes = []
    real_run = fused_decode.run
    monkeypatch.setattr(fused_decode, "run", lambda *a: sizes.append(a[3].shape[0]) or real_run(*a))
    prompts = [[1, 17, 5, 9, 33, 2, 8], [1, 4], [1, *range(60, 60 + fused_decode.MAX_QUERY - 1)]]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2)
    args = {"dtype": "bfloat16", "enable_prefix_caching": False, "show_progress": False}
    with LLM(str(default_model_dir()), **args) as llm:
        runner = llm.engine.executor.worker.runner
        fused = greedy_runs(llm.generate(prompts, params, use_tqdm=False))
        assert sizes == [sum(map(len, prompts))]
        runner.forward = runner.model  # the module path, on the same native ops
        module = greedy_runs(llm.generate(prompts, params, use_tqdm=False))
    check_greedy_close(fused, module, tie=BF16_LOGPROB_TOL, atol=BF16_LOGPROB_TOL)


@pytest.fixture(scope="module")
def float32_teacher(native_run) -> tuple[list[list[int]], list[int], list[float]]:
    """The unquantized float32 model's greedy continuations of the prompts and its teacher-forced
    logprobs along them: (sequences, prompt lengths, logprobs)."""
    prompts = native_run[0]
    with LLM(
        str(default_model_dir()), dtype="float32", max_num_batched_tokens=64, show_progress=False
    ) as llm:
        toks, _ = run(llm, prompts)
        seqs = [p + t for p, t in zip(prompts, toks, strict=True)]
        skip = [len(p) for p in prompts]
        return seqs, skip, forced_logprobs(llm, seqs, skip)


def test_int8_native_groups_track_float32(float32_teacher, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 on the native integer-dot matmul (Q8_0-style weights: one scale per row and 32 inputs,
    packed; activations quantized to int8 per 32 inputs) against the unquantized float32 model,
    teacher-forced along its greedy continuations: within bf16 noise, and on average no further from
    float32 than int8's per-channel layout on torch's bf16 ops."""
    seqs, skip, ref = float32_teacher
    with bf16_engine("int8") as llm:
        proj = llm.engine.executor.worker.runner.model.model.layers[0].mlp.down_proj
        assert proj.weight.dtype == torch.uint8 and proj.quant_attrs["kind"] == "i8", "packed for qgemm"
        attrs = proj.quant_attrs
        assert proj.weight.shape[:2] == (-(-attrs["out_features"] // 16), -(-attrs["in_features"] // 32))
    err_ours, err_theirs = native_and_torch_errors("int8", seqs, skip, ref, monkeypatch)
    print(
        f"int8 mean |dlogprob| vs float32: native groups {sum(err_ours) / len(ref):.4f}, "
        f"torch per-channel {sum(err_theirs) / len(ref):.4f}"
    )
    assert max(err_ours) <= 2 * BF16_LOGPROB_TOL, f"native int8 logprobs differ by up to {max(err_ours):.3f}"
    assert sum(err_ours) <= 1.25 * sum(err_theirs)


def test_int4_native_tracks_int4_on_torch(float32_teacher, monkeypatch: pytest.MonkeyPatch) -> None:
    """int4 on the native 4-bit matmul (int4's own values, repacked) against the float32 model,
    teacher-forced: on average no further from float32 than int4 on torch's bf16 ops."""
    seqs, skip, ref = float32_teacher
    err_ours, err_theirs = native_and_torch_errors("int4", seqs, skip, ref, monkeypatch)
    mean_ours, mean_theirs = sum(err_ours) / len(ref), sum(err_theirs) / len(ref)
    print(f"int4 mean |dlogprob| vs float32: native {mean_ours:.4f}, torch {mean_theirs:.4f}")
    assert sum(err_ours) <= 1.25 * sum(err_theirs)
