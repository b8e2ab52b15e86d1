"""Attention backends: the one call an attention layer makes per forward step.

A backend writes the step's new keys/values into the layer's paged cache, then runs decode
attention on the leading decode rows and prefill attention on the rest. `TorchBackend` uses the
pure-torch references (debugging, or CPUs without the native ops); `CpuBackend` the native CPU decode
op; `TritonBackend` the Triton kernels (CUDA). The
runner picks one at start-up with `select_backend` and keeps it for the life of the process.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from kernels.metadata import AttentionMetadata
from kernels.native import use_native
from kernels.torch_ops import (
    decode_attention_cpu,
    decode_attention_torch,
    prefill_attention_torch,
    quantize_kv,
    write_kv_cpu,
    write_kv_torch,
)

ENV_VAR = "EMBER_ATTENTION_BACKEND"


class AttentionBackend(ABC):
    """What an attention layer calls once per step."""

    name: str

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        kv_scales: torch.Tensor | None = None,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> out [T, H, D]; also writes k/v into the cache. kv_scales
        [2, Hkv]: the per-kv-head scales of an fp8 cache (kernels/torch_ops.py); softcap: the scores'
        soft cap (softcap * tanh(score / softcap); 0: none)."""


class PagedAttentionBackend(AttentionBackend):
    """Cache write, then decode op on the leading decode rows and prefill op on the rest.

    Subclasses plug in the three ops (staticmethods, or attributes set when built) and may add
    decode-only options.
    """

    write_kv_op: Callable[..., None]
    decode_op: Callable[..., torch.Tensor]
    prefill_op: Callable[..., torch.Tensor]

    def decode_options(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> dict:
        return {}

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        kv_scales: torch.Tensor | None = None,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """See `AttentionBackend.forward`; rows past num_actual_tokens (padding) come back as zeros."""
        n_act, nd = meta.num_actual_tokens, meta.num_decode_tokens
        keys = quantize_kv(k[:n_act], k_cache.dtype, kv_scales, 0)
        values = quantize_kv(v[:n_act], v_cache.dtype, kv_scales, 1)
        self.write_kv_op(keys, values, k_cache, v_cache, meta.slot_mapping[:n_act])
        extra: dict = {} if kv_scales is None else {"kv_scales": kv_scales}
        if softcap:
            extra["softcap"] = softcap
        out = torch.empty_like(q)
        if out.shape[0] > n_act:
            out[n_act:].zero_()
        if nd > 0:
            opts = self.decode_options(q, k_cache, meta) | extra
            table, lens = meta.block_tables[:nd], meta.seq_lens[:nd]
            self.decode_op(q[:nd], k_cache, v_cache, table, lens, scale, sliding_window, out=out[:nd], **opts)
        if n_act > nd:
            # Re-base the prefill requests' metadata so that their first query row is row 0.
            self.prefill_op(
                q[nd:n_act],
                k_cache,
                v_cache,
                meta.block_tables[nd:],
                meta.query_start_loc[nd:] - nd,
                meta.seq_lens[nd:],
                scale,
                sliding_window,
                [x - nd for x in meta.query_start_loc_cpu[nd:]],
                meta.seq_lens_cpu[nd:],
                out=out[nd:n_act],
                **extra,
            )
        return out


class TorchBackend(PagedAttentionBackend):
    name = "torch"
    write_kv_op = staticmethod(write_kv_torch)
    decode_op = staticmethod(decode_attention_torch)
    prefill_op = staticmethod(prefill_attention_torch)


class CpuBackend(PagedAttentionBackend):
    """The native CPU cache write and decode op; prefill stays on the torch reference (SDPA)."""

    name = "cpu"
    write_kv_op = staticmethod(write_kv_cpu)
    decode_op = staticmethod(decode_attention_cpu)
    prefill_op = staticmethod(prefill_attention_torch)


class TritonBackend(PagedAttentionBackend):
    """The Triton kernels, imported when this backend is built (Triton's import is ~0.4 s)."""

    name = "triton"

    def __init__(self) -> None:
        from kernels.decode_attention import choose_num_splits, decode_attention_triton
        from kernels.kv_write import write_kv_triton
        from kernels.prefill_attention import prefill_attention_triton

        self.write_kv_op, self.decode_op = write_kv_triton, decode_attention_triton
        self.prefill_op, self._num_splits = prefill_attention_triton, choose_num_splits

    def decode_options(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> dict:
        nd = meta.num_decodes
        return {"num_splits": self._num_splits(nd, k_cache.shape[2], meta.max_seq_len, q.device)}


BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchBackend,
    "cpu": CpuBackend,
    "triton": TritonBackend,
}


def select_backend(device: torch.device, override: str | None = None) -> AttentionBackend:
    """override > $EMBER_ATTENTION_BACKEND > "triton" on CUDA; on CPU "cpu" where the native ops
    run (kernels/native.py), else "torch"."""
    name = (override or os.environ.get(ENV_VAR) or "").strip().lower()
    if not name:
        name = "triton" if torch.device(device).type == "cuda" else "cpu" if use_native(device) else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)}")
    if name == "triton" and torch.device(device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton attention backend needs CUDA, or TRITON_INTERPRET=1 to run on the CPU")
    if name == "cpu" and not use_native(device, "native"):
        raise ValueError("the cpu attention backend needs a CPU device")
    return BACKENDS[name]()
