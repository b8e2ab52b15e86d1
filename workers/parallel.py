"""Tensor-parallel group handle passed explicitly to every sharded layer (no global state).

Runs in worker processes. With size 1 every collective is a no-op, so the single-device engine and
the reference tests never touch torch.distributed; with size > 1 the group wraps an initialised
torch.distributed process group (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from coreproc.errors import ConfigError


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
