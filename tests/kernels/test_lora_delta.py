"""The batched multi-LoRA op (kernels/lora.py): the grouped CPU path and the Triton kernels against the
gather + bmm reference.

Runs on CPU (Triton interpreter, set by conftest.py) or CUDA. Batches mix adapters, repeat slots and
include base-model tokens (-1); stale slots nobody uses hold NaN. The grouped path is also checked
against the plain per-adapter formula. Run: `pytest -q tests/kernels/test_lora_delta.py`.
"""

from __future__ import annotations

import pytest
import torch

from kernels.lora import (
    lora_delta_grouped,
    lora_delta_reference,
    lora_delta_triton,
    select_lora_op,
)

pytestmark = pytest.mark.model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPS = {"grouped": lora_delta_grouped, "triton": lora_delta_triton}
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def make(
    tokens: int, num_slots: int, rank: int, in_f: int, out_f: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """x, a, b, scales, and a shuffled slot mix: every slot and -1, repeated as the batch allows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_f, generator=gen)
    a = torch.randn(num_slots, rank, in_f, generator=gen) / in_f**0.5
    b = torch.randn(num_slots, out_f, rank, generator=gen) / rank**0.5
    scales = torch.rand(num_slots, generator=gen) + 0.5
    mix = (torch.arange(tokens) * 7 + 3) % (num_slots + 1) - 1
    slots = mix[torch.randperm(tokens, generator=gen)]
    return *(t.to(dtype).to(DEVICE) for t in (x, a, b)), scales.to(DEVICE), slots.to(DEVICE)


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == dtype
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


def test_reference_equals_per_token_loop() -> None:
    x, a, b, scales, slots = make(9, 3, 4, 24, 40, torch.float32)
    out = lora_delta_reference(x, a, b, scales, slots)
    for t, s in enumerate(slots.tolist()):
        want = scales[s] * (b[s] @ (a[s] @ x[t])) if s >= 0 else torch.zeros_like(out[t])
        torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_f,out_f", [(72, 200), (200, 72)])
@pytest.mark.parametrize("rank", [1, 8, 16])
@pytest.mark.parametrize("num_slots", [1, 4])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_matches_reference(
    name: str, dtype: torch.dtype, in_f: int, out_f: int, rank: int, num_slots: int, tokens: int
) -> None:
    x, a, b, scales, slots = make(tokens, num_slots, rank, in_f, out_f, dtype, seed=tokens + rank)
    ref = lora_delta_reference(x, a, b, scales, slots)
    check(OPS[name](x, a, b, scales, slots), ref, dtype)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rank", [64, 192])  # 192: q, k and v adapters of rank 64 stacked
def test_large_rank_and_strided_x(name: str, dtype: torch.dtype, rank: int) -> None:
    x, a, b, scales, slots = make(19, 3, rank, 72, 200, dtype, seed=5)
    wide = torch.stack([x, -x], dim=2).flatten(1)[:, ::2]  # the same values at a column stride of 2
    ref = lora_delta_reference(x, a, b, scales, slots)
    check(OPS[name](wide, a, b, scales, slots), ref, dtype)


@pytest.mark.parametrize("name", list(OPS))
def test_stale_slots_do_not_leak(name: str) -> None:
    x, a, b, scales, slots = make(33, 4, 8, 72, 200, torch.float32, seed=3)
    slots = torch.where(slots == 2, 1, slots)  # slot 2 is free, and full of NaN
    a[2], b[2], scales[2] = float("nan"), float("nan"), float("nan")
    out = OPS[name](x, a, b, scales, slots)
    assert torch.isfinite(out).all()
    check(out, lora_delta_reference(x, a, b, scales, slots), torch.float32)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_base_model_gives_zeros(name: str, dtype: torch.dtype) -> None:
    x, a, b, scales, _ = make(7, 2, 8, 72, 200, dtype)
    slots = torch.full((7,), -1, dtype=torch.int64, device=DEVICE)
    out = OPS[name](x, a, b, scales, slots)
    assert out.shape == (7, 200) and out.dtype == dtype and not out.any()


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_tokens_on_one_slot(name: str, dtype: torch.dtype) -> None:
    x, a, b, scales, _ = make(64, 4, 16, 200, 72, dtype, seed=7)
    slots = torch.full((64,), 3, dtype=torch.int64, device=DEVICE)
    check(OPS[name](x, a, b, scales, slots), lora_delta_reference(x, a, b, scales, slots), dtype)


@pytest.mark.parametrize("name", list(OPS))
def test_no_tokens(name: str) -> None:
    x, a, b, scales, slots = make(0, 2, 8, 72, 200, torch.float32)
    assert OPS[name](x, a, b, scales, slots).shape == (0, 200)


def test_grouped_equals_per_adapter_formula() -> None:
    x, a, b, scales, slots = make(40, 4, 8, 72, 200, torch.float32, seed=11)
    out = lora_delta_grouped(x, a, b, scales, slots)
    for s in range(-1, 4):
        rows = slots == s
        want = scales[s] * (x[rows] @ a[s].T) @ b[s].T if s >= 0 else torch.zeros_like(out[rows])
        torch.testing.assert_close(out[rows], want, rtol=1e-5, atol=1e-5)


def test_select_lora_op() -> None:
    assert select_lora_op(torch.device("cpu")) is lora_delta_grouped
    assert select_lora_op(torch.device("cuda")) is lora_delta_triton
    assert select_lora_op(torch.device("cuda"), "torch") is lora_delta_reference
    assert select_lora_op(torch.device("cpu"), " Grouped ") is lora_delta_grouped
    assert select_lora_op(torch.device(DEVICE), "triton") is lora_delta_triton  # interpreter on CPU
    with pytest.raises(ValueError, match="unknown LoRA op"):
        select_lora_op(torch.device("cpu"), "punica")


def test_select_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_lora_op(torch.device("cpu"), "triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runs_in_place_equal_the_reference(dtype: torch.dtype) -> None:
    """The workers' CPU path: runs of one slot (an adapter's tokens kept together), added into y."""
    from kernels.lora import lora_add_runs_, lora_delta_reference

    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 72, generator=g).to(dtype)
    a = torch.randn(4, 8, 72, generator=g).to(dtype)
    b = torch.randn(4, 200, 8, generator=g).to(dtype)
    scales = torch.tensor([0.5, 2.0, 1.0, 0.25])
    slots = torch.tensor([2] * 3 + [-1] * 4 + [0] * 5 + [2] * 2 + [3] * 6)
    runs = [(0, 3, 2), (7, 12, 0), (12, 14, 2), (14, 20, 3)]
    y = torch.randn(20, 200, generator=g).to(dtype)
    want = y.float() + lora_delta_reference(x, a, b, scales, slots).float()
    got = lora_add_runs_(y.clone(), x, a, b, scales.tolist(), runs)
    tol = 1e-4 if dtype == torch.float32 else 0.3
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
