"""The int4 dequant-matmul: Triton kernel (interpreted on CPU) against its torch reference.

The reference is itself checked against a dense matmul of the dequantized weight, and packing
round-trips. Run: `pytest -q tests/kernels/test_int4_matmul.py`.
"""

from __future__ import annotations

import pytest
import torch

from kernels.int4_matmul import dequantize_int4, int4_matmul_torch, int4_matmul_triton, pack_int4, unpack_int4

pytestmark = pytest.mark.model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(n: int, k: int, group: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.1 + 0.01).to(dtype)
    zeros = torch.randint(0, 16, (n, k // group), generator=g).to(dtype)
    return q, pack_int4(q).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE)


def test_pack_roundtrip():
    q = torch.randint(0, 16, (7, 32), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (7, 16) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)


def test_reference_equals_dense_dequantized_matmul():
    q, packed, scales, zeros = make(48, 64, 32, torch.float32)
    x = torch.randn(5, 64, device=DEVICE)
    grouped = q.float().reshape(48, 2, 32) - zeros.cpu()[:, :, None]
    dense = (grouped * scales.cpu()[:, :, None]).reshape(48, 64)
    assert torch.allclose(dequantize_int4(packed, scales, zeros, 32).cpu(), dense)
    out = int4_matmul_torch(x, packed, scales, zeros, 32).cpu()
    assert torch.allclose(out, x.cpu() @ dense.t(), atol=1e-5)


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("n,k,group", [(64, 64, 64), (96, 256, 128), (80, 128, 32)])
def test_triton_matches_torch_fp32(m, n, k, group):
    _, packed, scales, zeros = make(n, k, group, torch.float32, seed=m)
    x = torch.randn(m, k, device=DEVICE)
    ref = int4_matmul_torch(x, packed, scales, zeros, group)
    out = int4_matmul_triton(x, packed, scales, zeros, group)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_matches_torch_half(dtype):
    _, packed, scales, zeros = make(64, 128, 64, dtype)
    x = torch.randn(9, 128, device=DEVICE).to(dtype)
    ref = int4_matmul_torch(x.float(), packed, scales.float(), zeros.float(), 64)
    out = int4_matmul_triton(x, packed, scales, zeros, 64)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
