"""A linear layer as the native CPU ops' segment specs, for the ops that chain matmuls in C++.

Runs in worker processes, after loading. The one-call decoder layers (fused_decode.py,
kernels/csrc/cpu_decoder.cpp) and the one-call MoE layer (moe.py, kernels/csrc/cpu_moe.cpp) take each
linear as its segments: a packed tensor and six ints (kind, group, zero, offsets, params, rows), kind
being a qgemm format (kernels/qgemm.py's KINDS index) or SEG_BF16 / SEG_FP8.
"""

from __future__ import annotations

import torch

from kernels.qgemm import KINDS
from workers.models.layers import ColumnLinear, RowLinear
from workers.quant.fp8 import Fp8PerTensor
from workers.quant.gguf import GGUFPacked
from workers.quant.packed import PackedBf16

SEG_BF16, SEG_FP8 = -1, -2  # segment kinds of the native ops besides the qgemm kinds (0 .. 3)


def segments(lin: ColumnLinear | RowLinear) -> list[tuple[torch.Tensor, list[int]]] | None:
    """(packed tensor, spec) of each native matmul the linear's method runs, or None when it runs
    something else: packed bf16, fp8 in the native layout, or the integer-dot formats (int8 / int4,
    and a GGUF layer's segments)."""
    attrs = getattr(lin, "quant_attrs", {})
    if type(lin.quant) is PackedBf16:
        return [(lin.weight, [SEG_BF16, 0, 0, 0, 0, attrs["out_features"]])]
    if isinstance(lin.quant, Fp8PerTensor) and "out_features" in attrs:
        return [(lin.weight, [SEG_FP8, 0, 0, 0, 0, attrs["out_features"]])]
    if isinstance(lin.quant, GGUFPacked) and "segments" not in attrs:  # a float GGUF tensor, packed bf16
        return [(lin.weight, [SEG_BF16, 0, 0, 0, 0, attrs["out_features"]])]
    if isinstance(lin.quant, GGUFPacked):
        views = lin.quant.segment_views(lin)
        return [(v, [KINDS.index(f.kind), f.group, f.zero, int(f.offsets), f.params, n]) for v, f, n in views]
    if "kind" in attrs:  # online int8 / int4 on qgemm
        spec = [KINDS.index(attrs["kind"]), attrs["group"], attrs["zero"], int(attrs["offsets"]), 0]
        return [(lin.weight, spec + [attrs["out_features"]])]
    return None


def fp8_scale(lin: ColumnLinear | RowLinear) -> torch.Tensor:
    """The linear's fp8 scale, or an empty tensor (the native ops' "none")."""
    scale = getattr(lin, "weight_scale", None) if isinstance(lin.quant, Fp8PerTensor) else None
    return torch.empty(0) if scale is None else scale
