"""`--kv-cache-dtype fp8` end to end: e4m3 KV blocks with per-kv-head scales calibrated at start-up.

On the bundled (trained) model in bf16: the same KV memory holds twice the blocks; the scales are
positive, per kv head, and the same on every start (a fixed calibration prompt, not the first
requests); greedy decoding over the fp8 cache stays on the bf16 cache's tokens about as long as two
correct bf16 paths agree, and the native CPU ops give the torch references' tokens (up to a
near-tie). Accuracy on the real models is in tests/e2e/test_real_models.py (teacher-forced floors).
Run: `pytest -q tests/workers/test_kv_fp8.py`.
"""

from __future__ import annotations

import pytest
import torch

from coreproc import LLM, SamplingParams
from coreproc.base.config import ConfigError
from coreproc.base.host import default_model_dir
from tests.hf_ref import PROMPT_TEXTS, Greedy, check_greedy_close, greedy_runs

pytestmark = pytest.mark.model

MAX_NEW = 24
BF16_LOGPROB_TOL = 0.1  # bf16 rounds every layer's output to 8 bits of mantissa
KV_MEMORY = 8 << 20


def engine(kv: str) -> LLM:
    args = {"dtype": "bfloat16", "kv_cache_memory": KV_MEMORY, "max_num_batched_tokens": 64}
    return LLM(str(default_model_dir()), kv_cache_dtype=kv, show_progress=False, **args)


def greedy_top2(llm: LLM) -> list[Greedy]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=2)
    prompts = [llm.get_tokenizer()(t).input_ids for t in PROMPT_TEXTS]
    return greedy_runs(llm.generate(prompts, params, use_tqdm=False))


def greedy(llm: LLM) -> list[list[int]]:
    return [tokens for tokens, _ in greedy_top2(llm)]


def scales(llm: LLM) -> list[torch.Tensor]:
    model = llm.engine.executor.worker.runner.model
    return [layer.self_attn.attn.kv_scales for layer in model.model.layers]


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


@pytest.fixture(scope="module")
def runs() -> dict:
    out = {}
    for kv in ("auto", "fp8"):
        with engine(kv) as llm:
            runs = greedy_top2(llm)
            out[kv] = (llm.engine.scheduler.kv.num_blocks, [t for t, _ in runs], scales(llm), runs)
    return out


def test_fp8_cache_holds_twice_the_blocks_with_calibrated_scales(runs: dict) -> None:
    (auto_blocks, _, auto_scales, _), (fp8_blocks, _, fp8_scales, _) = runs["auto"], runs["fp8"]
    assert fp8_blocks == 2 * auto_blocks
    assert all(s is None for s in auto_scales)
    first = fp8_scales[0]
    assert first.dtype == torch.float32 and first.shape == (2, 2)  # keys and values, per kv head
    assert all(bool((s > 0).all()) for s in fp8_scales)
    assert len({tuple(s.flatten().tolist()) for s in fp8_scales}) == len(fp8_scales)  # layers differ
    with engine("fp8") as llm:  # a second start calibrates to the very same scales and tokens
        assert all(torch.equal(a, b) for a, b in zip(scales(llm), fp8_scales))
        assert greedy(llm) == runs["fp8"][1]


def test_fp8_cache_tracks_the_bf16_cache(runs: dict) -> None:
    """Most prompts keep the bf16 cache's greedy tokens throughout; none leaves them at once."""
    agree = [shared_prefix(a, b) for a, b in zip(runs["fp8"][1], runs["auto"][1], strict=True)]
    assert sum(n == MAX_NEW for n in agree) >= len(agree) // 2, agree
    assert min(agree) >= 2, agree


def test_fp8_cache_native_ops_equal_the_torch_references(runs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same fp8 blocks (the kernels write the same bytes) read by other kernels, whose sums round
    bf16 apart: the same tokens, up to a near-tie."""
    monkeypatch.setenv("EMBER_CPU_KERNELS", "torch")
    with engine("fp8") as llm:
        assert llm.engine.executor.worker.backend.name == "torch"
        reference = greedy_top2(llm)
    parted = check_greedy_close(runs["fp8"][3], reference, tie=BF16_LOGPROB_TOL, atol=BF16_LOGPROB_TOL)
    print(f"fp8 cache, native against torch ops: {len(reference) - parted} of {len(reference)} identical")


def test_unknown_kv_cache_dtype_is_refused() -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        LLM(str(default_model_dir()), kv_cache_dtype="int3", show_progress=False)
