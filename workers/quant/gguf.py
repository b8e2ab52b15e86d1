"""gguf: a GGUF checkpoint's quantized weights in their own bits, on the CPU integer-dot matmul.

Runs in worker processes (and the preload daemon). Chosen for a GGUF checkpoint on the CPU fast path
when no `--quantization` is given. The loader hands each layer its tensors' stored bytes
(`workers.gguf.weights.GGUFTensor`, through `load_quantized`), sliced for this rank (rows of a fused
projection's shard, inputs of a row-parallel layer at group boundaries, a vocabulary shard). After
loading, the shards of a layer that share a format are packed together (`kernels.qgemm`): natively
straight from the file's bytes (`workers.gguf.weights.pack_tensors`), else repacked exactly first
(`workers.gguf.repack`). A fused layer whose shards differ (Q5_0 q and k, Q8_0 v) keeps one segment per
format, all in one flat uint8 tensor described by `quant_attrs`, and its matmul concatenates the
segments' outputs. A layer the file stores in floats (F16 / F32) gets the packed bf16 matmul. The LM
head is packed like any layer (tied heads too: the embedding keeps the stored rows and decodes
those it looks up).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.cpu_gemm import bf16_layout, gemm_bf16, pack_bf16
from kernels.qgemm import QFormat, qgemm
from workers.gguf.repack import Repacked, concat
from workers.gguf.weights import GGUFTensor, pack_tensors
from workers.quant.base import QuantLayer, QuantMethod
from workers.quant.qpacked import qformat

PARTS = "gguf_parts"  # plain attribute of a layer while it loads: shard index -> Repacked
VIEWS = "gguf_views"  # plain attribute, built on first use: [(packed view, format, rows)]


class GGUFPacked(QuantMethod):
    name = "gguf"
    native_layout = "cpu_gguf_qgemm2"  # 2: the K-quants in superblocks

    def config(self) -> dict[str, Any]:  # float-stored tensors take pack_bf16's layout
        return {"method": self.name, "layout": self.native_layout, "bf16": bf16_layout()}

    def head_method(self) -> QuantMethod:
        return self

    def load_quantized(self, layer: QuantLayer, tensor: GGUFTensor, shard: int | None) -> None:
        """Keep this rank's part of a checkpoint tensor (its bytes, or repacked where a slice cuts the
        type's blocks) and the rows it fills until the layer is processed."""
        parts: dict[int, tuple[GGUFTensor | Repacked, int]] = layer.__dict__.setdefault(PARTS, {})
        mod: Any = layer  # a ColumnLinear, RowLinear or LMHead (their sizes, by duck typing)
        tp = getattr(mod, "tp", None)
        rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
        local_sizes = getattr(mod, "local_sizes", None)
        if local_sizes is not None:  # ColumnLinear: shard `shard` of the stacked outputs, or all of them
            indices = range(len(local_sizes)) if shard is None else [shard]
            k, start = int(mod.weight.shape[1]), 0
            expected = (sum(local_sizes[i] for i in indices) * size, k)
            if tensor.shape != expected:
                raise ValueError(f"shape {tensor.shape} does not match expected {expected}")
            for index in indices:  # a tensor fused in the checkpoint (Phi-3's) holds every shard
                rows = local_sizes[index]
                parts[index] = tensor.narrow_rows(start + rank * rows, rows), rows
                start += rows * size
        elif hasattr(mod, "local_in"):  # RowLinear: this rank's inputs
            n, k = int(mod.weight.shape[0]), mod.local_in
            if tensor.shape != (n, k * size):
                raise ValueError(f"shape {tensor.shape} does not match expected {(n, k * size)}")
            part: GGUFTensor | Repacked | None = tensor.narrow_cols(rank * k, k)
            if part is None:  # not whole blocks: exact integers, then a slice at group boundaries
                try:
                    part = tensor.repack().narrow_cols(rank * k, k)
                except ValueError as e:
                    what = f"{tensor.type_name}: tensor parallelism over {size} ranks"
                    raise ValueError(f"{what}: {e}") from None
            parts[0] = part, n
        else:  # LMHead: this rank's vocabulary rows, zero past the vocabulary
            vocab, hidden = mod.vocab_size, int(mod.weight.shape[1])
            if tensor.shape != (vocab, hidden):
                raise ValueError(f"shape {tensor.shape} does not match expected {(vocab, hidden)}")
            rows = max(0, min(mod.local_vocab, vocab - mod.start))
            parts[0] = tensor.narrow_rows(mod.start, rows), mod.local_vocab

    def process_weights_after_loading(self, layer: QuantLayer) -> None:
        parts: dict[int, tuple[GGUFTensor | Repacked, int]] = layer.__dict__.pop(PARTS, {})
        n, k = (int(s) for s in layer.weight.shape)
        if not parts:  # stored in floats
            self.replace(layer, "weight", pack_bf16(layer.weight.data))
            layer.quant_attrs = {"out_features": n}
            return
        expected = len(getattr(layer, "local_sizes", [0]))
        if len(parts) != expected:
            raise ValueError(f"a fused layer mixes quantized and float shards ({len(parts)} of {expected})")
        runs: list[list[tuple[GGUFTensor | Repacked, int]]] = []
        for index in sorted(parts):
            if runs and runs[-1][0][0].fmt == parts[index][0].fmt:
                runs[-1].append(parts[index])
            else:
                runs.append([parts[index]])
        packed: list[torch.Tensor] = []
        segments: list[dict[str, Any]] = []
        offset = 0
        for run in runs:
            rows, fmt = sum(r for _, r in run), run[0][0].fmt
            lazy = [p for p, _ in run if isinstance(p, GGUFTensor)]
            blocks = pack_tensors(lazy, rows) if len(lazy) == len(run) else None
            if blocks is None:  # repacked first, then packed
                whole = concat([as_repacked(p).pad_rows(r) for p, r in run])
                blocks = whole.pack()
            packed.append(blocks.reshape(-1))
            segments.append({"rows": rows, "offset": offset, "shape": list(blocks.shape), **fmt.attrs()})
            offset += blocks.numel()
        assert sum(s["rows"] for s in segments) == n, "the parts fill the layer"
        self.replace(layer, "weight", torch.cat(packed) if len(packed) > 1 else packed[0])
        layer.quant_attrs = {"out_features": n, "in_features": k, "segments": segments}

    def segment_views(self, layer: QuantLayer) -> list[tuple[torch.Tensor, QFormat, int]]:
        """(packed view, format, rows) of each segment of a quantized layer, built once."""
        views: list[tuple[torch.Tensor, QFormat, int]] | None = layer.__dict__.get(VIEWS)
        if views is None:
            views = []
            for s in layer.quant_attrs["segments"]:
                size = s["shape"][0] * s["shape"][1] * s["shape"][2]
                view = layer.weight.narrow(0, s["offset"], size).view(*s["shape"])
                flags = s.get("half", False), s.get("superblock", False)
                fmt = qformat(s["kind"], s["group"], s["zero"], s["offsets"], *flags)
                views.append((view, fmt, s["rows"]))
            layer.__dict__[VIEWS] = views
        return views

    def apply(self, layer: QuantLayer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        attrs = layer.quant_attrs
        if "segments" not in attrs:
            y = gemm_bf16(x, layer.weight, attrs["out_features"])
            return y if bias is None else y + bias
        views = self.segment_views(layer)
        if len(views) == 1:
            y = qgemm(x, *views[0])
        else:
            y = torch.cat([qgemm(x, *v) for v in views], dim=-1)
        return y if bias is None else y + bias


def as_repacked(part: GGUFTensor | Repacked) -> Repacked:
    return part.repack() if isinstance(part, GGUFTensor) else part
