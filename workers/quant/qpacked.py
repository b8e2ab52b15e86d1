"""Linear layers whose weight is packed for the integer-dot CPU matmul (`kernels.qgemm`): set and apply.

Runs in worker processes (and the preload daemon). The online int8 / int4 methods and the GGUF
method store one uint8 tensor per layer (`pack_qweight`'s layout) and describe it in the layer's
`quant_attrs` (the `QFormat` fields and the true output / input sizes), which the weight cache keeps
with the tensor; the other tensors a method names are left empty.
"""

from __future__ import annotations

import functools

import torch

from kernels.qgemm import QFormat, qgemm
from workers.quant.base import QuantLayer, QuantMethod


@functools.cache
def qformat(
    kind: str, group: int, zero: int, offsets: bool, half: bool = False, superblock: bool = False
) -> QFormat:
    return QFormat(kind, group, zero, offsets, half, superblock)


def set_qpacked(
    method: QuantMethod, layer: QuantLayer, packed: torch.Tensor, fmt: QFormat, shape: torch.Size | tuple
) -> None:
    """Make `packed` (of a [N, K] weight in `fmt`) the layer's weight; other named tensors become empty."""
    method.replace(layer, "weight", packed)
    for name in method.tensor_names():
        if name != "weight":
            method.replace(layer, name, torch.zeros(0, dtype=torch.float32))
    layer.quant_attrs = {"out_features": int(shape[0]), "in_features": int(shape[1]), **fmt.attrs()}


def apply_qpacked(layer: QuantLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    a = layer.quant_attrs
    fmt = qformat(a["kind"], a["group"], a["zero"], a["offsets"], a.get("half", False))
    y = qgemm(x, layer.weight, fmt, a["out_features"])
    return y if bias is None else y + bias
