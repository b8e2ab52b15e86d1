"""The elementwise ops of the decoder layers (RMSNorm, rotary, SwiGLU, GeGLU) as one strategy per model.

Runs in worker processes. `TorchOps` holds the torch references (Hugging Face's numerics: RMSNorm in
float32, rotate-half rotary with cos/sin cast to the activation dtype); `NativeCpuOps` runs the fused
CPU ops of kernels/native.py, which round the same way. The worker picks one (`select_ops`) and
installs it on a built model once (`install_ops`); modules that use it derive from `OpModule` and
only say what they compute. Installing again (a test comparing both on one model) is the one way to
switch.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class LayerOps(Protocol):
    """What a decoder layer asks of its ops strategy."""

    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def rotary(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rotary_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...


class TorchOps:
    """The torch references: what every device can run."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    def rotary(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rotary_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half rotary on the first `rotary_dim` channels; q: [T, H, D], k: [T, Hkv, D]."""
        # cos/sin: [T, 1, rotary_dim]
        cos = cos[positions].unsqueeze(1).to(q.dtype)
        sin = sin[positions].unsqueeze(1).to(q.dtype)

        def rot(x: torch.Tensor) -> torch.Tensor:
            xr = x[..., :rotary_dim]
            x1, x2 = xr.chunk(2, dim=-1)
            out = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
            return out if rotary_dim == x.shape[-1] else torch.cat((out, x[..., rotary_dim:]), dim=-1)

        return rot(q), rot(k)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU on a stacked [gate | up] projection."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """GeGLU (tanh-approximated GELU, Gemma's) on a stacked [gate | up] projection."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class NativeCpuOps(TorchOps):
    """The fused CPU ops (torch.ops.ember.*); the norm falls back to torch where dtypes differ."""

    name = "native"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != weight.dtype:
            return super().rms_norm(x, weight, eps)
        return torch.ops.ember.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)

    def rotary(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rotary_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In place: q and k are rotated and returned."""
        torch.ops.ember.rotary_(positions, q, k, cos, sin, rotary_dim)
        return q, k

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ember.silu_and_mul(x.reshape(-1, x.shape[-1]))


TORCH_OPS = TorchOps()


def select_ops(native: bool) -> LayerOps:
    """The native CPU ops where they run (`kernels.native.use_native`), else the torch references."""
    return NativeCpuOps() if native else TORCH_OPS


class OpModule(nn.Module):
    """A module whose arithmetic goes through its model's ops strategy (the torch ones until installed)."""

    def __init__(self, ops: LayerOps | None = None) -> None:
        super().__init__()
        self.ops: LayerOps = ops if ops is not None else TORCH_OPS

    def ops_installed(self) -> None:
        """What the module prepares once its ops are installed on a loaded model (nothing by default)."""


def install_ops(model: nn.Module, ops: LayerOps) -> None:
    """Make every `OpModule` of `model` run on `ops`."""
    for module in model.modules():
        if isinstance(module, OpModule):
            module.ops = ops
            module.ops_installed()
