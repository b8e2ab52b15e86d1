"""Building blocks shared by the decoder models: sharded linears, embeddings, RMSNorm, rotary, attention.

Runs in worker processes. Parameters are created with `torch.empty` so the loader's device/dtype
context decides where they live. Each parameter carries a `weight_loader(param, tensor, shard)` that
copies this rank's slice of a checkpoint tensor, which is how stacked projections (qkv, gate/up) and
tensor parallelism share one loading path. Norms and rotary compute through the model's ops strategy
(workers/models/ops.py), whose torch references follow Hugging Face's numerics exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels import AttentionBackend, AttentionMetadata
from workers.gguf.weights import GGUFTensor
from workers.models.ops import LayerOps, OpModule
from workers.parallel import TPGroup
from workers.quant.base import QuantLayer, QuantMethod, Unquantized

WeightLoader = Callable[[torch.Tensor, torch.Tensor, Any], None]
"""weight_loader(param, checkpoint tensor, shard): copy this rank's slice of the tensor into param."""

WEIGHT_LOADER = "weight_loader"  # the attribute of each parameter that workers/loader.py calls
# adds a LoRA delta to a projection's output: (input, output) -> output (workers/lora.py's LoRALayer)
LoRAHook = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def attach_weight_loader(param: torch.Tensor, loader: WeightLoader) -> None:
    """Give `param` its `weight_loader` (a plain attribute on the tensor, which torch's types lack)."""
    setattr(param, WEIGHT_LOADER, loader)


