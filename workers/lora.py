"""LoRA adapters in a worker: device slots of stacked adapter weights and the per-token slot index.

Runs in each worker process. With `--enable-lora`, every decoder layer's q/k/v, o, gate/up and down
projections get a `LoRALayer`: per slot, the adapter's A matrices stacked by segment ([S, segments x
max_rank, in]) and B block-diagonal ([S, out, segments x max_rank]), sharded as the base weight is
(column layers: B's rows; row layers: A's columns, the delta added before the all-reduce). Each step,
`LoRAManager.prepare` maps the step's adapters to slots (loading a folder's tensors, checked against
the digest the core registered, into a free or least recently used slot no request of the step uses)
and sets the token -> slot index the layers read; a step without adapters costs nothing. Adapters read
from disk are kept on the host, least recently used out, within `--max-cpu-loras`.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load

from coreproc.base.lora import ALL, TARGETS, TENSOR_NAME, WEIGHTS_FILE, LoRAConfig, LoRAError
from coreproc.base.protocol import LoRARef
from kernels.lora import lora_add_runs_, select_lora_op
from workers.models.layers import ColumnLinear, RowLinear
from workers.models.llama import LlamaForCausalLM
from workers.parallel import TPGroup

LoRAOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class LoRAStep:
    """What this step's layers read: the slot of each token (None: no token has an adapter), as a
    tensor (the CUDA op) and as runs of consecutive tokens (start, end, slot) (the CPU path), with
    each slot's scale."""

    slots: torch.Tensor | None = None
    runs: list[tuple[int, int, int]] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)


class LoRALayer:
    """One projection's adapter slots; `__call__(x, y)` adds the step's deltas to its output `y`:
    on CPU in place, per run of one adapter's tokens; elsewhere through the batched op."""

    def __init__(
        self, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, step: LoRAStep, op: LoRAOp | None
    ) -> None:
        self.a, self.b, self.scales, self.step, self.op = a, b, scales, step, op

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        step = self.step
        if step.slots is None:
            return y
        if self.op is None:
            return lora_add_runs_(y, x, self.a, self.b, step.scales, step.runs)
        return y + self.op(x, self.a, self.b, self.scales, step.slots)


