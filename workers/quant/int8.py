"""int8: weight-only int8 (w8a16), per output channel, or per 32 inputs on the CPU fast path.

Runs in worker processes. Default layout: the weight is stored [out, in] int8 with scales [out] in
the compute dtype; the matmul runs in the activation dtype on the int8 weight converted on the fly,
with the scales applied to the output. (torch's fused `_weight_int8pack_mm` was measured 20-40x
slower than this on AVX2 CPUs without VNNI, so it is not used.) Native CPU layout (bf16 engines where
the native ops build): one scale per row and 32 inputs, GGUF's Q8_0 groups, packed for
`kernels.qgemm.qgemm`, which multiplies the int8 bytes with int8-quantized activations (the input
size is padded to a multiple of 32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.qgemm import XGROUP, QFormat, pack_qweight, padded_k
from workers.quant.base import QuantLayer, QuantMethod
from workers.quant.qpacked import apply_qpacked, set_qpacked


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], float32 scales [out]) with w ~= q * scale[:, None], symmetric in [-127, 127]."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_groups(w: torch.Tensor, group: int = XGROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], float32 scales [out, ceil(in / group)]): symmetric in [-127, 127] per row and
    group of `group` inputs (GGUF's Q8_0 rounding; a last partial group is padded with zeros)."""
    out, k = w.shape
    kp = padded_k(k) if group == XGROUP else -(-k // group) * group
    g = torch.zeros(out, kp, dtype=torch.float32, device=w.device)
    g[:, :k] = w.float()
    g = g.view(out, kp // group, group)
    scale = g.abs().amax(dim=2) / 127.0
    q = torch.round(g / scale.clamp(min=1e-12).unsqueeze(2)).clamp(-127, 127).to(torch.int8)
    return q.view(out, kp)[:, :k], scale


class Int8WeightOnly(QuantMethod):
    name = "int8"
    native_layout = "cpu_int8_q8_0_qgemm"

    def head_method(self) -> QuantMethod | None:
        if self.params.get("layout") != self.native_layout:
            return None
        from workers.quant.packed import PackedBf16

        return PackedBf16()  # a bf16 head, packed for the native matmul like the unquantized path's

    def tensor_names(self) -> tuple[str, ...]:
        return ("weight", "weight_scale")

    def process_weights_after_loading(self, layer: QuantLayer) -> None:
        dtype = layer.weight.dtype
        w = layer.weight.data
        if self.params.get("layout") == self.native_layout:
            fmt = QFormat("i8")
            set_qpacked(self, layer, pack_qweight(*quantize_groups(w), fmt), fmt, w.shape)
            return
        q, scale = quantize_per_channel(w)
        self.replace(layer, "weight", q.contiguous())
        self.replace(layer, "weight_scale", scale.to(dtype))
        layer.quant_attrs = {}

    def apply(self, layer: QuantLayer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if "kind" in getattr(layer, "quant_attrs", {}):
            return apply_qpacked(layer, x, bias)
        out = F.linear(x, layer.weight.to(x.dtype)) * layer.weight_scale.to(x.dtype)
        return out if bias is None else out + bias
