"""The mixture-of-experts MLP: a router picks each token's experts, only those compute, their outputs
are combined by the router's weights (and a shared expert's added).

Runs in worker processes, in place of a decoder layer's dense MLP where the model's parts say
(`DecoderParts.moe`, parts.py). One module serves every MoE family; `MoEParts` names what differs:
how scores are made and the top-k picked (`route`: softmax then top-k, Mixtral / Qwen / OLMoE, with
or without renormalizing the k weights; top-k of the logits then softmax, Granite; sigmoid scores
with a correction bias for the choice, the top-k within the best groups of experts and a routed
scale, DeepSeek-V3 / GLM-4.5), and a shared expert with or without its sigmoid gate. Each expert is
a pair of the model's own linears, so every weight format (bf16 packing, fp8, int8, int4, GGUF bits)
applies to experts as to any layer. On the native CPU ops the whole layer is one call
(kernels/csrc/cpu_moe.cpp: routing, the selected experts' matmuls as work items over one thread
pool, the combine); elsewhere `experts_reference` runs it in torch: tokens grouped by expert (one
sort), each selected expert over its tokens only, the outputs times their weights summed in float32
in expert order, as the native op sums them; on CUDA, unquantized experts are stacked for the
Triton grouped kernel (kernels/moe_grouped.py). Each layer counts the tokens its experts took
(`expert_load`, read and reset by the worker). With tensor parallelism each expert's intermediate
dimension is split across ranks; the partial sums meet in one all-reduce per layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.layers import ColumnLinear, RowLinear, attach_weight_loader, default_weight_loader
from workers.models.native_linears import fp8_scale, segments
from workers.models.ops import NativeCpuOps, OpModule
from workers.parallel import TPGroup
from workers.quant.base import QuantMethod, Unquantized

SCORINGS = ("softmax", "topk_softmax", "sigmoid")  # cpu_moe.cpp's kSoftmax, kTopkSoftmax, kSigmoid
ACTS = ("silu", "gelu_tanh")  # its activations
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
    groups: int = 1  # sigmoid scoring: experts in this many groups, the top-k taken in the best
    topk_groups: int = 1  # ... this many of them (by the sum of each group's two best choices)
    routed_scale: float = 1.0  # the routed weights times this
    correction_bias: bool = False  # sigmoid scoring: a bias added to the scores for the choice only

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"expert scoring {self.scoring!r} is not one of {SCORINGS}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top-{self.top_k} of {self.num_experts} experts")
        if self.num_experts % self.groups or not 0 < self.topk_groups <= self.groups:
            raise ValueError(f"{self.num_experts} experts in {self.groups} groups, {self.topk_groups} kept")

    def workspace_bytes(self, hidden: int, tokens: int, itemsize: int) -> int:
        """The most a layer's experts allocate at once for `tokens` tokens (freed after the layer):
        every token routed to the same top-k experts, each expert's gathered inputs, gate/up,
        activation and down outputs, the shared expert's likewise, and the float32 combine."""
        experts = self.top_k + (self.shared_intermediate > 0)
        inter = max(self.intermediate, self.shared_intermediate)
        per_expert = tokens * (2 * hidden + 3 * inter) * itemsize
        return experts * per_expert + tokens * hidden * 4 + tokens * self.num_experts * 4

    def dims(self, act: str) -> list[int]:
        """The native op's dims (cpu_moe.cpp's Dims)."""
        shared = int(self.shared_intermediate > 0)
        return [
            self.num_experts, self.top_k, SCORINGS.index(self.scoring), int(self.renormalize),
            ACTS.index(act), self.groups, self.topk_groups, shared, int(self.shared_gate),
        ]  # fmt: skip


