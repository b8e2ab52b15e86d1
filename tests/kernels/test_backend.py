"""Tests of the attention backends and their selection (kernels/backend.py, kernels/metadata.py).

Runs on CPU (Triton interpreter) or CUDA. TorchBackend, TritonBackend and (on CPU) CpuBackend run the
same mixed step (decodes, chunks after context, fresh prompts, padded rows) on caches holding stale
garbage; all must write the same cache and agree with a naive per-token attention.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from kernels import AttentionBackend, AttentionMetadata, select_backend
from kernels.backend import CpuBackend, TorchBackend, TritonBackend
from kernels.native import load_native
from kernels.torch_ops import quantize_kv

pytestmark = pytest.mark.model

QUERY_LENS = [1, 1, 1, 5, 14, 1, 22]
SEQ_LENS = [4, 17, 33, 12, 14, 9, 30]


def _step(
    backend: AttentionBackend, case, window: int | None, pad: int, kv_scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    kv = case.kv.clone()
    q, k, v, meta = case.q, case.k_new, case.v_new, case.meta
    if pad:  # CUDA-graph style padding: extra rows whose slot is -1
        gen = torch.Generator().manual_seed(pad)
        q, k, v = (torch.cat([x, torch.randn(pad, *x.shape[1:], generator=gen).to(x)]) for x in (q, k, v))
        minus_one = torch.full((pad,), -1, dtype=meta.slot_mapping.dtype, device=q.device)
        meta = dataclasses.replace(meta, slot_mapping=torch.cat([meta.slot_mapping, minus_one]))
    out = backend.forward(q, k, v, kv[0], kv[1], meta, case.scale, window, kv_scales)
    return out, kv


@pytest.mark.parametrize(("window", "block_size", "pad"), [(None, 8, 0), (6, 16, 3)])
def test_torch_and_triton_backends_agree(build_case, naive_attention, window, block_size, pad) -> None:
    case = build_case(QUERY_LENS, SEQ_LENS, block_size=block_size, write_new=False)  # 4 heads, 2 kv heads
    assert case.meta.num_decodes == 3
    ref_out, ref_kv = _step(TorchBackend(), case, window, pad)
    out, kv = _step(TritonBackend(), case, window, pad)
    n = case.meta.num_actual_tokens
    assert out.shape == (n + pad, 4, 16)
    torch.testing.assert_close(kv, ref_kv, atol=0.0, rtol=0.0, equal_nan=True)  # same slots written
    assert not torch.equal(kv, case.kv) and bool(kv.isnan().any())  # new rows landed, garbage left alone
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:n].cpu().double(), naive_attention(case, window), atol=1e-5, rtol=1e-5)
    assert bool((out[n:] == 0).all())


def test_backends_bf16_agree(build_case, naive_attention) -> None:
    case = build_case(QUERY_LENS, SEQ_LENS, num_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)
    ref_out, _ = _step(TorchBackend(), case, None, 0)
    out, _ = _step(TritonBackend(), case, None, 0)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.cpu().double(), naive_attention(case, None), atol=2e-2, rtol=2e-2)


def test_metadata_build() -> None:
    meta = AttentionMetadata.build([1, 1, 3, 1], [5, 9, 3, 4], [[2, 0], [1, 4, 5], [3], [6]], 4, "cpu")
    assert (meta.num_decodes, meta.num_decode_tokens, meta.num_actual_tokens) == (2, 2, 6)
    assert (meta.max_query_len, meta.max_seq_len) == (3, 9)
    assert meta.query_start_loc_cpu == [0, 1, 2, 5, 6] and meta.seq_lens_cpu == [5, 9, 3, 4]
    assert meta.query_start_loc.tolist() == meta.query_start_loc_cpu
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.tolist()[0] == [2, 0, 0]
    # req0 pos 4 -> block 0; req1 pos 8 -> block 5; req2 pos 0..2 -> block 3; req3 pos 3 -> block 6
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.slot_mapping.tolist() == [0, 20, 12, 13, 14, 27]


CPU_CASES = [(None, torch.float32), (6, torch.float32), (None, torch.bfloat16)]


@pytest.mark.parametrize(("window", "dtype"), CPU_CASES)
def test_cpu_backend_agrees_with_torch(build_case, naive_attention, native_ops, window, dtype) -> None:
    """The native CPU decode op inside a mixed step: same cache writes, same outputs as the references."""
    case = build_case(QUERY_LENS, SEQ_LENS, num_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype)
    ref_out, ref_kv = _step(TorchBackend(), case, window, 2)
    out, kv = _step(CpuBackend(), case, window, 2)
    torch.testing.assert_close(kv, ref_kv, atol=0.0, rtol=0.0, equal_nan=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)
    n = case.meta.num_actual_tokens
    torch.testing.assert_close(out[:n].double(), naive_attention(case, window), atol=tol, rtol=tol)


def _fp8_case(case, kv_scales: torch.Tensor):
    """The case over an e4m3 cache holding x / scale per kv head (garbage saturated or NaN), and the same
    case with its keys and values rounded through fp8, which is what every backend must attend over."""
    kv = torch.stack(
        [quantize_kv(case.kv[i].flatten(0, 1), torch.float8_e4m3fn, kv_scales, i) for i in (0, 1)]
    )
    fp8 = SimpleNamespace(**{**vars(case), "kv": kv.view(case.kv.shape)})

    def rounded(x: torch.Tensor, i: int) -> torch.Tensor:
        return quantize_kv(x, torch.float8_e4m3fn, kv_scales.cpu(), i).float() * kv_scales[i].cpu()[:, None]

    keys, values = [rounded(x, 0) for x in case.keys], [rounded(x, 1) for x in case.values]
    return fp8, SimpleNamespace(**{**vars(case), "keys": keys, "values": values})


@pytest.mark.parametrize("window", [None, 6])
def test_fp8_cache_backends_agree(build_case, naive_attention, native_ops, window) -> None:
    """An fp8 cache with per-kv-head scales: every backend writes the same bytes and attends over the
    values the cache holds (value * scale), exactly up to float32 rounding."""
    case = build_case(QUERY_LENS, SEQ_LENS, num_heads=8, num_kv_heads=2, head_dim=32)
    scales = torch.tensor([[0.02, 0.012], [0.01, 0.03]], device=case.q.device)
    fp8, rounded = _fp8_case(case, scales)
    ref_out, ref_kv = _step(TorchBackend(), fp8, window, 2, scales)
    n = case.meta.num_actual_tokens
    expect = naive_attention(rounded, window)
    torch.testing.assert_close(ref_out[:n].cpu().double(), expect, atol=1e-5, rtol=1e-5)
    assert ref_kv.dtype == torch.float8_e4m3fn
    backends = [TritonBackend()] + ([CpuBackend()] if case.q.device.type == "cpu" else [])
    for backend in backends:
        out, kv = _step(backend, fp8, window, 2, scales)
        assert torch.equal(kv.view(torch.uint8), ref_kv.view(torch.uint8)), backend.name
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    # the rounding itself: within a few percent of attention over the unrounded values
    torch.testing.assert_close(ref_out[:n].cpu().double(), naive_attention(case, window), atol=0.1, rtol=0.1)


def test_select_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMBER_ATTENTION_BACKEND", raising=False)
    monkeypatch.setenv("EMBER_CPU_KERNELS", "torch")
    assert select_backend(torch.device("cpu")).name == "torch"
    monkeypatch.setenv("EMBER_CPU_KERNELS", "auto")
    expected = "cpu" if load_native() is None else "torch"
    assert select_backend(torch.device("cpu")).name == expected
    assert select_backend(torch.device("cuda")).name == "triton"
    assert isinstance(select_backend(torch.device("cpu"), "triton"), TritonBackend)
    monkeypatch.setenv("EMBER_ATTENTION_BACKEND", "triton")
    assert select_backend(torch.device("cpu")).name == "triton"
    assert select_backend(torch.device("cuda"), override="torch").name == "torch"
    monkeypatch.setenv("EMBER_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="torch"):
        select_backend(torch.device("cpu"))


def test_native_build_key_covers_every_source() -> None:
    """Every file in kernels/csrc is a compiled source or a header of the build key, so that editing
    any of them rebuilds the native ops instead of loading a stale library."""
    from kernels.native import HEADERS, SOURCES

    csrc = SOURCES[0].parent
    on_disk = {p.name for p in csrc.iterdir() if p.suffix in (".cpp", ".h")}
    assert on_disk == {p.name for p in SOURCES + HEADERS}
