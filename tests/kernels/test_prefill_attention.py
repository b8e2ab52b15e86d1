"""Tests of varlen prefill attention over the paged cache (kernels/prefill_attention.py).

Runs on CPU (Triton interpreter) or CUDA. Batches mix fresh prompts, chunks that follow cached
context and one-token requests. The torch reference is checked against a naive per-token softmax
loop, the Triton kernel against the torch reference; stale slots hold huge values and NaN.
"""

from __future__ import annotations

import pytest
import torch

from kernels.prefill_attention import prefill_attention_triton
from kernels.torch_ops import prefill_attention_torch

pytestmark = pytest.mark.model

# (query_lens, seq_lens): q_len == 1 requests, chunks after context, fresh prompts, a 33-row chunk
MIXED = ([1, 6, 12, 1, 20, 33], [9, 6, 30, 1, 20, 40])
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _run(op, case, window: int | None, **kw) -> torch.Tensor:
    m = case.meta
    args = (m.block_tables, m.query_start_loc, m.seq_lens, case.scale, window)
    return op(case.q, case.kv[0], case.kv[1], *args, m.query_start_loc_cpu, m.seq_lens_cpu, **kw)


@pytest.mark.parametrize("window", [None, 4])
def test_prefill_softcap_matches_naive(build_case, naive_attention, window) -> None:
    """Gemma 2's soft-capped scores (a cap of 1.5 that binds) in the torch reference and Triton."""
    case = build_case(*MIXED, num_heads=4, num_kv_heads=2, block_size=8)
    case.q.mul_(4.0)
    expected = naive_attention(case, window, softcap=1.5)
    assert not torch.allclose(expected, naive_attention(case, window), atol=1e-2)
    for op in (prefill_attention_torch, prefill_attention_triton):
        out = _run(op, case, window, softcap=1.5)
        torch.testing.assert_close(out.cpu().double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 4, 13])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_prefill_torch_matches_naive(build_case, naive_attention, block_size, heads, window) -> None:
    case = build_case(*MIXED, num_heads=heads[0], num_kv_heads=heads[1], block_size=block_size)
    out = _run(prefill_attention_torch, case, window)
    assert out.dtype == case.q.dtype
    torch.testing.assert_close(out.cpu().double(), naive_attention(case, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 4, 13])
@pytest.mark.parametrize("block_size", [8, 16])
def test_prefill_triton_matches_torch_fp32(build_case, block_size, window) -> None:
    case = build_case(*MIXED, num_heads=4, num_kv_heads=2, block_size=block_size, seed=block_size)
    ref = _run(prefill_attention_torch, case, window)
    out = _run(prefill_attention_triton, case, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_triton_matches_torch_half(build_case, naive_attention, dtype) -> None:
    case = build_case(*MIXED, num_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype, seed=3)
    ref = _run(prefill_attention_torch, case, 6)
    out = _run(prefill_attention_triton, case, 6)
    assert out.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.cpu().double(), naive_attention(case, 6), atol=tol, rtol=tol)


def test_prefill_triton_decode_only_batch(build_case, naive_attention) -> None:
    case = build_case([1, 1, 1], [1, 17, 40], num_heads=4, num_kv_heads=1, block_size=16)
    out = _run(prefill_attention_triton, case, None)
    torch.testing.assert_close(out.cpu().double(), naive_attention(case, None), atol=1e-5, rtol=1e-5)
