"""Parallel group handles passed explicitly to the layers and the runner (no global state).

Runs in worker processes. `TPGroup`: this rank's tensor-parallel group, given to every sharded layer;
with size 1 every collective is a no-op, so the single-device engine and the reference tests never
touch torch.distributed; with size > 1 it wraps a torch.distributed group (gloo on CPU, NCCL on CUDA).
`PPGroup`: this rank's pipeline stage (which layers it holds) and the point-to-point link that takes
a step's hidden states [T, hidden] from the same tensor-parallel rank of the previous stage and hands
them to the next. `local_placement` and `device_index`: where a rank sits on its node, and its GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from coreproc.base.config import EngineConfig
from coreproc.base.errors import ConfigError


@dataclass(frozen=True)
class TPGroup:
    """This worker's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's shard of the last dimension (rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def shard(self, total: int, what: str) -> int:
        """Size of this rank's shard of `total`; refuse uneven splits with a clear message."""
        if total % self.size:
            raise ConfigError(f"{what} ({total}) is not divisible by tensor_parallel_size {self.size}")
        return total // self.size


@dataclass(frozen=True)
class PPGroup:
    """This worker's pipeline stage: the decoder layers [start, end) it holds, and its neighbours'
    global ranks (the same tensor-parallel rank one stage before and after)."""

    stage: int = 0
    size: int = 1
    start: int = 0
    end: int = -1  # one past the last layer held; -1: every layer (a single stage)
    prev_rank: int = -1
    next_rank: int = -1
    _sends: list[Any] = field(default_factory=list, compare=False, repr=False)  # unfinished isends

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def layers(self, num_layers: int) -> range:
        """The indices of the decoder layers this stage holds."""
        return range(self.start, num_layers if self.end < 0 else self.end)

    def send(self, hidden: torch.Tensor) -> None:
        """Hand a step's hidden states to the next stage without waiting for it to take them, so this
        stage can start its next micro-batch; a send still in flight keeps its tensor alive."""
        assert not self.is_last, "the last stage sends nothing"
        self._sends[:] = [w for w in self._sends if not w[0].is_completed()]
        tensor = hidden.contiguous()
        self._sends.append((dist.isend(tensor, self.next_rank), tensor))

    def recv(
        self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The previous stage's hidden states [num_tokens, hidden_size] for this step (steps arrive in
        the order both stages run them)."""
        assert not self.is_first, "the first stage receives nothing"
        out = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(out, self.prev_rank)
        return out


def local_placement(config: EngineConfig, rank: int) -> int:
    """A worker's place among the workers on its node: DP rank d, global rank g (stage * tp_size + TP
    rank) -> d * ranks_per_node + g's index on its node (several nodes: g minus the node's first rank)."""
    par = config.parallel
    return par.data_parallel_rank * par.ranks_per_node + rank % par.ranks_per_node


def device_index(config: EngineConfig, rank: int) -> int:
    """The GPU of a worker: its place on its node (`local_placement`), modulo the GPUs present."""
    return local_placement(config, rank) % max(1, torch.cuda.device_count())
