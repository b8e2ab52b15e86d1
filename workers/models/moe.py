"""The mixture-of-experts MLP: a router picks each token's experts, only those compute, their outputs
are combined by the router's weights (and a shared expert's added).

Runs in worker processes, in place of a decoder layer's dense MLP where the model's parts say
(`DecoderParts.moe`, parts.py). One module serves every MoE family; `MoEParts` names what differs:
how scores are made and the top-k picked (`route`: softmax then top-k, Mixtral / Qwen / OLMoE, with
or without renormalizing the k weights; top-k of the logits then softmax, Granite), and a shared
expert with or without its sigmoid gate (Qwen2-MoE). The forward groups tokens by expert (one sort),
runs each selected expert's gate/up and down projections over its tokens only (so a decode step
reads only the selected experts' weights) and adds them back weighted, in expert order. Each expert
is a pair of the model's own linears, so every weight format (bf16 packing, fp8, int8, int4, GGUF
bits) and its native kernel applies to experts as to any layer. With tensor parallelism each expert's
intermediate dimension is split across ranks; the partial sums meet in one all-reduce per layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.layers import ColumnLinear, RowLinear, attach_weight_loader, default_weight_loader
from workers.models.ops import OpModule
from workers.parallel import TPGroup
from workers.quant.base import QuantMethod

SCORINGS = ("softmax", "topk_softmax")
# a layer's experts stacked in one tensor (a GGUF file's `ffn_*_exps`, read under these names)
STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|gate_up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class MoEParts:
    """A model's experts: how many, how many per token, their size, and how they are routed."""

    num_experts: int
    top_k: int
    intermediate: int  # one expert's intermediate size
    scoring: str = "softmax"  # one of SCORINGS
    renormalize: bool = False  # the k softmax weights scaled to sum to 1
    shared_intermediate: int = 0  # a shared expert every token goes through (0: none)
    shared_gate: bool = False  # the shared expert's output times sigmoid(gate(x)) (Qwen2-MoE)

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"expert scoring {self.scoring!r} is not one of {SCORINGS}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top-{self.top_k} of {self.num_experts} experts")


def route(logits: torch.Tensor, moe: MoEParts) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's expert weights (float32) and ids, [T, top_k] each, from router logits [T, E]."""
    if moe.scoring == "topk_softmax":
        top, ids = torch.topk(logits, moe.top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), moe.top_k, dim=-1)
    if moe.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def split_experts(name: str, tensor: Any, num_experts: int) -> Iterator[tuple[str, Any]]:
    """A checkpoint tensor as the parameters it holds: a stacked [E, rows, cols] tensor (a float
    tensor, or a GGUF file's quantized rows of every expert) cut into each expert's, a shared
    expert's gate stored as a vector given its one row; anything else as it is."""
    found = STACKED.match(name)
    if found is None:
        if name.endswith("shared_expert_gate.weight") and tensor.dim() == 1:
            tensor = tensor.reshape(1, -1)
        yield name, tensor
        return
    rows = tensor.shape[0] // num_experts  # a GGUF tensor comes with every expert's rows in one
    for expert in range(num_experts):
        part = tensor[expert] if isinstance(tensor, torch.Tensor) and tensor.dim() == 3 else None
        yield (
            f"{found[1]}.{expert}.{found[2]}.weight",
            part if part is not None else tensor.narrow_rows(expert * rows, rows),
        )


class Expert(OpModule):
    """down(act(gate) * up) of one expert; its down projection's partial sums are not reduced here."""

    def __init__(self, hidden: int, inter: int, act: str, tp: TPGroup, quant: QuantMethod | None) -> None:
        super().__init__()
        self.act = act
        self.gate_up_proj = ColumnLinear(hidden, [inter, inter], False, tp, quant)
        self.down_proj = RowLinear(inter, hidden, False, tp, quant, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act == "gelu_tanh":
            return self.down_proj(self.ops.gelu_tanh_and_mul(gate_up))
        return self.down_proj(self.ops.silu_and_mul(gate_up))


def _replicated(*shape: int) -> nn.Parameter:
    weight = nn.Parameter(torch.empty(*shape), requires_grad=False)
    attach_weight_loader(weight, default_weight_loader)
    return weight


class Router(nn.Module):
    """The router's linear, whole on every rank (its logits pick the experts everywhere alike), in
    float32 whatever the model's dtype: a bf16 rounding of near-equal scores would pick other experts
    than the checkpoint's own arithmetic, a larger change than any rounding downstream."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = _replicated(num_experts, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class MoEMLP(nn.Module):
    """The experts of one decoder layer, their router and the shared expert (see the module's doc)."""

    def __init__(self, cfg: Any, tp: TPGroup, moe: MoEParts, act: str, quant: QuantMethod | None) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.moe = moe
        self.tp = tp
        self.gate = Router(hidden, moe.num_experts)
        self.experts = nn.ModuleList(
            Expert(hidden, moe.intermediate, act, tp, quant) for _ in range(moe.num_experts)
        )
        shared = moe.shared_intermediate
        self.shared_expert = Expert(hidden, shared, act, tp, quant) if shared else None
        self.shared_expert_gate = Router(hidden, 1) if moe.shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.moe)
        out = torch.zeros_like(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        tokens, slots = order // self.moe.top_k, order % self.moe.top_k
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows, picked = tokens[start : start + count], slots[start : start + count]
                y = self.experts[expert](x[rows]) * weights[rows, picked, None]
                out.index_add_(0, rows, y.to(out.dtype))
                start += count
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)).to(shared.dtype) * shared
            out = out + shared
        return self.tp.all_reduce(out)
