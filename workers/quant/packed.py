"""Unquantized bf16 linears on the CPU fast path: weights packed once for the native matmul.

Runs in worker processes (and the preload daemon) when `select_linear_kernel` picked "cpu_bf16".
The method keeps the checkpoint's bf16 values exactly, only rearranged (kernels/cpu_gemm.py), so its
results differ from torch's bf16 matmul only by summation order (it accumulates in float32). The
packed layout (16-row blocks for the FMA kernels, or AMX tiles where the build runs on AMX) is a
processed form like any quantization's: the preload cache and snapshot weight files hold it, and the
method's config (part of the cache fingerprint) names it.
"""

from __future__ import annotations

import torch

from kernels.cpu_gemm import bf16_layout, gemm_bf16, pack_bf16
from workers.quant.base import QuantLayer, QuantMethod


class PackedBf16(QuantMethod):
    name = "none"

    def config(self) -> dict:
        return {"method": self.name, "layout": f"cpu_bf16_{bf16_layout()}"}

    def head_method(self) -> QuantMethod:
        return self  # the head is the largest single matmul of a decode step: pack it too

    def process_weights_after_loading(self, layer: QuantLayer) -> None:
        weight = layer.weight.data
        self.replace(layer, "weight", pack_bf16(weight))
        layer.quant_attrs = {"out_features": int(weight.shape[0])}

    def apply(self, layer: QuantLayer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = gemm_bf16(x, layer.weight, layer.quant_attrs["out_features"])
        return y if bias is None else y + bias
