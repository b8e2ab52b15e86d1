"""Online quantization methods, chosen by name (`--quantization`); importing this never loads torch.

Runs in worker processes (and the config validates names in every process). `resolve_name` maps
aliases and refuses unknown methods with the list of supported ones; `make_method` builds the
`QuantMethod` that every linear layer of the model shares (for no quantization, the linear kernel
chosen by `kernels.cpu_gemm.select_linear_kernel` decides between plain and packed bf16 weights, or
a GGUF checkpoint's own quantized weights; a method with a native CPU layout gets `layout=` it under
that kernel).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from coreproc.base.model_config import resolve_quantization

log = logging.getLogger("ember.quant")

QUANT_METHODS: dict[str, str] = {
    "fp8_per_tensor": "workers.quant.fp8:Fp8PerTensor",
    "int8": "workers.quant.int8:Int8WeightOnly",
    "int4": "workers.quant.int4:Int4Grouped",
}


def resolve_name(name: str | None) -> str | None:
    """The canonical method name (None: no quantization); ConfigError for unknown names."""
    return resolve_quantization(name)


def make_method(name: str | None, kernel: str = "torch", gguf: bool = False, **params: Any) -> Any:
    """The method object for a canonical name (None: unquantized, packed for the "cpu_bf16" kernel, or
    for a GGUF checkpoint under that kernel its own quantized weights repacked)."""
    if name is None and kernel == "cpu_bf16" and gguf:
        from workers.quant.gguf import GGUFPacked

        return GGUFPacked()
    if name is None and kernel == "cpu_bf16":
        from workers.quant.packed import PackedBf16

        return PackedBf16()
    if name is None:
        from workers.quant.base import Unquantized

        return Unquantized()
    module, attr = QUANT_METHODS[name].split(":")
    cls = getattr(importlib.import_module(module), attr)
    if kernel == "cpu_bf16" and cls.native_layout is not None:
        params = {**params, "layout": cls.native_layout}
    return cls(**params)
