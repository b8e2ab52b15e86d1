"""The draft model of speculative decoding, inside a worker: its own KV cache, the target's blocks.

Runs in the worker process next to the target model. The draft's KV tensors have the same number of
blocks as the target's and are indexed by the same block tables, so prefix-cache hits, preemption
and freeing need no extra bookkeeping. `mirror` runs the draft over exactly the tokens the target
computes in a step (prompt chunks, decodes, proposals under verification), which keeps the draft's KV
equal to what it would hold had it seen every token. After sampling, `propose` feeds each request's
newest token and continues greedily for up to k tokens, writing draft KV into the lookahead slots the
scheduler reserved (never past the request's blocks or the context). Greedy proposals are a
deterministic function of the context, so the target's keep-while-equal verification stays exact.
"""

from __future__ import annotations

import torch

from kernels import AttentionMetadata
from workers.models.fused_decode import Forward
from workers.models.llama import LlamaForCausalLM


class DraftProposer:
    """A draft model with its KV cache; proposes tokens for the requests that just sampled."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        num_tokens: int,
        max_model_len: int,
        forward: Forward | None = None,
    ) -> None:
        self.model = model
        self.forward: Forward = model if forward is None else forward  # as ModelRunner.forward
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.k = num_tokens
        self.max_model_len = max_model_len

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Compute the draft's KV for the tokens the target computes in this step."""
        self.forward(input_ids, positions, self.kv_caches, meta)

    def propose(
        self, last_tokens: list[int], positions: list[int], block_tables: list[list[int]]
    ) -> list[list[int]]:
        """Up to k greedy tokens after each request's `last_tokens[i]` (at `positions[i]`)."""
        limits = [
            min(self.k, len(blocks) * self.block_size - pos, self.max_model_len - pos)
            for pos, blocks in zip(positions, block_tables)
        ]
        out: list[list[int]] = [[] for _ in last_tokens]
        active = [i for i, n in enumerate(limits) if n > 0]
        tokens, pos = list(last_tokens), list(positions)
        for step in range(self.k):
            active = [i for i in active if limits[i] > step]
            if not active:
                break
            meta = AttentionMetadata.build(
                [1] * len(active),
                [pos[i] + 1 for i in active],
                [block_tables[i] for i in active],
                self.block_size,
                self.device,
            )
            hidden = self.forward(
                torch.tensor([tokens[i] for i in active], dtype=torch.long, device=self.device),
                torch.tensor([pos[i] for i in active], dtype=torch.long, device=self.device),
                self.kv_caches,
                meta,
            )
            picks = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for i, token in zip(active, picks):
                out[i].append(token)
                tokens[i] = token
                pos[i] += 1
        return out
