"""int8: weight-only int8 with one scale per output channel (w8a16).

Runs in worker processes. The weight is stored [out, in] int8 with scales [out] in the compute
dtype; the matmul runs in the activation dtype on the int8 weight converted on the fly, with the
scales applied to the output. (torch's fused `_weight_int8pack_mm` was measured 20-40x slower than
this on AVX2 CPUs without VNNI, so it is not used.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.quant.base import QuantLayer, QuantMethod


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], float32 scales [out]) with w ~= q * scale[:, None], symmetric in [-127, 127]."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8WeightOnly(QuantMethod):
    name = "int8"

    def tensor_names(self) -> tuple[str, ...]:
        return ("weight", "weight_scale")

    def process_weights_after_loading(self, layer: QuantLayer) -> None:
        dtype = layer.weight.dtype
        q, scale = quantize_per_channel(layer.weight.data)
        self.replace(layer, "weight", q.contiguous())
        self.replace(layer, "weight_scale", scale.to(dtype))

    def apply(self, layer: QuantLayer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = F.linear(x, layer.weight.to(x.dtype)) * layer.weight_scale.to(x.dtype)
        return out if bias is None else out + bias
