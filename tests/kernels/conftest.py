"""Shared fixtures for the attention-kernel tests (run on CPU via the Triton interpreter).

Sets TRITON_INTERPRET=1 before any kernel module is imported when CUDA is absent, builds paged
KV-cache test cases (shuffled block ids, stale garbage / NaN in every slot outside a sequence) and
provides a dead-simple per-token dense attention used to check the torch references themselves.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.metadata import AttentionMetadata  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _build_case(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 8,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    write_new: bool = True,
    garbage: bool = True,
) -> SimpleNamespace:
    """A batch over a paged cache. With write_new=False only the cached context is in the cache."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 3  # spare blocks that belong to nobody
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(perm[at : at + n])
        at += n
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    if garbage:
        kv = (torch.randn(shape, generator=gen) * 1e4).to(dtype)
        kv[:, :, ::2] = float("nan")  # stale slots: huge values and NaN
    else:
        kv = torch.zeros(shape, dtype=dtype)
    keys = [torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype) for s in seq_lens]
    new_k, new_v = [], []
    for b, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        limit = s_len if write_new else s_len - q_len
        for pos in range(limit):
            kv[0, tables[b][pos // block_size], pos % block_size] = keys[b][pos]
            kv[1, tables[b][pos // block_size], pos % block_size] = values[b][pos]
        new_k.append(keys[b][s_len - q_len :])
        new_v.append(values[b][s_len - q_len :])
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, DEVICE)
    return SimpleNamespace(
        query_lens=query_lens,
        seq_lens=seq_lens,
        tables=tables,
        block_size=block_size,
        kv=kv.to(DEVICE),
        keys=keys,
        values=values,
        q=q.to(DEVICE),
        k_new=torch.cat(new_k).to(DEVICE),
        v_new=torch.cat(new_v).to(DEVICE),
        meta=meta,
        scale=head_dim**-0.5,
    )


def _naive_attention(case: SimpleNamespace, sliding_window: int | None, softcap: float = 0.0) -> torch.Tensor:
    """Per query token and head: list the visible positions, explicit softmax, weighted sum (float64);
    `softcap` > 0 caps each score to softcap * tanh(score / softcap) first."""
    num_tokens, num_heads, head_dim = case.q.shape
    group = num_heads // case.keys[0].shape[1]
    q = case.q.cpu().double()
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)
    row = 0
    for b, (q_len, s_len) in enumerate(zip(case.query_lens, case.seq_lens, strict=True)):
        keys, values = case.keys[b].double(), case.values[b].double()
        for i in range(q_len):
            pos = s_len - q_len + i
            visible = [j for j in range(pos + 1) if sliding_window is None or pos - j < sliding_window]
            for h in range(num_heads):
                k = keys[visible, h // group]
                v = values[visible, h // group]
                scores = (k * q[row, h]).sum(-1) * case.scale
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                weights = torch.exp(scores - scores.max())
                weights = weights / weights.sum()
                out[row, h] = (weights[:, None] * v).sum(0)
            row += 1
    return out


@pytest.fixture
def build_case():
    return _build_case


@pytest.fixture
def naive_attention():
    return _naive_attention


@pytest.fixture(scope="session")
def native_ops() -> None:
    """Ember's native CPU ops, built once per machine; tests that need them skip where they cannot build."""
    from kernels.native import load_native

    if DEVICE != "cpu":
        pytest.skip("the native ops are CPU ops")
    reason = load_native()
    if reason is not None:
        pytest.skip(f"native CPU ops unavailable: {reason}")
