"""Tests of decode attention (kernels/decode_attention.py, the references in kernels/torch_ops.py).

Runs on CPU (Triton interpreter) or CUDA. The torch reference is checked against a naive per-token
softmax loop; the Triton kernel (single pass and split-K) and, on CPU, the native op against the torch
reference. Caches use
shuffled block ids and hold huge values / NaN in every slot outside a sequence.
"""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import decode_attention_triton
from kernels.torch_ops import decode_attention_cpu, decode_attention_torch

pytestmark = pytest.mark.model

SEQ_LENS = [1, 7, 16, 23, 40]
ONES = [1] * len(SEQ_LENS)  # decodes: one query token per request
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _run(op, case, window: int | None, **kw) -> torch.Tensor:
    meta = case.meta
    return op(case.q, case.kv[0], case.kv[1], meta.block_tables, meta.seq_lens, case.scale, window, **kw)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_torch_matches_naive(build_case, naive_attention, block_size, heads, window) -> None:
    case = build_case(ONES, SEQ_LENS, num_heads=heads[0], num_kv_heads=heads[1], block_size=block_size)
    out = _run(decode_attention_torch, case, window)
    assert out.dtype == case.q.dtype
    torch.testing.assert_close(out.cpu().double(), naive_attention(case, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_triton_matches_torch_fp32(build_case, block_size, window, num_splits) -> None:
    case = build_case(ONES, SEQ_LENS, num_heads=4, num_kv_heads=2, block_size=block_size)
    ref = _run(decode_attention_torch, case, window)
    out = _run(decode_attention_triton, case, window, num_splits=num_splits)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_triton_matches_torch_half(build_case, naive_attention, dtype) -> None:
    case = build_case(ONES, SEQ_LENS, num_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype)
    ref = _run(decode_attention_torch, case, None)
    out = _run(decode_attention_triton, case, None, num_splits=2)
    assert out.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.cpu().double(), naive_attention(case, None), atol=tol, rtol=tol)


def test_decode_triton_writes_into_out_view(build_case) -> None:
    case = build_case([1, 1, 1], [3, 12, 30], num_heads=4, num_kv_heads=2)
    big = torch.full((5, 4, 16), 7.0, device=case.q.device)
    result = _run(decode_attention_triton, case, 8, out=big[1:4])
    assert result.data_ptr() == big[1:4].data_ptr()
    torch.testing.assert_close(big[1:4], _run(decode_attention_torch, case, 8), atol=1e-5, rtol=1e-5)
    assert bool((big[0] == 7.0).all()) and bool((big[4] == 7.0).all())


@pytest.mark.parametrize("window", [None, 5])
def test_decode_softcap_every_op_matches_naive(build_case, naive_attention, window) -> None:
    """Gemma 2's soft-capped scores (a cap of 1.5 that binds: the queries are scaled up) in the torch
    reference, the Triton kernel (single pass and split-K) and, on CPU, the native op."""
    case = build_case(ONES, SEQ_LENS, num_heads=8, num_kv_heads=2, block_size=8)
    case.q.mul_(4.0)
    expected = naive_attention(case, window, softcap=1.5)
    assert not torch.allclose(expected, naive_attention(case, window), atol=1e-2)
    ops = [(decode_attention_torch, {}), (decode_attention_triton, {"num_splits": 1})]
    ops += [(decode_attention_triton, {"num_splits": 3})]
    if case.q.device.type == "cpu":
        from kernels.native import load_native

        if load_native() is None:
            ops.append((decode_attention_cpu, {}))
    for op, kw in ops:
        out = _run(op, case, window, softcap=1.5, **kw)
        torch.testing.assert_close(out.cpu().double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1), (12, 2)])  # G = 1, 4, 8, 6 (4 at once + 2)
def test_decode_cpu_matches_torch(build_case, naive_attention, native_ops, heads, window, dtype) -> None:
    """The native op never reads slots past a sequence (they hold NaN), so its output is finite."""
    case = build_case(ONES, SEQ_LENS, num_heads=heads[0], num_kv_heads=heads[1], block_size=8, dtype=dtype)
    ref = _run(decode_attention_torch, case, window)
    out = _run(decode_attention_cpu, case, window)
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), naive_attention(case, window), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("heads", [(14, 2), (12, 1), (9, 3)])  # G = 7, 12 (8 at once + 4), 3
def test_decode_cpu_long_contexts_cross_tiles(build_case, naive_attention, native_ops, heads, window) -> None:
    """Contexts over several 64-key tiles of the op's online softmax, windows starting mid-tile."""
    lens = [1, 63, 64, 65, 200, 301]
    case = build_case([1] * len(lens), lens, num_heads=heads[0], num_kv_heads=heads[1], head_dim=64)
    out = _run(decode_attention_cpu, case, window)
    torch.testing.assert_close(out, _run(decode_attention_torch, case, window), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), naive_attention(case, window), atol=1e-5, rtol=1e-5)


def test_decode_cpu_writes_into_out_view(build_case, native_ops) -> None:
    case = build_case([1, 1, 1], [3, 12, 30], num_heads=4, num_kv_heads=2)
    big = torch.full((5, 4, 16), 7.0)
    _run(decode_attention_cpu, case, None, out=big[1:4])
    torch.testing.assert_close(big[1:4], _run(decode_attention_torch, case, None), atol=1e-5, rtol=1e-5)
    assert bool((big[0] == 7.0).all()) and bool((big[4] == 7.0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_cpu_reads_and_writes_any_layout(build_case, native_ops, dtype) -> None:
    """q as a view into a wider fused q/k/v row (as the one-call layer passes it), lengths as int32
    or int64, out with or without contiguous heads: one result, read and written in place where
    the layout allows and through a copy where it does not."""
    case = build_case([1, 1, 1], [3, 70, 130], num_heads=8, num_kv_heads=2, head_dim=16, dtype=dtype)
    meta = case.meta
    expected = _run(decode_attention_torch, case, None)
    wide = torch.randn(3, 8 * 16 + 64, dtype=dtype)
    wide[:, : 8 * 16] = case.q.reshape(3, -1)
    q = wide.narrow(1, 0, 8 * 16).view(3, 8, 16)
    for lens in (meta.seq_lens.int(), meta.seq_lens.long()):
        for out in (torch.empty(3, 8, 16, dtype=dtype), torch.empty(3, 16, 8, dtype=dtype).transpose(1, 2)):
            k, v = case.kv
            got = decode_attention_cpu(q, k, v, meta.block_tables, lens, case.scale, None, out=out)
            assert got is out
            torch.testing.assert_close(out.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_cpu_refuses_blocks_outside_the_cache(build_case, native_ops) -> None:
    case = build_case([1, 1], [3, 12], num_heads=4, num_kv_heads=2)
    table = case.meta.block_tables.clone()
    table[1, 0] = case.kv.shape[1]  # one past the last block
    with pytest.raises(RuntimeError, match="outside the cache"):
        decode_attention_cpu(case.q, case.kv[0], case.kv[1], table, case.meta.seq_lens, case.scale, None)
