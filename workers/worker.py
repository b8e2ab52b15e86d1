"""One worker: a device, the model loaded onto it, its KV cache and its model runner.

Runs in a worker process (or inside the offline engine's process). Start-up (`load`), in phases: pick
the device, attention backend and ops -> `prepare`: `load_weights` (and `load_draft`), `pick_kernels` ->
`measure_memory` -> size (`plan_kv_blocks`) and `allocate_kv_cache` -> `build_processors` -> the
model runner; it reports `WorkerReady` (block count, bytes, load time). Then `execute_model` serves
each step. A pipeline stage loads and caches only its layers and samples only on the last stage.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple, cast

import torch

from coreproc.base import trace
from coreproc.base.config import EngineConfig, ModelConfig, SpeculativeConfig
from coreproc.base.kv_layout import KVLayout
from coreproc.base.logits_processors import LogitsProcessor, ProcessorContext, engine_specs, load_processors
from coreproc.base.protocol import RunnerOutput, SchedulerOutput, WorkerReady
from kernels import select_backend
from kernels.cpu_gemm import bf16_layout, claim_tiles, select_linear_kernel
from kernels.native import use_native
from workers.draft import DraftProposer
from workers.kv_memory import held_slots, kv_layout, plan_kv_blocks
from workers.kv_scales import calibrate_kv_scales, kv_cache_dtype
from workers.loader import ModelSpec, build_model, release_load_memory
from workers.mm_inputs import EncoderCache
from workers.model_runner import ModelRunner, RunnerParts
from workers.models.fused_decode import Forward, select_forward
from workers.models.layers import kv_bytes_per_token
from workers.models.llama import LlamaForCausalLM
from workers.models.moe import routed_expert_bytes
from workers.models.ops import install_ops, select_ops
from workers.parallel import PPGroup, TPGroup, device_index
from workers.pipeline import StageForward
from workers.structured import StructuredOutputs

log = logging.getLogger("ember.worker")


def _index(device: torch.device) -> int | None:
    """The device's index, None where none was given ("cuda"); torch's stubs type it as always int."""
    return device.index


@dataclass(frozen=True)
class LoadedWeights:
    """The target model as `load_weights` left it, and how it got there."""

    model: LlamaForCausalLM
    source: str  # "disk" or "ipc_cache", and the file its weights are mapped from, if any
    load_seconds: float
    quantize_seconds: float
    cache_fallback_reason: str  # why the preload cache was not used ("" if it was, or not asked for)


class Prepared(NamedTuple):
    """What `Worker.prepare` leaves: the target model, the draft model (if any) and the kernels."""

    weights: LoadedWeights
    draft: LlamaForCausalLM | None
    forward: Forward


@dataclass(frozen=True)
class MemoryUsage:
    """What the loaded weights take and what one KV block will take (target and draft together)."""

    weight_bytes_by_dtype: dict[str, int]
    kv_bytes_per_block: int
    workspace_bytes: int = 0  # the most a step's experts allocate at once (a full batch to the same ones)

    @property
    def weight_bytes(self) -> int:
        return sum(self.weight_bytes_by_dtype.values())


class Worker:
    """Builds everything a device needs, then executes scheduler steps."""

    def __init__(self, config: EngineConfig, tp: TPGroup | None = None, pp: PPGroup | None = None) -> None:
        self.config = config
        self.tp = tp or TPGroup()
        self.pp = pp or PPGroup()
        self.rank = self.pp.stage * self.tp.size + self.tp.rank  # among the engine's workers
        self.device = torch.device(config.device.resolved)
        if self.device.type == "cuda" and _index(self.device) is None:
            self.device = torch.device("cuda", device_index(config, self.rank))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = getattr(torch, config.model.dtype)
        self.kv_dtype = kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.backend = select_backend(self.device, config.device.attention_backend)
        self.ops = select_ops(use_native(self.device))
        self.linear_kernel = select_linear_kernel(self.device, self.dtype)
        self.bf16_layout = bf16_layout(self.device) if self.linear_kernel == "cpu_bf16" else ""
        self.runner: ModelRunner | None = None

    @property
    def returns_tokens(self) -> bool:
        """Whether this worker's step results carry the sampled tokens (the last stage's TP rank 0)."""
        return self.pp.is_last and self.tp.rank == 0

    def prepare(self, show_progress: bool = True, cache_only: bool = False) -> Prepared:
        """The start-up's phases that depend on the config alone: the weights (and draft) loaded, the
        kernels picked. `load` runs them unless a prepared worker (workers/prepared.py) ran them
        before its restart came. `cache_only`: the weights from the preload cache or a RuntimeError
        saying why not (never from disk)."""
        with trace.phase("load weights"):
            weights = self.load_weights(show_progress, cache_only)
        draft = self.load_draft(show_progress)
        if weights.source != "ipc_cache" or draft is not None:
            release_load_memory()
        with trace.phase("pick kernels"):
            forward = self.pick_kernels(weights.model)
        return Prepared(weights, draft, forward)

    def load(self, show_progress: bool = True, prepared: Prepared | None = None) -> WorkerReady:
        """Start-up in named phases (`prepare`'s unless given); returns what the core needs to know
        about this rank."""
        weights, draft, forward = prepared or self.prepare(show_progress)
        lora = None
        if self.config.lora.enable_lora:
            from workers.lora import LoRAManager  # (imports triton: only where adapters are served)

            lora = LoRAManager(weights.model, self.config.lora, self.tp, self.device, self.dtype)
        draft_forward = self.pick_kernels(draft) if draft is not None else None
        layout = kv_layout(weights.model, self.config, draft is not None)
        memory = self.measure_memory(weights.model, draft, layout)
        num_blocks = plan_kv_blocks(
            self.config, memory.kv_bytes_per_block, self.device, layout, memory.workspace_bytes
        )
        start = time.perf_counter()
        with trace.phase("allocate the KV cache"):
            kv_caches = self.allocate_kv_cache(weights.model, num_blocks, layout)
            self.calibrate(weights.model, kv_caches)
        self._log_start_up(weights, memory, num_blocks, time.perf_counter() - start)
        with trace.phase("logits processors"):
            processors = self.build_processors()
        proposer = None if draft is None else self.build_proposer(draft, num_blocks, draft_forward)
        block_size, seed = self.config.cache.block_size, self.config.model.seed
        model = self.config.model
        with trace.phase("structured outputs"):
            structured = StructuredOutputs(model.model, model.vocab_size, list(model.eos_token_ids))
        images = (
            EncoderCache(self.config.cache.encoder_cache_bytes)
            if hasattr(weights.model, "embed_images")
            else None
        )
        parts = RunnerParts(
            seed=seed,
            processors=processors,
            draft=proposer,
            forward=forward,
            structured=structured,
            encoder_cache=images,
            lora=lora,
            samples=self.pp.is_last,
            layout=layout,
        )
        self.runner = ModelRunner(weights.model, kv_caches, block_size, self.device, parts)
        moe = weights.model.parts.moe
        return WorkerReady(
            rank=self.rank,
            num_kv_blocks=num_blocks,
            kv_bytes_per_block=memory.kv_bytes_per_block,
            weight_bytes=memory.weight_bytes,
            weight_bytes_by_dtype=memory.weight_bytes_by_dtype,
            load_seconds=weights.load_seconds,
            quantize_seconds=weights.quantize_seconds,
            device=str(self.device),
            weight_source=weights.source,
            cache_fallback_reason=weights.cache_fallback_reason,
            kv_layout=layout,
            expert_bytes=routed_expert_bytes(weights.model),
            expert_share=0.0 if moe is None else moe.top_k / moe.num_experts,
        )

    def load_weights(self, show_progress: bool, cache_only: bool = False) -> LoadedWeights:
        """The target model: mapped from a preload daemon when asked (and it answers), else built and
        loaded from disk and quantized (`cache_only`: a RuntimeError instead); on CPU then moved into
        `weights_file` when one is given."""
        cfg = self.config
        model, seconds, quant_seconds, fallback = None, 0.0, 0.0, ""
        if cfg.load.load_format == "ipc_cache":
            model, seconds, fallback = self._from_cache()
        if model is None and cache_only:
            raise RuntimeError(f"the weights are not the preload cache's ({fallback or 'not asked for'})")
        source = "ipc_cache" if model is not None else "disk"
        if model is None:
            spec = ModelSpec(
                cfg.model.model,
                cfg.model.architecture,
                self.dtype,
                self.device,
                self.backend,
                cfg.model.max_model_len,
                tp=self.tp,
                pp=self.pp,
                quantization=cfg.model.quantization,
                kernel=self.linear_kernel,
            )
            model, seconds, quant_seconds = build_model(spec, show_progress)
        if cfg.load.weights_file and self.device.type == "cpu":
            from workers.weight_cache.arena import map_to_file

            map_to_file(model, cfg.load.weights_file)
            source += f", mapped from {cfg.load.weights_file}"
        return LoadedWeights(model, source, seconds, quant_seconds, fallback)

    def _from_cache(self) -> tuple[LlamaForCausalLM | None, float, str]:
        """The model mapped from a preload daemon, or (None, 0, why not)."""
        from workers.weight_cache.client import CacheUnavailable, load_from_cache

        start = time.perf_counter()
        try:
            # built by loader.construct, like a model from disk (the client's type says only nn.Module)
            model = cast(LlamaForCausalLM, load_from_cache(self.config, self.device, self.tp, self.backend))
        except CacheUnavailable as e:
            log.warning("rank %d: ipc_cache: %s; loading from disk", self.rank, e)
            return None, 0.0, str(e)
        return model, time.perf_counter() - start, ""

    def load_draft(self, show_progress: bool) -> LlamaForCausalLM | None:
        """The speculative draft model (from disk, unquantized, not sharded), if one is configured."""
        spec = self.config.speculative
        if spec is None or spec.draft is None:
            return None
        d = spec.draft
        with trace.phase("load the draft model"):
            draft_spec = ModelSpec(
                d.model, d.architecture, self.dtype, self.device, self.backend, d.max_model_len,
                kernel=self.linear_kernel,
            )  # fmt: skip
            draft, seconds, _ = build_model(draft_spec, show_progress)
        log.info("rank %d: draft model %s loaded in %.2fs", self.rank, d.model, seconds)
        return draft

    def _draft_config(self) -> tuple[SpeculativeConfig, ModelConfig]:
        """The speculative config and its draft model's, for the phases after `load_draft` found one."""
        spec = self.config.speculative
        assert spec is not None and spec.draft is not None, "no draft model is configured"
        return spec, spec.draft

    def pick_kernels(self, model: LlamaForCausalLM) -> Forward:
        """Install this worker's ops (native CPU ops or torch) on a loaded model and return what runs
        its steps: the one-call decode layers where every layer qualifies, else the model itself."""
        install_ops(model, self.ops)
        if self.pp.size > 1:  # hidden states in from the previous stage, out to the next
            return StageForward(model, self.pp, self.dtype)
        return select_forward(model)

    def measure_memory(
        self, model: LlamaForCausalLM, draft: LlamaForCausalLM | None, layout: KVLayout
    ) -> MemoryUsage:
        """Weight bytes by dtype (a draft's count with the target's) and KV bytes per block: a page of
        each KV tensor the held layers use (a group's worth of layers); the draft's KV shares the
        target's block table, so one block budgets both."""
        by_dtype: dict[str, int] = {}
        for p in itertools.chain(model.parameters(), draft.parameters() if draft is not None else ()):
            key = str(p.dtype).removeprefix("torch.")
            by_dtype[key] = by_dtype.get(key, 0) + p.numel() * p.element_size()
        per_block = self._kv_bytes_per_block(model, len(held_slots(model, layout)))
        if draft is not None:
            per_block += self._kv_bytes_per_block(draft, self._draft_config()[1].num_layers)
        moe = model.parts.moe
        tokens = self.config.scheduler.max_num_batched_tokens
        hidden = model.config.hidden_size
        workspace = 0 if moe is None else moe.workspace_bytes(hidden, tokens, self.dtype.itemsize)
        return MemoryUsage(by_dtype, per_block, workspace)

    def _kv_bytes_per_block(self, model: LlamaForCausalLM, num_layers: int) -> int:
        attn = model.held_layers()[0].self_attn
        per_token = kv_bytes_per_token(num_layers, attn.num_kv_heads, attn.head_dim, self.kv_dtype)
        return per_token * self.config.cache.block_size

    def allocate_kv_cache(
        self, model: LlamaForCausalLM, num_blocks: int, layout: KVLayout
    ) -> list[torch.Tensor]:
        """The KV tensor of each held layer, layers in the same place of different KV groups sharing
        one; uninitialised on purpose: the kernels mask every slot beyond a sequence, and untouched
        host pages are never committed, so a large budget costs nothing until used, unless
        `kv_cache_prefault` asks for every page now (zeroing writes each one). The null block that
        stands in sliding groups' tables for blocks given back is zeroed: a masked key must not be NaN."""
        attn = model.held_layers()[0].self_attn
        shape = (2, num_blocks, self.config.cache.block_size, attn.num_kv_heads, attn.head_dim)
        tensors = {
            j: torch.empty(shape, dtype=self.kv_dtype, device=self.device) for j in held_slots(model, layout)
        }
        for cache in tensors.values():
            if self.config.cache.kv_cache_prefault and self.device.type == "cpu":
                cache.zero_()
            elif layout.slides:
                cache[:, 0].zero_()
        slots = layout.layer_slots()
        return [tensors[slots[i]] for i in model.held]

    def calibrate(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor]) -> None:
        """The per-kv-head scales of an fp8 cache (workers/kv_scales.py); nothing for other dtypes."""
        if self.kv_dtype.itemsize == 1:
            start = time.perf_counter()
            calibrate_kv_scales(
                model, kv_caches, self.config.model.vocab_size, self.config.model.max_model_len
            )
            log.info("rank %d: fp8 KV scales calibrated in %.2fs", self.rank, time.perf_counter() - start)

    def _log_start_up(
        self, weights: LoadedWeights, memory: MemoryUsage, num_blocks: int, kv_seconds: float
    ) -> None:
        by_dtype = memory.weight_bytes_by_dtype
        log.info(
            "rank %d: %d KV blocks (%.1f MiB) allocated in %.2fs; weights %.1f MiB (%s) loaded in %.2fs, "
            "quantized (%s) in %.2fs; attention %s, linears %s; experts' workspace %.1f MiB",
            self.rank,
            num_blocks,
            num_blocks * memory.kv_bytes_per_block / 2**20,
            kv_seconds,
            memory.weight_bytes / 2**20,
            ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(by_dtype.items())),
            weights.load_seconds,
            self.config.model.quantization or "none",
            weights.quantize_seconds,
            self.backend.name,
            self.linear_kernel,
            memory.workspace_bytes / 2**20,
        )

    def build_processors(self) -> list[LogitsProcessor]:
        """The logits processors the engine loads (built-ins, entry points, `--logits-processors`)."""
        cfg = self.config
        ctx = ProcessorContext(cfg.model.vocab_size, cfg.model.max_model_len, str(self.device))
        return load_processors(engine_specs(cfg.logits_processors), ctx)

    def build_proposer(
        self, draft: LlamaForCausalLM, num_blocks: int, forward: Forward | None
    ) -> DraftProposer:
        """The draft model with its own KV cache (the target's block count), on the target's block tables."""
        cfg = self.config
        spec, draft_cfg = self._draft_config()
        kv_caches = self.allocate_kv_cache(draft, num_blocks, KVLayout.full(draft_cfg.num_layers))
        self.calibrate(draft, kv_caches)
        k = spec.num_speculative_tokens
        bs, max_len = cfg.cache.block_size, cfg.model.max_model_len
        return DraftProposer(draft, kv_caches, bs, self.device, k, max_len, forward)

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        assert self.runner is not None, "execute_model called before load()"
        start = time.perf_counter()
        claim_tiles(self.bf16_layout)  # a snapshot restore drops the AMX grant: re-ask each step
        out = self.runner.execute(scheduler_output)
        out.execute_seconds = time.perf_counter() - start
        return out
