"""Per-step attention metadata shared by every attention backend.

The model runner builds one `AttentionMetadata` per forward step (on the host, then copies the
tensors to the device) and hands it to every attention layer. The batch is flattened: the first
`num_decodes` requests are decodes (one query token each), the rest are prefill chunks. Tensors
live on the compute device; the `*_cpu` lists are host copies so torch paths can loop without syncs.
A model whose layers keep their KV in several groups (coreproc/base/kv_layout.py) gets one view per
group, alike but for the block tables and slot mapping; `for_layer(i)` is layer i's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Batch layout of one forward step (see module docstring for the conventions)."""

    num_decodes: int
    num_decode_tokens: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B], cached + new tokens per request
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], padded with 0
    slot_mapping: torch.Tensor  # int64 [T], cache slot of each new token (-1 = padding)
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    views: tuple[AttentionMetadata, ...] = ()  # one per KV group when there are several
    layer_group: tuple[int, ...] = ()  # each layer's KV group (empty: one group)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    def for_layer(self, layer: int) -> AttentionMetadata:
        """Layer `layer`'s view: its KV group's block tables and slots."""
        return self.views[self.layer_group[layer]] if self.layer_group else self

    @classmethod
    def build_grouped(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        tables: Sequence[list[list[int]]],
        layer_group: tuple[int, ...],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """`build` for a model of several KV groups: `tables[g][b]` is request b's block table in
        group g, `layer_group[i]` layer i's group."""
        first = cls.build(query_lens, seq_lens, tables[0], block_size, device)
        if len(tables) == 1:
            return first
        views = [first]
        for group in tables[1:]:
            padded, slots = _tables(query_lens, seq_lens, group, block_size)
            views.append(dataclasses.replace(first, **_tensors(padded, slots, device)))
        for view in views:
            view.views, view.layer_group = tuple(views), layer_group
        return first

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Build metadata from per-request query lengths, total lengths and block ids.

        Decodes (query length 1) must come first. `block_tables[b]` must cover `seq_lens[b]` tokens.
        The slot mapping covers the new tokens only, i.e. positions seq_len - q_len .. seq_len - 1.
        """
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per request")
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        # The leading run of q_len == 1 requests is the decode part; a later q_len == 1 request is
        # simply a one-token prefill chunk (the prefill op handles it identically).
        query_start_loc = [0]
        for q_len, s_len in zip(query_lens, seq_lens, strict=True):
            if q_len < 1 or s_len < q_len:
                raise ValueError(f"invalid request: query_len={q_len} seq_len={s_len}")
            query_start_loc.append(query_start_loc[-1] + q_len)
        padded, slots = _tables(query_lens, seq_lens, block_tables, block_size)
        return cls(
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            num_actual_tokens=query_start_loc[-1],
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            **_tensors(padded, slots, device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=list(seq_lens),
        )


def _tables(
    query_lens: list[int], seq_lens: list[int], block_tables: Sequence[list[int]], block_size: int
) -> tuple[list[list[int]], list[int]]:
    """The block tables padded to one width, and the cache slot of each new token."""
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        if len(table) * block_size < s_len:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {s_len} tokens")
        for pos in range(s_len - q_len, s_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max((len(t) for t in block_tables), default=0)
    return [list(t) + [0] * (width - len(t)) for t in block_tables], slots


def _tensors(
    padded: list[list[int]], slots: list[int], device: torch.device | str
) -> dict[str, torch.Tensor]:
    width = len(padded[0]) if padded else 0
    return {
        "block_tables": torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), width),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64, device=device),
    }