class LoRAManager:
    """The adapter slots of one model on one device."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        config: LoRAConfig,
        tp: TPGroup,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.config, self.tp, self.device = config, tp, device
        self.rank = config.max_lora_rank
        self.step = LoRAStep()
        self.layers: dict[tuple[int, str], tuple[LoRALayer, ColumnLinear | RowLinear]] = {}
        self.scales = torch.zeros(config.max_loras, dtype=torch.float32, device=device)
        op = None if device.type == "cpu" else select_lora_op(device)  # CPU: lora_add_runs_
        cfg = model.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        in_features = {
            "self_attn.qkv_proj": cfg.hidden_size,
            "self_attn.o_proj": heads * head_dim,
            "mlp.gate_up_proj": cfg.hidden_size,
            "mlp.down_proj": cfg.intermediate_size,
        }
        for i, layer in enumerate(model.model.layers):
            for target, full_in in in_features.items():
                if target.startswith("mlp.") and not hasattr(layer.mlp, "gate_up_proj"):
                    continue  # a mixture of experts: adapters reach its attention only
                lin = layer.get_submodule(target)
                assert isinstance(lin, (ColumnLinear, RowLinear)), f"{target} is not a linear layer"
                if isinstance(lin, ColumnLinear):
                    width, rows, cols = self.rank * len(lin.local_sizes), sum(lin.local_sizes), full_in
                else:
                    width, rows, cols = self.rank, cfg.hidden_size, lin.local_in
                a = torch.zeros(config.max_loras, width, cols, dtype=dtype, device=device)
                b = torch.zeros(config.max_loras, rows, width, dtype=dtype, device=device)
                lora = LoRALayer(a, b, self.scales, self.step, op)
                lin.lora = lora
                self.layers[(i, target)] = (lora, lin)
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # adapter identity -> slot, least recent first
        self.host: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()  # identity -> tensors

    def prepare(
        self, refs: Sequence[LoRARef | None], q_lens: Sequence[int], req_ids: Sequence[str]
    ) -> dict[str, str]:
        """Put this step's adapters in slots and set the token -> slot index; returns the requests
        whose adapter could not be loaded (why), which run without it and are failed by the caller."""
        if not any(refs):
            self.step.slots = None
            return {}
        wanted = {r.identity for r in refs if r is not None}
        failed: dict[str, str] = {}
        per_request = []
        for rid, ref in zip(req_ids, refs):
            slot = -1
            if ref is not None:
                try:
                    slot = self._slot(ref, wanted)
                except LoRAError as e:
                    failed[rid] = str(e)
            per_request.append(slot)
        index = torch.tensor(per_request, dtype=torch.long).repeat_interleave(torch.tensor(list(q_lens)))
        self.step.slots = index.to(self.device)
        self.step.runs = []
        start = 0
        for slot, n in zip(per_request, q_lens):  # the runner keeps each adapter's requests together
            if slot >= 0 and self.step.runs and self.step.runs[-1][1:] == (start, slot):
                self.step.runs[-1] = (self.step.runs[-1][0], start + n, slot)
            elif slot >= 0:
                self.step.runs.append((start, start + n, slot))
            start += n
        self.step.scales = self.scales.tolist()
        return failed

    def _slot(self, ref: LoRARef, in_use: set[str]) -> int:
        if ref.identity in self.slot_of:
            self.slot_of.move_to_end(ref.identity)
            return self.slot_of[ref.identity]
        taken = set(self.slot_of.values())
        free = [s for s in range(self.config.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next((k for k in self.slot_of if k not in in_use), None)
            assert victim is not None, "the scheduler mixes at most --max-loras adapters in a step"
            slot = self.slot_of.pop(victim)
        self._fill(slot, ref)
        self.slot_of[ref.identity] = slot
        return slot

    def _tensors(self, ref: LoRARef) -> dict[str, torch.Tensor]:
        if ref.identity in self.host:
            self.host.move_to_end(ref.identity)
            return self.host[ref.identity]
        try:
            data = (Path(ref.path) / WEIGHTS_FILE).read_bytes()
        except OSError as e:
            raise LoRAError(f"LoRA adapter {ref.name!r}: cannot read its weights: {e}") from None
        if hashlib.sha256(data).hexdigest() != ref.identity:
            raise LoRAError(f"LoRA adapter {ref.name!r}: its weights changed on disk since it was loaded")
        tensors = load(data)
        self.host[ref.identity] = tensors
        while len(self.host) > self.config.cpu_slots:
            self.host.popitem(last=False)
        return tensors

    def _fill(self, slot: int, ref: LoRARef) -> None:
        """Write an adapter's A and B into `slot` of every layer (this rank's shard)."""
        tensors = self._tensors(ref)
        adapter_cfg = json.loads((Path(ref.path) / "adapter_config.json").read_text())
        r = int(adapter_cfg["r"])
        alpha = float(adapter_cfg.get("lora_alpha") or r)
        self.scales[slot] = alpha / (r**0.5 if adapter_cfg.get("use_rslora") else r)
        for lora, _ in self.layers.values():
            lora.a[slot].zero_()
            lora.b[slot].zero_()
        tp = self.tp
        for name, tensor in tensors.items():
            match = TENSOR_NAME.match(name)
            assert match is not None, f"the core checked every tensor name ({name})"
            layer, module, kind = int(match.group(1)), match.group(2), match.group(3)
            target, segment = TARGETS[module]
            if (layer, target) not in self.layers:
                raise LoRAError(
                    f"LoRA adapter {ref.name!r}: layer {layer}'s MLP is a mixture of experts, whose "
                    "weights adapters cannot reach in this version"
                )
            lora, lin = self.layers[(layer, target)]
            value = tensor.to(lora.a.dtype)
            if isinstance(lin, ColumnLinear):
                # a fused projection's adapter: its A in every segment, its B's rows cut by segment
                segments = range(len(lin.local_sizes)) if segment == ALL else [segment]
                start = 0  # the segment's first row in the adapter's B (all ranks' rows)
                for seg in segments:
                    cols = slice(seg * self.rank, seg * self.rank + r)
                    size = lin.local_sizes[seg]
                    if kind == "A":  # [r, in]: whole on every rank
                        lora.a[slot, cols] = value
                    else:  # [out, r]: this rank's rows, at the segment's offset
                        offset = sum(lin.local_sizes[:seg])
                        rows = value.narrow(0, start + tp.rank * size, size)
                        lora.b[slot, offset : offset + size, cols] = rows
                    start += size * tp.size
            elif kind == "A":  # row layer, [r, in]: this rank's columns
                lora.a[slot, :r] = value.narrow(1, tp.rank * lin.local_in, lin.local_in)
            else:
                lora.b[slot, :, :r] = value
