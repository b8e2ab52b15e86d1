"""A pipeline stage's forward: the previous stage's hidden states in, this stage's layers, the result on.

Runs in worker processes with `--pipeline-parallel-size` > 1, in place of the model's own forward (the
worker picks it once, when it picks kernels). Every stage runs the same steps in the same order, so the
hidden states [T, hidden] of a step travel over `PPGroup`'s point-to-point link without a step id; a
stage hands its output on without waiting, so it can start the next micro-batch while the next stage
works on this one.
"""

from __future__ import annotations

import torch

from kernels import AttentionMetadata
from workers.models.fused_decode import plan
from workers.models.llama import LlamaForCausalLM
from workers.parallel import PPGroup


class StageForward:
    """forward(input_ids[T], positions[T], kv_caches, meta) -> hidden[T, hidden] of one stage: the last
    stage's after the final norm (for the LM head), the others' as handed to the next stage. The
    stage's layers run as the model's modules or, where they qualify, as one-call decode layers."""

    def __init__(self, model: LlamaForCausalLM, pp: PPGroup, dtype: torch.dtype) -> None:
        self.model = model
        self.body = plan(model) or model  # both take `inputs_embeds`
        self.pp = pp
        self.dtype = dtype  # of the hidden states between stages: the engine's compute dtype
        self.hidden_size = int(model.config.hidden_size)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        received = None
        if not self.pp.is_first:
            received = self.pp.recv(input_ids.shape[0], self.hidden_size, self.dtype, input_ids.device)
        hidden = self.body(input_ids, positions, kv_caches, meta, inputs_embeds=received)
        if not self.pp.is_last:
            self.pp.send(hidden.to(self.dtype))
        return hidden
