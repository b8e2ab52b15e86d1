"""Batched multi-LoRA: the low-rank delta that a batch mixing several adapters adds to one linear.

Runs in worker processes, beside each linear that has adapters. The adapters of one linear live in S
slots of stacked tensors: `a` [S, R, IN] (LoRA A, "shrink"), `b` [S, OUT, R] (LoRA B, "expand"),
`scales` [S] float32 (alpha / r, or alpha / sqrt(r)). Token t of x [T, IN] uses slot `slots[t]`
(int64 [T]; -1: the base model, delta 0): delta[t] = scales[s] * b[s] @ (a[s] @ x[t]), [T, OUT] in
x's dtype, accumulated in float32. `lora_delta_reference` is the definition (gather + bmm),
`lora_delta_grouped` a CPU path for tokens in any order (one pass per adapter present),
`lora_add_runs_` the CPU path the workers take (their steps keep each adapter's tokens together: per
run of one slot, two matmuls on slices, added in place, no gather or scatter), `lora_delta_triton` the
CUDA path (tested on CPU under TRITON_INTERPRET=1); `select_lora_op` picks one per process.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

LoraOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _check(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor
) -> None:
    num_slots, rank, in_features = a.shape
    assert x.dim() == 2 and x.shape[1] == in_features, f"x {tuple(x.shape)} does not match a {tuple(a.shape)}"
    assert b.dim() == 3 and b.shape[0] == num_slots and b.shape[2] == rank, f"b {tuple(b.shape)} vs a"
    assert scales.shape == (num_slots,), f"scales {tuple(scales.shape)}: one per slot ({num_slots})"
    assert slots.shape == (x.shape[0],), f"slots {tuple(slots.shape)}: one per token ({x.shape[0]})"
    assert a.dtype == b.dtype == x.dtype, f"x, a, b dtypes differ: {x.dtype}, {a.dtype}, {b.dtype}"


def lora_delta_reference(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """The definition: each token's own A and B gathered ([T, R, IN], [T, OUT, R]), two bmm in float32."""
    _check(x, a, b, scales, slots)
    used = slots >= 0
    idx = torch.where(used, slots, 0)
    h = torch.bmm(a[idx].float(), x.float()[:, :, None])  # [T, R, 1]
    y = torch.bmm(b[idx].float(), h)[:, :, 0] * scales[idx, None]  # [T, OUT]
    return torch.where(used[:, None], y, 0.0).to(x.dtype)


def lora_add_runs_(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scales: list[float],
    runs: list[tuple[int, int, int]],
) -> torch.Tensor:
    """y[start:end] += scales[s] * (x[start:end] @ a[s].T) @ b[s].T for each (start, end, slot s) run
    (tokens outside every run: the base model); returns y. float32 accumulation only where x is."""
    for start, end, slot in runs:
        h = (x[start:end] @ a[slot].t()) * scales[slot]  # [n, R]
        y[start:end] += h @ b[slot].t()
    return y