def route(
    logits: torch.Tensor, moe: MoEParts, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's expert weights (float32) and ids, [T, top_k] each, from router logits [T, E]
    (`bias`: the correction bias of sigmoid scoring)."""
    if moe.scoring == "topk_softmax":
        top, ids = torch.topk(logits, moe.top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids
    if moe.scoring == "sigmoid":
        scores = logits.float().sigmoid()
        choice = scores if bias is None else scores + bias
        if moe.groups > 1:
            grouped = choice.view(-1, moe.groups, moe.num_experts // moe.groups)
            best = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
            kept = torch.zeros_like(best, dtype=torch.bool)
            kept.scatter_(1, best.topk(moe.topk_groups, dim=-1)[1], True)
            choice = choice.masked_fill(~kept.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        ids = torch.topk(choice, moe.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if moe.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scale, ids
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), moe.top_k, dim=-1)
    if moe.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * moe.routed_scale, ids


def _rows(tensor: Any, start: int, length: int) -> Any:
    """Rows start .. start + length of a float tensor or of a GGUF file's quantized rows."""
    return (
        tensor[start : start + length]
        if isinstance(tensor, torch.Tensor)
        else tensor.narrow_rows(start, length)
    )


def split_experts(name: str, tensor: Any, num_experts: int) -> Iterator[tuple[str, Any]]:
    """A checkpoint tensor as the parameters it holds: a stacked [E, rows, cols] tensor (a float
    tensor, or a GGUF file's quantized rows of every expert) cut into each expert's (a stacked gate
    and up in one cut into the two), a shared
    expert's gate stored as a vector given its one row; anything else as it is."""
    found = STACKED.match(name)
    if found is None:
        if name.endswith("shared_expert_gate.weight") and tensor.dim() == 1:
            tensor = tensor.reshape(1, -1)
        yield name, tensor
        return
    rows = tensor.shape[0] // num_experts  # a GGUF tensor comes with every expert's rows in one (a float
    # one is [E, rows, cols])
    for expert in range(num_experts):
        part = tensor[expert] if isinstance(tensor, torch.Tensor) else tensor.narrow_rows(expert * rows, rows)
        if found[2] == "gate_up_proj":  # gate then up in one (Granite's): the two shards of gate_up
            half = part.shape[0] // 2
            for i, shard in enumerate(("gate_proj", "up_proj")):
                yield f"{found[1]}.{expert}.{shard}.weight", _rows(part, i * half, half)
        else:
            yield f"{found[1]}.{expert}.{found[2]}.weight", part


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
    than the checkpoint's own arithmetic, a larger change than any rounding downstream. With sigmoid
    scoring it may hold the correction bias of the choice (`e_score_correction_bias`)."""

    def __init__(self, hidden: int, num_experts: int, correction_bias: bool = False) -> None:
        super().__init__()
        self.weight = _replicated(num_experts, hidden)
        self.e_score_correction_bias = _replicated(num_experts) if correction_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


@dataclass(frozen=True)
class NativeMoE:
    """torch.ops.ember.moe_forward's arguments for one layer, gathered once its ops are installed."""

    params: list[torch.Tensor]  # router [E, H], correction bias [E], shared gate [1, H] (float32 or empty)
    weights: list[torch.Tensor]  # per expert (then the shared one): gate_up's segments, then down's
    scales: list[torch.Tensor]  # one per segment: its fp8 scale, or empty
    specs: list[int]
    dims: list[int]


def native_moe(mlp: MoEMLP) -> NativeMoE | None:
    """The native op's arguments for `mlp`, or None where one of its experts' linears is not on the
    native matmuls (or the weights are not on the CPU)."""
    experts = [*mlp.experts, *([mlp.shared_expert] if mlp.shared_expert is not None else [])]
    weights, scales, specs = [], [], []
    for expert in experts:
        for lin in (expert.gate_up_proj, expert.down_proj):
            segs = segments(lin)
            if segs is None or lin.bias is not None:
                return None
            specs.append(len(segs))
            for tensor, spec in segs:
                weights.append(tensor)
                scales.append(fp8_scale(lin))
                specs.extend(spec)
    if mlp.gate.weight.device.type != "cpu":
        return None
    empty = torch.empty(0)
    bias = mlp.gate.e_score_correction_bias
    gate = mlp.shared_expert_gate
    params = [
        mlp.gate.weight.float().contiguous(),
        empty if bias is None else bias.float().contiguous(),
        empty if gate is None else gate.weight.float().contiguous(),
    ]
    return NativeMoE(params, weights, scales, specs, mlp.moe.dims(mlp.act))


def experts_reference(
    mlp: MoEMLP, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of the experts and the combine: ([T, H] in x's dtype, tokens per expert).
    Per token its experts' outputs times their weights are summed in float32 in expert order, then
    the shared expert's (times its sigmoid gate), then rounded once."""
    moe = mlp.moe
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=moe.num_experts)
    tokens, slots = order // moe.top_k, order % moe.top_k
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            rows, picked = tokens[start : start + count], slots[start : start + count]
            out.index_add_(0, rows, mlp.experts[expert](x[rows]).float() * weights[rows, picked, None])
            start += count
    return (out + mlp._shared(x)).to(x.dtype), counts


class MoEMLP(OpModule):
    """The experts of one decoder layer, their router and the shared expert (see the module's doc)."""

    def __init__(self, cfg: Any, tp: TPGroup, moe: MoEParts, act: str, quant: QuantMethod | None) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.moe = moe
        self.act = act
        self.tp = tp
        self.gate = Router(hidden, moe.num_experts, moe.correction_bias)
        self.experts = nn.ModuleList(
            Expert(hidden, moe.intermediate, act, tp, quant) for _ in range(moe.num_experts)
        )
        shared = moe.shared_intermediate
        self.shared_expert = Expert(hidden, shared, act, tp, quant) if shared else None
        self.shared_expert_gate = Router(hidden, 1) if moe.shared_gate else None
        # tokens each expert took since the worker last read it: state, not a weight (no buffer: the
        # weight cache does not hold it), on the CPU until ExpertCounts gives it the device's row
        self.expert_load = torch.zeros(moe.num_experts, dtype=torch.int64, device="cpu")
        self.native: NativeMoE | None = None
        self.stacked: dict[str, torch.Tensor] = {}  # the experts' weights for the grouped kernel (CUDA)

    def _shared(self, x: torch.Tensor) -> torch.Tensor | float:
        """The shared expert's output in float32 (times its sigmoid gate), or 0.0 without one."""
        if self.shared_expert is None:
            return 0.0
        shared = self.shared_expert(x).float()
        if self.shared_expert_gate is not None:
            shared = shared * torch.sigmoid(self.shared_expert_gate(x))
        return shared

    def ops_installed(self) -> None:
        """Gather the native op's arguments where the native CPU ops run, or stack the experts for the
        Triton grouped kernel on CUDA (after loading)."""
        self.native = native_moe(self) if isinstance(self.ops, NativeCpuOps) else None
        if self.gate.weight.is_cuda:
            self.stack_experts()

    def stack_experts(self) -> bool:
        """Unquantized experts' weights as two stacked tensors [E, 2I, H] and [E, H, I] (each expert's
        linears then views into them: no second copy), run by kernels/moe_grouped.py; False for
        quantized experts, which keep their own linears."""
        experts = cast(list[Expert], list(self.experts))
        linears = [lin for e in experts for lin in (e.gate_up_proj, e.down_proj)]
        if not all(type(lin.quant) is Unquantized for lin in linears):
            return False
        for name in ("gate_up_proj", "down_proj"):
            stacked = torch.stack([getattr(e, name).weight.data for e in experts])
            for i, expert in enumerate(experts):
                getattr(expert, name).weight.data = stacked[i]
            self.stacked[name] = stacked
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        load = self.expert_load
        if self.native is not None:
            n = self.native
            out = torch.ops.ember.moe_forward(
                x.contiguous(), n.params, n.weights, n.scales, n.specs, n.dims, self.moe.routed_scale, load
            )  # the counts added in place
            return self.tp.all_reduce(out)
        weights, ids = route(self.gate(x), self.moe, self.gate.e_score_correction_bias)
        if self.stacked:
            from kernels.moe_grouped import grouped_experts_triton  # noqa: PLC0415  (triton: CUDA only)

            w13, w2 = self.stacked["gate_up_proj"], self.stacked["down_proj"]
            routed = grouped_experts_triton(x.contiguous(), w13, w2, weights, ids)
            out = (routed + self._shared(x)).to(x.dtype)
            load += torch.bincount(ids.flatten(), minlength=self.moe.num_experts)
        else:
            out, counts = experts_reference(self, x, weights, ids)
            load += counts
        return self.tp.all_reduce(out)


class ExpertCounts:
    """The tokens each expert of a model's (this stage's) MoE layers took, in one [layers, E] tensor
    that the layers' `expert_load` views add into; `take` reads and resets it once per step."""

    def __init__(self, indices: list[int], layers: list[MoEMLP]) -> None:
        self.indices = indices
        self.counts = torch.zeros(len(layers), layers[0].moe.num_experts, dtype=torch.int64)
        self.counts = self.counts.to(layers[0].gate.weight.device)
        for row, mlp in zip(self.counts, layers, strict=True):
            mlp.expert_load = row

    @classmethod
    def of(cls, model: Any) -> ExpertCounts | None:
        """The counter of `model`'s held MoE layers (a LlamaForCausalLM), or None without experts."""
        held = [(i, layer.mlp) for i, layer in zip(model.held, model.held_layers(), strict=True)]
        moe = [(i, mlp) for i, mlp in held if isinstance(mlp, MoEMLP)]
        return cls([i for i, _ in moe], [mlp for _, mlp in moe]) if moe else None

    def take(self) -> dict[int, list[int]]:
        """Tokens per expert by layer index since the last call."""
        rows = self.counts.tolist()
        self.counts.zero_()
        return dict(zip(self.indices, rows, strict=True))


def routed_expert_bytes(model: nn.Module) -> int:
    """The bytes of a model's routed experts (not the shared experts or routers): the part of its
    weights a decode step reads only for the experts its tokens choose."""
    experts = (m.experts for m in model.modules() if isinstance(m, MoEMLP))
    return sum(p.numel() * p.element_size() for e in experts for p in e.parameters())
