"""One worker: a device, the model loaded onto it, its KV cache and its model runner.

Runs in a worker process (or inside the offline engine's process). Start-up order: pick the device and
attention backend -> build and load the model -> size the KV cache from the memory budget -> allocate
it -> report `WorkerReady` (block count, bytes, load time). Then `execute_model` serves each step.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from coreproc.config import ConfigError, EngineConfig
from coreproc.logits_processors import ProcessorContext, engine_specs, load_processors
from coreproc.protocol import RunnerOutput, SchedulerOutput, WorkerReady
from kernels import select_backend
from kernels.cpu_gemm import select_linear_kernel
from kernels.native import use_native
from workers.draft import DraftProposer
from workers.loader import build_model, use_native_ops
from workers.model_runner import ModelRunner
from workers.models.layers import kv_bytes_per_token
from workers.parallel import TPGroup

log = logging.getLogger("ember.worker")

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


def plan_kv_blocks(config: EngineConfig, bytes_per_block: int, device: torch.device) -> int:
    """Number of KV blocks: fixed, from a byte budget, or from a fraction of free memory."""
    cache = config.cache
    useful = config.scheduler.max_num_seqs * config.max_blocks_per_seq
    if cache.num_kv_blocks is not None:
        blocks = cache.num_kv_blocks
    elif cache.kv_cache_memory is not None:
        blocks = cache.kv_cache_memory // bytes_per_block
    else:
        default = CUDA_DEFAULT_KV_FRACTION if device.type == "cuda" else CPU_DEFAULT_KV_FRACTION
        fraction = cache.kv_cache_memory_fraction or default
        # never reserve more than every sequence at full length could use
        blocks = min(int(available_memory(device) * fraction) // bytes_per_block, useful)
    if blocks < config.max_blocks_per_seq:
        raise ConfigError(
            f"the KV cache holds {blocks} blocks ({blocks * cache.block_size} tokens), fewer than one "
            f"sequence of max_model_len {config.model.max_model_len} needs; "
            "give it more memory or lower max_model_len"
        )
    return blocks


class Worker:
    """Builds everything a device needs, then executes scheduler steps."""

    def __init__(self, config: EngineConfig, tp: TPGroup | None = None) -> None:
        self.config = config
        self.tp = tp or TPGroup()
        self.device = torch.device(config.device.resolved)
        if self.device.type == "cuda" and self.device.index is None:
            from workers.weight_cache.fingerprint import device_index

            self.device = torch.device("cuda", device_index(config, self.tp.rank))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = getattr(torch, config.model.dtype)
        self.backend = select_backend(self.device, config.device.attention_backend)
        self.native = use_native(self.device)
        self.linear_kernel = select_linear_kernel(self.device, self.dtype)
        self.runner: ModelRunner | None = None

    def _from_cache(self) -> tuple[nn.Module | None, float, str]:
        """The model mapped from a preload daemon, or (None, 0, why not)."""
        from workers.weight_cache.client import CacheUnavailable, load_from_cache

        start = time.perf_counter()
        try:
            model = load_from_cache(self.config, self.device, self.tp, self.backend)
        except CacheUnavailable as e:
            log.warning("rank %d: ipc_cache: %s; loading from disk", self.tp.rank, e)
            return None, 0.0, str(e)
        return model, time.perf_counter() - start, ""

    def load(self, show_progress: bool = True) -> WorkerReady:
        cfg = self.config
        model, seconds, quant_seconds, fallback = None, 0.0, 0.0, ""
        if cfg.load.load_format == "ipc_cache":
            model, seconds, fallback = self._from_cache()
        source = "ipc_cache" if model is not None else "disk"
        if model is None:
            model, seconds, quant_seconds = build_model(
                cfg.model.model,
                cfg.model.architecture,
                self.dtype,
                self.device,
                self.tp,
                self.backend,
                cfg.model.max_model_len,
                cfg.model.quantization,
                show_progress,
                self.linear_kernel,
            )
        if cfg.load.weights_file and self.device.type == "cpu":
            from workers.weight_cache.arena import map_to_file

            map_to_file(model, cfg.load.weights_file)
            source += f", mapped from {cfg.load.weights_file}"
        draft = self._load_draft(show_progress)
        for m in (model, draft):
            if m is not None:
                use_native_ops(m, self.native)
        by_dtype: dict[str, int] = {}
        for p in itertools.chain(model.parameters(), draft.parameters() if draft is not None else ()):
            key = str(p.dtype).removeprefix("torch.")  # a draft's weights count with the target's
            by_dtype[key] = by_dtype.get(key, 0) + p.numel() * p.element_size()
        weight_bytes = sum(by_dtype.values())
        bytes_per_block = self._kv_bytes_per_block(model, cfg.model.num_layers)
        if draft is not None:  # the draft's KV shares the target's block table: budget both per block
            bytes_per_block += self._kv_bytes_per_block(draft, cfg.speculative.draft.num_layers)
        num_blocks = plan_kv_blocks(cfg, bytes_per_block, self.device)
        start = time.perf_counter()
        kv_caches = self._allocate_kv(model, cfg.model.num_layers, num_blocks)
        log.info(
            "rank %d: %d KV blocks (%.1f MiB) allocated in %.2fs; weights %.1f MiB (%s) loaded in %.2fs, "
            "quantized (%s) in %.2fs; attention %s, linears %s",
            self.tp.rank,
            num_blocks,
            num_blocks * bytes_per_block / 2**20,
            time.perf_counter() - start,
            weight_bytes / 2**20,
            ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(by_dtype.items())),
            seconds,
            cfg.model.quantization or "none",
            quant_seconds,
            self.backend.name,
            self.linear_kernel,
        )
        ctx = ProcessorContext(cfg.model.vocab_size, cfg.model.max_model_len, str(self.device))
        processors = load_processors(engine_specs(cfg.logits_processors), ctx)
        proposer = None
        if draft is not None:
            draft_kv = self._allocate_kv(draft, cfg.speculative.draft.num_layers, num_blocks)
            k = cfg.speculative.num_speculative_tokens
            bs, max_len = cfg.cache.block_size, cfg.model.max_model_len
            proposer = DraftProposer(draft, draft_kv, bs, self.device, k, max_len)
        self.runner = ModelRunner(
            model, kv_caches, cfg.cache.block_size, self.device, cfg.model.seed, processors, proposer
        )
        return WorkerReady(
            rank=self.tp.rank,
            num_kv_blocks=num_blocks,
            kv_bytes_per_block=bytes_per_block,
            weight_bytes=weight_bytes,
            weight_bytes_by_dtype=by_dtype,
            load_seconds=seconds,
            quantize_seconds=quant_seconds,
            device=str(self.device),
            weight_source=source,
            cache_fallback_reason=fallback,
        )

    def _load_draft(self, show_progress: bool) -> nn.Module | None:
        """The speculative draft model (from disk, unquantized, not sharded), if one is configured."""
        spec = self.config.speculative
        if spec is None or spec.draft is None:
            return None
        d = spec.draft
        draft, seconds, _ = build_model(
            d.model,
            d.architecture,
            self.dtype,
            self.device,
            TPGroup(),
            self.backend,
            d.max_model_len,
            None,
            show_progress,
            self.linear_kernel,
        )
        log.info("rank %d: draft model %s loaded in %.2fs", self.tp.rank, d.model, seconds)
        return draft

    def _kv_bytes_per_block(self, model: nn.Module, num_layers: int) -> int:
        attn = model.model.layers[0].self_attn
        per_token = kv_bytes_per_token(num_layers, attn.num_kv_heads, attn.head_dim, self.dtype)
        return per_token * self.config.cache.block_size

    def _allocate_kv(self, model: nn.Module, num_layers: int, num_blocks: int) -> list[torch.Tensor]:
        """KV tensors per layer; uninitialised on purpose: the kernels mask every slot beyond a sequence,
        and untouched host pages are never committed, so a large budget costs nothing until used."""
        attn = model.model.layers[0].self_attn
        shape = (2, num_blocks, self.config.cache.block_size, attn.num_kv_heads, attn.head_dim)
        return [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        assert self.runner is not None, "execute_model called before load()"
        start = time.perf_counter()
        out = self.runner.execute(scheduler_output)
        out.execute_seconds = time.perf_counter() - start
        return out
