"""Tests of the paged KV-cache write (kernels/kv_write.py).

Runs on CPU (Triton interpreter) or CUDA. The torch reference is checked against an explicit
per-token loop; the Triton kernel must match it bit for bit (it is a pure copy), including on
strided inputs, both halves of a shared [2, ...] cache tensor, and padding slots (-1).
"""

from __future__ import annotations

import pytest
import torch

from kernels.kv_write import write_kv_triton
from kernels.torch_ops import write_kv_torch

pytestmark = pytest.mark.model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(dtype: torch.dtype, block_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, num_kv_heads, head_dim, num_tokens = 6, 2, 16, 13
    kv = (torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 1e3).to(dtype)
    # key/value as strided slices of one fused projection output, like a real qkv split
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    return kv.to(DEVICE), key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_torch_matches_loop(dtype: torch.dtype, block_size: int) -> None:
    kv, key, value, slots = _inputs(dtype, block_size)
    expected = kv.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0, slot // block_size, slot % block_size] = key[t]
            expected[1, slot // block_size, slot % block_size] = value[t]
    write_kv_torch(key, value, kv[0], kv[1], slots)
    assert torch.equal(kv, expected)
    assert not torch.equal(kv[0], kv[1])


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_triton_matches_torch(dtype: torch.dtype, block_size: int) -> None:
    kv, key, value, slots = _inputs(dtype, block_size, seed=1)
    expected = kv.clone()
    write_kv_torch(key, value, expected[0], expected[1], slots)
    before = kv.clone()
    write_kv_triton(key, value, kv[0], kv[1], slots)
    assert torch.equal(kv, expected)
    changed = (kv != before).flatten(3).any(-1)  # [2, num_blocks, block_size]
    assert int(changed[0].sum()) == int((slots >= 0).sum())  # padding tokens wrote nothing


def test_write_kv_triton_ignores_tail_of_longer_slot_mapping() -> None:
    kv, key, value, slots = _inputs(torch.float32, 8, seed=2)
    padded = torch.cat([slots, torch.full((5,), -1, dtype=slots.dtype, device=DEVICE)])
    expected = kv.clone()
    write_kv_torch(key, value, expected[0], expected[1], padded)
    write_kv_triton(key, value, kv[0], kv[1], padded)
    assert torch.equal(kv, expected)