def _one_adapter(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [n, IN] through one adapter (a [R, IN], b [OUT, R]) -> [n, OUT] in x's dtype."""
    h = (x.float() @ a.float().t()) * scale  # [n, R]: the scale on R columns, not OUT
    return (h @ b.float().t()).to(x.dtype)


def lora_delta_grouped(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """The CPU path: the tokens sorted by slot once, then per slot present one gather of its rows, two
    matmuls and one scatter into the output (rows of -1 filled with zeros). Tokens with -1 cost only
    that fill; a batch on one adapter skips the gather and the scatter."""
    _check(x, a, b, scales, slots)
    order = torch.argsort(slots, stable=True)
    present, counts = torch.unique_consecutive(slots[order], return_counts=True)
    groups = list(zip(present.tolist(), counts.tolist()))
    if len(groups) == 1:  # one slot for every token: no gather, no scatter
        s = groups[0][0]
        return _one_adapter(x, a[s], b[s], scales[s]) if s >= 0 else x.new_zeros(x.shape[0], b.shape[1])
    out = x.new_empty(x.shape[0], b.shape[1])  # every row written once below
    start = 0
    for s, n in groups:
        rows = order[start : start + n]
        if s < 0:
            out.index_fill_(0, rows, 0.0)
        else:
            out.index_copy_(0, rows, _one_adapter(x.index_select(0, rows), a[s], b[s], scales[s]))
        start += n
    return out


@triton.jit
def _slot_range(ss):
    # The first and last adapter slot in a block of slot-sorted tokens (-1 first); (0, -1) when none.
    hi = tl.max(ss, axis=0)
    lo = tl.min(tl.where(ss >= 0, ss, hi + 1), axis=0)
    return lo, hi


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    scale_ptr,
    order_ptr,
    slot_ptr,
    h_ptr,
    T,
    IN,
    R,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ht,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # One program per BLOCK_M tokens in slot order and BLOCK_R ranks: h[i, r] = scale[s] * a[s, r] @
    # x[order[i]], for each slot s in the block in turn (rows of other slots masked to zero).
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ss = tl.load(slot_ptr + i, mask=i < T, other=-1).to(tl.int32)
    rows = tl.load(order_ptr + i, mask=i < T, other=0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    lo, hi = _slot_range(ss)
    for s in range(lo, hi + 1):
        match = ss == s
        if tl.sum(match.to(tl.int32), axis=0) > 0:
            a_base = a_ptr + tl.cast(s, tl.int64) * stride_as
            for k0 in range(0, IN, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                xmask = match[:, None] & (k[None, :] < IN)
                xt = tl.load(x_ptr + rows[:, None] * stride_xt + k[None, :], mask=xmask, other=0.0)
                amask = (r[None, :] < R) & (k[:, None] < IN)
                at = tl.load(a_base + r[None, :] * stride_ar + k[:, None], mask=amask, other=0.0)  # [K, R]
                if DOT_FP32:
                    acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(xt, at)
    scale = tl.load(scale_ptr + tl.maximum(ss, 0), mask=ss >= 0, other=0.0)
    acc = acc * scale[:, None]
    tl.store(h_ptr + i[:, None] * stride_ht + r[None, :], acc, mask=(i < T)[:, None])


@triton.jit
def _expand_kernel(
    h_ptr,
    b_ptr,
    order_ptr,
    slot_ptr,
    out_ptr,
    T,
    OUT,
    R,
    stride_ht,
    stride_bs,
    stride_bo,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_IEEE: tl.constexpr,
):
    # One program per BLOCK_M tokens in slot order and BLOCK_N outputs: out[order[i], n] = b[s, n] @ h[i],
    # BLOCK_R ranks at a time; tokens with -1 match no slot and get zeros.
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ss = tl.load(slot_ptr + i, mask=i < T, other=-1).to(tl.int32)
    rows = tl.load(order_ptr + i, mask=i < T, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    lo, hi = _slot_range(ss)
    for s in range(lo, hi + 1):
        match = ss == s
        if tl.sum(match.to(tl.int32), axis=0) > 0:
            b_base = b_ptr + tl.cast(s, tl.int64) * stride_bs
            for r0 in range(0, R, BLOCK_R):
                r = r0 + tl.arange(0, BLOCK_R)
                hs = tl.load(h_ptr + i[:, None] * stride_ht + r[None, :], mask=match[:, None], other=0.0)
                bmask = (r[:, None] < R) & (n[None, :] < OUT)
                bt = tl.load(b_base + n[None, :] * stride_bo + r[:, None], mask=bmask, other=0.0)  # [R, N]
                if DOT_IEEE:
                    acc += tl.dot(hs, bt.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(hs, bt.to(tl.float32))  # tf32 products, float32 accumulation
    omask = (i < T)[:, None] & (n[None, :] < OUT)
    tl.store(out_ptr + rows[:, None] * stride_ot + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)


def lora_delta_triton(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Triton version of `lora_delta_reference` (same contract, any R). No host sync: the tokens are
    sorted by slot on the device, then a shrink kernel writes h = scale * A x [T, R] (float32) and an
    expand kernel writes B h to every row of the output. Slots must be < S (not checked here)."""
    _check(x, a, b, scales, slots)
    num_tokens, in_features = x.shape
    rank, out_features = a.shape[1], b.shape[1]
    assert a.stride(2) == 1 and b.stride(2) == 1, "a and b need a unit stride in their last dim"
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    order = torch.argsort(slots, stable=True)
    sorted_slots = slots[order]
    block_m = min(32, max(16, triton.next_power_of_2(num_tokens)))
    block_r = min(64, max(16, triton.next_power_of_2(rank)))  # tl.dot needs 16 or more along each dim
    grid_r = triton.cdiv(rank, block_r)
    h = torch.empty(num_tokens, grid_r * block_r, dtype=torch.float32, device=x.device)  # zeros past R
    # the CPU interpreter (Triton 3.9) mishandles half-precision tl.dot; compute in float32 there
    exact = x.device.type == "cpu" or x.dtype == torch.float32
    scales = scales.float()
    grid_m = triton.cdiv(num_tokens, block_m)
    _shrink_kernel[(grid_m, grid_r)](
        x,
        a,
        scales,
        order,
        sorted_slots,
        h,
        num_tokens,
        in_features,
        rank,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        h.stride(0),
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=64,
        DOT_FP32=exact,
    )
    block_n = 64
    _expand_kernel[(grid_m, triton.cdiv(out_features, block_n))](
        h,
        b,
        order,
        sorted_slots,
        out,
        num_tokens,
        out_features,
        rank,
        h.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        DOT_IEEE=exact,
    )
    return out


LORA_OPS: dict[str, LoraOp] = {
    "torch": lora_delta_reference,
    "grouped": lora_delta_grouped,
    "triton": lora_delta_triton,
}


def select_lora_op(device: torch.device, override: str | None = None) -> LoraOp:
    """override ("torch", "grouped", "triton"), else "triton" on CUDA and "grouped" elsewhere. Chosen
    once when the model is built."""
    default = "triton" if torch.device(device).type == "cuda" else "grouped"
    name = (override or "").strip().lower() or default
    if name not in LORA_OPS:
        raise ValueError(f"unknown LoRA op {name!r}; choose one of {sorted(LORA_OPS)}")
    if name == "triton" and torch.device(device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton LoRA op needs CUDA, or TRITON_INTERPRET=1 to run on the CPU")
    return LORA_OPS[name]
