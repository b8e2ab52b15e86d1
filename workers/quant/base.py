"""The interface every quantization method implements, and the unquantized method.

Runs in worker processes. A method is shared by all linear layers of a model and keeps no per-layer
state itself: it creates a layer's checkpoint-precision weight, turns it into its processed form
after loading (the expensive pass), and computes the layer's matmul; the layers it serves are
`QuantLayer`s, which declare the attributes methods create. `layout(layer)` describes the
processed tensors exactly (shape, stride, dtype, attributes such as a transpose or a group size) so a
weight cache can rebuild the layer from them; `cacheable` says whether that is allowed.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TensorSpec:
    """Enough to rebuild a processed tensor from raw bytes."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."))


class QuantLayer(nn.Module):
    """A layer whose weight a QuantMethod owns (ColumnLinear, RowLinear, LMHead): the attributes the
    methods create on it, declared once. Only `weight` always exists; the others exist once a method
    that uses them has processed the layer (`weight_scale`: fp8, int8, int4; `weight_zero`: int4;
    `quant_attrs`: fp8, int4, packed bf16), so code that may meet any method probes with getattr."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_zero: torch.Tensor
    quant_attrs: dict[str, Any]


class QuantMethod(ABC):
    """Create -> load (checkpoint precision) -> process_weights_after_loading -> apply."""

    name: ClassVar[str]
    cacheable: ClassVar[bool] = True  # processed weights may be served from the preload cache
    native_layout: ClassVar[str | None] = None  # its packed layout for the native CPU matmul, if any

    def __init__(self, **params: Any) -> None:
        self.params = params

    def config(self) -> dict[str, Any]:
        return {"method": self.name, **self.params}

    def config_hash(self) -> str:
        """Stable across processes and runs: sha256 of the sorted JSON config."""
        return hashlib.sha256(json.dumps(self.config(), sort_keys=True).encode()).hexdigest()

    def create_weights(self, layer: QuantLayer, out_features: int, in_features: int) -> None:
        """The weight the checkpoint loads into (compute dtype, [out, in])."""
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    @abstractmethod
    def process_weights_after_loading(self, layer: QuantLayer) -> None:
        """Replace the loaded weight by its processed form."""

    @abstractmethod
    def apply(self, layer: QuantLayer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias) for the layer's processed weight."""

    def head_method(self) -> QuantMethod | None:
        """The method for an untied LM head's weight, or None to keep a plain matmul (the default:
        quantizing the head costs accuracy that weight-only methods do not pay elsewhere)."""
        return None

    def tensor_names(self) -> tuple[str, ...]:
        return ("weight",)

    def layout(self, layer: QuantLayer) -> dict[str, Any]:
        """Processed tensors (name -> TensorSpec) and layer attributes, for rebuilding the layer."""
        tensors = {n: TensorSpec.of(getattr(layer, n)) for n in self.tensor_names()}
        return {"method": self.config(), "tensors": tensors, "attrs": dict(getattr(layer, "quant_attrs", {}))}

    @staticmethod
    def replace(layer: nn.Module, name: str, value: torch.Tensor) -> None:
        """Swap a parameter for its processed tensor (frozen; dtype may be integer or float8)."""
        if name in layer._parameters:
            del layer._parameters[name]
        layer.register_parameter(name, nn.Parameter(value, requires_grad=False))


class Unquantized(QuantMethod):
    name = "none"

    def process_weights_after_loading(self, layer: QuantLayer) -> None:
        pass

    def apply(self, layer: QuantLayer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
