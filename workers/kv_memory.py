"""Where a worker's KV cache goes: the model's KV groups, how many blocks, which tensors a stage holds.

Runs in worker processes (workers/worker.py calls these at start-up). The layout groups the layers by
their sliding windows (coreproc/base/kv_layout.py); the block count comes from a fixed number, a
byte budget or a fraction of the device's free memory, never fewer than one sequence needs at once.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from coreproc.base.config import ConfigError, EngineConfig
from coreproc.base.kv_layout import KVLayout, plan_layout
from workers.models.llama import LlamaForCausalLM

CPU_DEFAULT_KV_FRACTION = 0.3
CUDA_DEFAULT_KV_FRACTION = 0.9


def available_memory(device: torch.device) -> int:
    """Bytes this device can still give: free GPU memory, or the host's MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def kv_layout(model: LlamaForCausalLM, config: EngineConfig, with_draft: bool) -> KVLayout:
    """The model's KV groups (coreproc/base/kv_layout.py) by its layers' sliding windows. One full
    group, whose blocks stay for the whole request, when `--no-release-window-blocks` asks, or with a
    draft model (which reads every position on the tables of a full group) and no full layer."""
    layers = model.parts.layers
    layout = plan_layout([kind.window for kind in layers], config.model.max_model_len)
    if not config.cache.release_window_blocks or (with_draft and layout.full_group() is None):
        return KVLayout.full(len(layers))
    return layout


def held_slots(model: LlamaForCausalLM, layout: KVLayout) -> list[int]:
    """The KV tensors the layers this stage holds use."""
    slots = layout.layer_slots()
    return sorted({slots[i] for i in model.held})


def plan_kv_blocks(
    config: EngineConfig, bytes_per_block: int, device: torch.device, layout: KVLayout, workspace: int = 0
) -> int:
    """Number of KV blocks: fixed, from a byte budget, or from a fraction of free memory less the
    step's `workspace` (a mixture of experts' worst case); never fewer than one sequence of
    max_model_len holds at once (with the null block of sliding groups). A fixed count or budget
    that leaves no room for the workspace is refused at start-up, not met by running out later."""
    cache = config.cache
    chunk = min(config.model.max_model_len, config.scheduler.max_num_batched_tokens)
    per_seq = layout.seq_blocks(config.model.max_model_len, cache.block_size, chunk)
    per_seq += 1 if layout.slides else 0
    useful = config.scheduler.max_num_seqs * per_seq
    if cache.num_kv_blocks is not None:
        blocks = cache.num_kv_blocks
    elif cache.kv_cache_memory is not None:
        blocks = cache.kv_cache_memory // bytes_per_block
    else:
        default = CUDA_DEFAULT_KV_FRACTION if device.type == "cuda" else CPU_DEFAULT_KV_FRACTION
        fraction = cache.kv_cache_memory_fraction or default
        if device.type == "cpu":  # the host's memory is shared by all its workers (ranks, DP engines)
            fraction /= config.parallel.workers_per_host
        # never reserve more than every sequence at full length could use
        free = max(0, available_memory(device) - workspace)
        blocks = min(int(free * fraction) // bytes_per_block, useful)
    if workspace and blocks * bytes_per_block + workspace > available_memory(device):
        raise ConfigError(
            f"the KV cache ({blocks * bytes_per_block / 2**30:.2f} GiB) and the experts' workspace of a "
            f"full batch ({workspace / 2**30:.2f} GiB) do not fit the {available_memory(device) / 2**30:.2f} "
            "GiB free; lower --num-kv-blocks / --kv-cache-memory or --max-num-batched-tokens"
        )
    if blocks < per_seq:
        raise ConfigError(
            f"the KV cache holds {blocks} blocks, fewer than the {per_seq} one sequence of "
            f"max_model_len {config.model.max_model_len} needs; give it more memory or lower max_model_len"
        )
    return blocks
