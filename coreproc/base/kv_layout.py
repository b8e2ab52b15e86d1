"""How a model's layers share the paged KV cache: groups of layers, each with its own block tables.

Shared by the scheduler (coreproc.core.kv_cache keeps one block list per group and request) and the
workers (workers.worker allocates the tensors, kernels.metadata builds a table per group). Layers of
one attention kind (full, or one sliding window) form groups of equal size; a block id belongs to
one group at a time, and group member j of every group keeps its keys and values in the same
tensor, so one block id is one page of that many layers whichever group holds it. A sliding-window
group frees the blocks that fall out of every query's window while its request runs, which is what
keeps a long request on such layers at about window / block_size blocks. A model of one kind (every
Llama) is one group of all its layers: one table, one tensor per layer, as before groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class KVGroup(msgspec.Struct, frozen=True):
    """Layers with one block table: their sliding window (None: full attention) and their indices."""

    window: int | None
    layers: tuple[int, ...]


class KVLayout(msgspec.Struct, frozen=True):
    """The model's KV groups (see the module's doc); `slots`: tensors each block id spans."""

    groups: tuple[KVGroup, ...]

    @classmethod
    def full(cls, num_layers: int) -> KVLayout:
        """One full-attention group of every layer (a model without sliding windows)."""
        return cls((KVGroup(None, tuple(range(num_layers))),))

    @property
    def slots(self) -> int:
        return max(len(g.layers) for g in self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def slides(self) -> bool:
        """Whether some group frees blocks behind its window."""
        return any(w is not None for w in self.windows)

    def layer_groups(self) -> tuple[int, ...]:
        """Each layer's group, by layer index."""
        pairs = sorted((layer, g) for g, group in enumerate(self.groups) for layer in group.layers)
        return tuple(g for _, g in pairs)

    def layer_slots(self) -> tuple[int, ...]:
        """Each layer's tensor (its place within its group), by layer index."""
        pairs = sorted((layer, j) for group in self.groups for j, layer in enumerate(group.layers))
        return tuple(j for _, j in pairs)

    def seq_blocks(self, max_model_len: int, block_size: int, chunk: int) -> int:
        """Most blocks one sequence holds at once, over all groups, computed in chunks of at most
        `chunk` tokens: a full group every block of max_model_len tokens, a sliding group those the
        chunk and the window before it reach."""
        full = -(-max_model_len // block_size)
        span = [full if w is None else -(-(w + chunk - 2) // block_size) + 1 for w in self.windows]
        return sum(min(full, n) for n in span)

    def full_group(self) -> int | None:
        """The first full-attention group (what a draft model's tables follow), or None."""
        return next((g for g, group in enumerate(self.groups) if group.window is None), None)


def plan_layout(windows: Sequence[int | None], max_model_len: int) -> KVLayout:
    """The groups of a model whose layer i has sliding window `windows[i]` (None: full). A window
    that covers the whole context is full attention. Each kind's layers, in order, are cut into
    groups of the size of the smallest kind (vLLM's choice: few groups, pages that fit them)."""
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        kinds.setdefault(None if w is None or w >= max_model_len else int(w), []).append(i)
    if len(kinds) == 1:
        ((window, layers),) = kinds.items()
        return KVLayout((KVGroup(window, tuple(layers)),))
    size = min(len(layers) for layers in kinds.values())
    groups = [
        KVGroup(window, tuple(layers[i : i + size]))
        for window, layers in kinds.items()
        for i in range(0, len(layers), size)
    ]
    return KVLayout(tuple(groups))