def weight_loader_of(param: torch.Tensor) -> WeightLoader:
    """The loader `attach_weight_loader` gave `param` (AttributeError if it has none)."""
    loader: WeightLoader = getattr(param, WEIGHT_LOADER)
    return loader


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
    """Copy a whole tensor (replicated parameters such as norms)."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match expected {tuple(param.shape)}")
    param.data.copy_(loaded)


class ColumnLinear(QuantLayer):
    """y = x @ W.T (+ b) with the output dimension split across TP ranks.

    `out_sizes` lists the stacked sub-projections (e.g. q, k, v); shard `i` of the checkpoint lands
    at its offset inside this rank's slice. `lora`, when adapters are served, adds their deltas.
    """

    lora: LoRAHook | None = None

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        bias: bool,
        tp: TPGroup,
        quant: QuantMethod | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.quant = quant or Unquantized()
        self.local_sizes = [tp.shard(s, "projection size") for s in out_sizes]
        self.quant.create_weights(self, sum(self.local_sizes), in_features)
        attach_weight_loader(self.weight, self.weight_loader)
        self.bias = _param(sum(self.local_sizes)) if bias else None
        if self.bias is not None:
            attach_weight_loader(self.bias, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        """Shard `shard` of the stacked sub-projections; with several and no shard, all of them fused
        in one checkpoint tensor (Phi-3's `qkv_proj`, `gate_up_proj`), each cut to this rank's slice."""
        if shard is None and len(self.local_sizes) > 1:
            fulls = [size * self.tp.size for size in self.local_sizes]
            if loaded.shape[0] != sum(fulls):
                raise ValueError(f"shape {tuple(loaded.shape)} does not match the fused {sum(fulls)} rows")
            for index, part in enumerate(loaded.split(fulls)):
                self.weight_loader(param, part, index)
            return
        index = 0 if shard is None else shard
        size = self.local_sizes[index]
        offset = sum(self.local_sizes[:index])
        full = size * self.tp.size
        if loaded.shape[0] != full or loaded.shape[1:] != param.shape[1:]:
            expected = (full, *param.shape[1:])
            raise ValueError(f"shape {tuple(loaded.shape)} does not match expected {expected}")
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant.apply(self, x, self.bias)
        return y if self.lora is None else self.lora(x, y)


class RowLinear(QuantLayer):
    """y = x @ W.T (+ b) with the input dimension split across TP ranks; partial sums are all-reduced
    (a LoRA delta, computed from this rank's input columns, before the reduction)."""

    lora: LoRAHook | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        quant: QuantMethod | None = None,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.quant = quant or Unquantized()
        self.reduce = reduce  # False: the caller reduces (an MoE layer, once for all its experts)
        self.local_in = tp.shard(in_features, "row-parallel input size")
        self.quant.create_weights(self, out_features, self.local_in)
        attach_weight_loader(self.weight, self.weight_loader)
        self.bias = _param(out_features) if bias else None
        if self.bias is not None:
            attach_weight_loader(self.bias, default_weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        expected = (param.shape[0], self.local_in * self.tp.size)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match expected {expected}")
        param.data.copy_(loaded.narrow(1, self.tp.rank * self.local_in, self.local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant.apply(self, x)
        y = y if self.lora is None else self.lora(x, y)
        y = self.tp.all_reduce(y) if self.reduce else y
        return y if self.bias is None else y + self.bias


class VocabEmbedding(nn.Module):
    """Token embedding with the vocabulary split across TP ranks (padded to a multiple of the size)."""

    weight: torch.Tensor  # a frozen Parameter; the LM head's may be tied to this one, or processed
    quant_attrs: dict[str, Any]  # only for a GGUF table kept in its stored bits (`load_gguf`)

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.local_vocab = -(-vocab_size // tp.size)
        self.start = tp.rank * self.local_vocab
        self.weight = _param(self.local_vocab, hidden)
        attach_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        if tuple(loaded.shape) != (self.vocab_size, param.shape[1]):
            expected = (self.vocab_size, param.shape[1])
            raise ValueError(f"shape {tuple(loaded.shape)} does not match expected {expected}")
        rows = max(0, min(self.local_vocab, self.vocab_size - self.start))
        param.data.zero_()
        param.data[:rows].copy_(loaded[self.start : self.start + rows])

    def load_gguf(self, tensor: GGUFTensor) -> None:
        """Keep this rank's rows of a GGUF embedding in their stored bits (a view of the file's mapped
        bytes; zero rows past the vocabulary, which decode to zeros): a lookup decodes only the rows it
        gathers, so no dequantized table is made (467 MB of bf16 on Qwen2.5 1.5B)."""
        hidden = int(self.weight.shape[1])
        if tensor.shape != (self.vocab_size, hidden):
            raise ValueError(f"shape {tensor.shape} does not match expected {(self.vocab_size, hidden)}")
        rows = max(0, min(self.local_vocab, self.vocab_size - self.start))
        raw = tensor.raw.narrow(0, self.start, rows)
        if rows < self.local_vocab:
            raw = torch.cat([raw, raw.new_zeros(self.local_vocab - rows, raw.shape[1])])
        dtype = str(self.weight.dtype).removeprefix("torch.")
        self.weight = nn.Parameter(raw, requires_grad=False)  # a tied head keeps the placeholder
        self.quant_attrs = {"gguf_type": tensor.qtype, "hidden": hidden, "dtype": dtype}

    @property
    def out_dtype(self) -> torch.dtype:
        """The dtype of the looked-up rows."""
        attrs = getattr(self, "quant_attrs", None) or {}
        return getattr(torch, attrs["dtype"]) if "gguf_type" in attrs else self.weight.dtype

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of this rank's table at `ids` (all within it)."""
        attrs = getattr(self, "quant_attrs", None) or {}
        if "gguf_type" not in attrs:
            return F.embedding(ids, self.weight)
        hidden = attrs["hidden"]
        picked = self.weight.index_select(0, ids.reshape(-1))
        rows = GGUFTensor(picked, attrs["gguf_type"], (ids.numel(), hidden))
        return rows.dequantize(self.out_dtype).view(*ids.shape, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.local_vocab)
        out = self.lookup(local.masked_fill(outside, 0))
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class LMHead(VocabEmbedding, QuantLayer):
    """Output projection to vocabulary logits (float32), gathered across TP ranks.

    `quant` (optional) is a method that processes and applies the head's weight like a linear layer's
    (the CPU fast path packs it); without one the head is a plain matmul in the weight's dtype.
    """

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, quant: QuantMethod | None = None) -> None:
        super().__init__(vocab_size, hidden, tp)
        if quant is not None:
            self.quant = quant

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        quant = getattr(self, "quant", None)
        local = F.linear(hidden, self.weight) if quant is None else quant.apply(self, hidden)
        logits = self.tp.all_gather_last_dim(local)
        return logits[..., : self.vocab_size].float()


class RMSNorm(OpModule):
    """Root-mean-square norm computed in float32, as Hugging Face's Llama/Qwen norms do (see ops.py)."""

    def __init__(self, size: int, eps: float, ops: LayerOps | None = None) -> None:
        super().__init__(ops)
        self.eps = eps
        self.weight = _param(size)
        attach_weight_loader(self.weight, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


# "longrope" with its short factors only: contexts up to `original_max_position_embeddings` (model_config
# refuses a longer --max-model-len)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict:
    """The rope settings of a config, whether in the newer `rope_parameters` or older `rope_scaling` form
    (with `layer_type`, that kind of layer's, from a config that gives them per kind)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params and layer_type is not None:
        params = dict(params[layer_type])
    elif params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding(OpModule):
    """Rotate-half (NeoX-style) rotary embedding with a precomputed cos/sin table.

    Inverse frequencies come from transformers' own rope initialisers, so scaled variants
    (linear, llama3, yarn) match Hugging Face exactly.
    """

    cos: torch.Tensor  # [max_positions, rotary_dim] buffers, registered by `materialize`
    sin: torch.Tensor

    def __init__(
        self,
        hf_config: Any,
        head_dim: int,
        max_positions: int,
        ops: LayerOps | None = None,
        layer_type: str | None = None,
    ) -> None:
        """`layer_type`: the rope parameters of that kind of layer, where the config gives them per
        kind (Gemma 3's `rope_parameters["sliding_attention"]`)."""
        super().__init__(ops)
        params = rope_parameters(hf_config, layer_type)
        rope_type = params["rope_type"]
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}"
            )
        rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        cpu = torch.device("cpu")
        if rope_type == "default":
            base = float(params["rope_theta"])
            exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=cpu).float() / rotary_dim
            inv_freq, scaling = 1.0 / (base**exponent), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            kind = {} if layer_type is None else {"layer_type": layer_type}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, cpu, **kind)
        self.rotary_dim = rotary_dim
        self.max_positions = max_positions
        self.inv_freq, self.scaling = inv_freq.float(), scaling  # host copies: tables can be rebuilt
        device = torch.get_default_device()
        if device.type == "meta":  # shapes only: `materialize` makes the tables real on the real device
            for name in ("cos", "sin"):
                table = torch.empty(max_positions, rotary_dim, dtype=torch.float32, device=device)
                self.register_buffer(name, table, persistent=False)
        else:
            self._build(device)

    def _rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables' rows at `positions`, on the host. Both halves of a row are equal: each is
        computed once."""
        freqs = torch.outer(positions, self.inv_freq)
        cos, sin = freqs.cos().mul_(self.scaling), freqs.sin().mul_(self.scaling)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def _build(self, device: torch.device) -> None:
        cos, sin = self._rows(torch.arange(self.max_positions, dtype=torch.float32))
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def materialize(self, device: torch.device) -> None:
        """Make the tables real on `device` for a model built on the meta device. Tables installed
        from the preload cache (built for as many positions or more, their last row checked against
        this model's rope) are kept, cut to `max_positions`: building 32k rows costs a tenth of a
        second of a warm restart, and a worker then touches only the rows it reads."""
        have, rows = self.cos, self.max_positions
        if not have.is_meta and have.device == device and have.shape[0] >= rows:
            last_cos, last_sin = self._rows(torch.tensor([rows - 1], dtype=torch.float32))
            if torch.equal(have[rows - 1 : rows].cpu(), last_cos) and torch.equal(
                self.sin[rows - 1 : rows].cpu(), last_sin
            ):
                self.register_buffer("cos", have[:rows], persistent=False)
                self.register_buffer("sin", self.sin[:rows], persistent=False)
                return
        self._build(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H, D], k: [T, Hkv, D]; the native op rotates them in place
        return self.ops.rotary(positions, q, k, self.cos, self.sin, self.rotary_dim)


class PagedAttention(nn.Module):
    """Multi-head attention over the paged KV cache through the chosen backend (no parameters).

    With an fp8 cache, `kv_scales` [2, Hkv] holds the per-kv-head key and value scales; while
    `kv_amax` is set (workers/kv_scales.py calibrating them) each step's largest |k| and |v| per kv
    head are folded into it.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None,
        backend: AttentionBackend,
        softcap: float = 0.0,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.softcap = softcap  # the scores' soft cap (Gemma 2), 0: none
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.kv_scales: torch.Tensor | None = None
        self.kv_amax: torch.Tensor | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.kv_amax is not None:
            n = meta.num_actual_tokens
            step = torch.stack([k[:n].abs().amax(dim=(0, 2)), v[:n].abs().amax(dim=(0, 2))]).float()
            self.kv_amax = torch.maximum(self.kv_amax, step)
        args = (meta, self.scale, self.sliding_window, self.kv_scales, self.softcap)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], *args)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V cached per token across all layers on one rank."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def local_kv_heads(num_kv_heads: int, tp: TPGroup) -> int:
    """KV heads held by one rank (KV heads are split across ranks)."""
    return max(1, math.ceil(num_kv_heads / tp.size))
