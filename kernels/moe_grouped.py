"""A mixture of experts' grouped products for CUDA: only the selected experts, over their tokens only.

Called by the MoE layer (workers/models/moe.py) inside worker processes on CUDA engines with
unquantized experts; tested on CPU under TRITON_INTERPRET=1 against `grouped_experts_torch`. The
(token, slot) pairs are sorted by expert and each expert's run padded to whole tiles of BLOCK_M rows
(`align_pairs`), so a program owns a BLOCK_M x BLOCK_N tile of one expert's output: it gathers its
rows' activations, walks K in BLOCK_K steps over that expert's weight [E, N, K] and stores (times the
pair's routing weight, for the down product) to the pair's row of the output [pairs, N]. The layer
runs it twice, gate/up then down with the SwiGLU between, and sums each token's k rows in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs, tile_experts): the (token, slot) pair indices (token * k + slot) sorted by expert, each
    expert's run padded with -1 to a multiple of `block_m`; and the expert of each tile of `block_m`."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    pairs, experts, start = [], [], 0
    for expert, count in enumerate(counts):
        if count:
            tiles = -(-count // block_m)
            run = torch.full((tiles * block_m,), -1, dtype=torch.int64, device=ids.device)
            run[:count] = order[start : start + count]
            pairs.append(run)
            experts += [expert] * tiles
            start += count
    if not pairs:
        return torch.empty(0, dtype=torch.int64, device=ids.device), torch.empty(0, dtype=torch.int64)
    return torch.cat(pairs), torch.tensor(experts, dtype=torch.int64, device=ids.device)


@triton.jit
def _grouped_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    pairs_ptr,
    experts_ptr,
    scale_ptr,
    N,
    K,
    top_k,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    INPUT_PER_PAIR: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(experts_ptr + tile)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair >= 0
    src = tl.where(valid, pair if INPUT_PER_PAIR else pair // top_k, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            x_ptr + src[:, None] * stride_xm + offs_k[None, :],
            mask=valid[:, None] & (offs_k[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=(offs_n[None, :] < N) & (offs_k[:, None] < K),
            other=0.0,
        )
        acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
    dst = tl.where(valid, pair, 0)  # the pair's own output row
    if SCALED:
        acc *= tl.load(scale_ptr + dst, mask=valid, other=0.0)[:, None]
    tl.store(
        out_ptr + dst[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & (offs_n[None, :] < N),
    )


def _grouped(
    x: torch.Tensor,
    w: torch.Tensor,
    pairs: torch.Tensor,
    experts: torch.Tensor,
    num_pairs: int,
    top_k: int,
    per_pair: bool,
    scale: torch.Tensor | None,
    block_m: int,
) -> torch.Tensor:
    """out [pairs, N] (x's dtype, float32 when scaled): row p = x[p or p // top_k] @ w[expert of p].T."""
    n, k = w.shape[1], w.shape[2]
    out = torch.zeros(num_pairs, n, dtype=torch.float32 if scale is not None else x.dtype, device=x.device)
    if len(experts) == 0:
        return out
    block_n = 32
    grid = (len(experts), triton.cdiv(n, block_n))
    _grouped_kernel[grid](
        x, w, out, pairs, experts, scale if scale is not None else out, n, k, top_k,
        x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        INPUT_PER_PAIR=per_pair, SCALED=scale is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=32,
    )  # fmt: skip
    return out


def grouped_experts_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The routed experts' sum [T, H] in float32: x [T, H], w13 [E, 2I, H] (gate then up), w2 [E, H, I],
    routing weights and ids [T, k]."""
    num_tokens, top_k = ids.shape
    block_m = 16
    pairs, experts = align_pairs(ids, w13.shape[0], block_m)
    gate_up = _grouped(x, w13, pairs, experts, num_tokens * top_k, top_k, False, None, block_m)
    inter = gate_up.shape[1] // 2
    act = (torch.nn.functional.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).to(x.dtype)
    scale = weights.flatten().float().contiguous()
    down = _grouped(act, w2, pairs, experts, num_tokens * top_k, top_k, True, scale, block_m)
    return down.view(num_tokens, top_k, -1).sum(dim=1)


def grouped_experts_torch(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Reference of `grouped_experts_triton`: each token's k experts in float32, summed."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for slot in range(ids.shape[1]):
        gate_up = torch.einsum("th,tnh->tn", x.float(), w13[ids[:, slot]].float()).to(x.dtype).float()
        act = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        down = torch.einsum("ti,thi->th", act.float(), w2[ids[:, slot]].float())
        out += down * weights[:, slot, None].float()
    return out
