"""fp8_per_tensor: weights stored as float8 e4m3 with one float32 scale per tensor.

Runs in worker processes. On CUDA devices with fp8 tensor cores (compute capability >= 8.9) the
weight is stored transposed ([in, out], column-major for `torch._scaled_mm`) and activations are
quantized per tensor on the fly; elsewhere the weight stays [out, in] and is dequantized to the
activation dtype for the matmul (memory halves or quarters; compute stays in the compute dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_gemm import gemm_fp8, pack_fp8
from workers.quant.base import QuantLayer, QuantMethod

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 tensor, float32 scale of shape [1]) with w ~= q * scale."""
    scale = (w.abs().max().float() / FP8_MAX).clamp(min=1e-12).reshape(1)
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def has_fp8_matmul(device: torch.device) -> bool:
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8PerTensor(QuantMethod):
    name = "fp8_per_tensor"
    native_layout = "cpu_fp8_packed16"

    def head_method(self) -> QuantMethod | None:
        if self.params.get("layout") != self.native_layout:
            return None
        from workers.quant.packed import PackedBf16

        return PackedBf16()  # a bf16 head, packed for the native matmul like the unquantized path's

    def tensor_names(self) -> tuple[str, ...]:
        return ("weight", "weight_scale")

    def process_weights_after_loading(self, layer: QuantLayer) -> None:
        q, scale = quantize_per_tensor(layer.weight.data)
        if self.params.get("layout") == self.native_layout:
            self.replace(layer, "weight", pack_fp8(q))
            self.replace(layer, "weight_scale", scale)
            layer.quant_attrs = {"out_features": int(q.shape[0])}
            return
        transposed = has_fp8_matmul(q.device)
        if transposed:
            q = q.t()  # [in, out] with stride (1, in): the column-major operand _scaled_mm wants
        self.replace(layer, "weight", q)
        self.replace(layer, "weight_scale", scale)
        layer.quant_attrs = {"transposed": transposed}

    def apply(self, layer: QuantLayer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w, scale = layer.weight, layer.weight_scale
        if "out_features" in layer.quant_attrs:
            y = gemm_fp8(x, w, scale, layer.quant_attrs["out_features"])
            return y if bias is None else y + bias
        if layer.quant_attrs["transposed"] and x.shape[-1] % 16 == 0 and w.shape[1] % 16 == 0:
            x2 = x.reshape(-1, x.shape[-1])
            xq, xs = quantize_per_tensor(x2)
            out = torch._scaled_mm(xq, w, scale_a=xs, scale_b=scale, bias=bias, out_dtype=x.dtype)
            return out.reshape(*x.shape[:-1], w.shape[1])
        dense = w.t() if layer.quant_attrs["transposed"] else w
        return F.linear(x, dense.to(x.dtype) * scale.to(x.dtype), bias)
