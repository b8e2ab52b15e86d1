"""int4: weight-only, group-wise asymmetric int4 with packed storage (w4a16).

Runs in worker processes. Each output row is split into groups of `group_size` input columns (32 by
default, GGUF's block size: weights that come from a 4-bit GGUF are reproduced exactly; the gcd with
the row length when it does not divide it, recorded in the layer's attributes); each group has a
scale and a float zero point. Storage: uint8 [out, in/2] (two values per byte) plus scales
and zeros [out, in/group] in the compute dtype. Matmul: the Triton dequant-matmul kernel on CUDA, the
torch reference (dequantize, then dense matmul) elsewhere. Native CPU layout (bf16 engines where the
native ops build, groups of 32): the same values repacked for `kernels.qgemm.qgemm` (a scale and an
offset per row and group), which multiplies the nibbles with int8-quantized activations.
"""

from __future__ import annotations

import math

import torch

from kernels.int4_matmul import int4_matmul_torch, int4_matmul_triton, pack_int4, unpack_int4
from kernels.qgemm import XGROUP, QFormat, pack_qweight
from workers.quant.base import QuantLayer, QuantMethod
from workers.quant.qpacked import apply_qpacked, set_qpacked


def quantize_groupwise(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [N, K/2], scales [N, K/group], zeros [N, K/group]), all from a [N, K] weight."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    # a float zero point (stored in the compute dtype anyway): `lo` maps to 0 exactly. Rounded to an
    # integer it shifted every weight of the group by up to half a step, which wrecked weights that were
    # already on a 4-bit grid with a float minimum (GGUF Q4_1 / Q4_K: SmolLM2's top-1 fell to 0.56)
    zero = -lo / scale
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15).reshape(n, k)
    return pack_int4(q), scale, zero


class Int4Grouped(QuantMethod):
    name = "int4"
    native_layout = "cpu_int4_qgemm"

    def __init__(self, group_size: int = 32, **params: object) -> None:
        super().__init__(group_size=group_size, **params)
        self.group_size = group_size

    @property
    def native(self) -> bool:
        return self.params.get("layout") == self.native_layout and self.group_size == XGROUP

    def head_method(self) -> QuantMethod | None:
        if not self.native:
            return None
        from workers.quant.packed import PackedBf16

        return PackedBf16()  # a bf16 head, packed for the native matmul like the unquantized path's

    def tensor_names(self) -> tuple[str, ...]:
        return ("weight", "weight_scale", "weight_zero")

    def process_weights_after_loading(self, layer: QuantLayer) -> None:
        w = layer.weight.data
        k = w.shape[1]
        if k % 2:
            raise ValueError(f"int4 needs an even input size, got {k}")
        group = self.group_size if k % self.group_size == 0 else math.gcd(k, self.group_size)
        packed, scale, zero = quantize_groupwise(w, group)
        if self.native and group == XGROUP:
            fmt = QFormat("u4", offsets=True)
            blocks = pack_qweight(unpack_int4(packed), scale, fmt, -zero * scale)
            set_qpacked(self, layer, blocks, fmt, w.shape)
            return
        self.replace(layer, "weight", packed)
        self.replace(layer, "weight_scale", scale.to(w.dtype))
        self.replace(layer, "weight_zero", zero.to(w.dtype))
        layer.quant_attrs = {"group_size": group, "in_features": k}

    def apply(self, layer: QuantLayer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if "kind" in layer.quant_attrs:
            return apply_qpacked(layer, x, bias)
        group = layer.quant_attrs["group_size"]
        x2 = x.reshape(-1, x.shape[-1])
        matmul = int4_matmul_triton if x.device.type == "cuda" else int4_matmul_torch
        out = matmul(x2, layer.weight, layer.weight_scale, layer.weight_zero, group)
        out = out.reshape(*x.shape[:-1], layer.weight.shape[0])
        return out if bias is None else out + bias
