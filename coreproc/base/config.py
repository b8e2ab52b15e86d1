"""The engine's configuration: one root of frozen dataclasses, built once from the CLI or the LLM API.

Part of the shared base: runs in every process (the config travels to workers as JSON) and imports
nothing above it. Every engine setting is a field declared with `option(...)` (coreproc.base.options): its
type, default, help and flag are said here once, and the CLI's engine flags and `LLM(...)`'s keywords
are derived from them. Values the engine learns while running (KV block count) travel in typed
messages and are never written back here; facts of the checkpoint (shape, EOS ids) are read once, in
`ModelConfig.from_dir`. `EngineConfig.create(...)` validates user input: each section checks the
user's values before anything is derived from them, and a `ConfigError` names the keyword at fault.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from coreproc.base import options as opt
from coreproc.base.errors import ConfigError
from coreproc.base.limits import RequestLimits
from coreproc.base.lora import LoRAConfig
from coreproc.base.model_config import ModelConfig, one_of, read_draft, refuse_unsupported
from coreproc.base.options import at_least, option
from coreproc.base.parallel_config import ParallelConfig

__all__ = [
    "ConfigError",
    "EngineConfig",
    "ModelConfig",
    "ENGINE_SECTIONS",
    "add_engine_arguments",
    "engine_options",
]

log = logging.getLogger("ember.config")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing and prefix caching."""

    block_size: int = option("tokens per KV block (a power of two)", 16)
    num_kv_blocks: int | None = option("fixed number of KV blocks (default: from the memory budget)", None)
    kv_cache_memory: int | None = option("bytes of KV cache across all layers", None)
    kv_cache_memory_fraction: float | None = option("fraction of free memory for the KV cache", None)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = option(
        "KV cache dtype: auto = the model's; fp8 = e4m3 with per-kv-head scales (half the bytes)", "auto"
    )
    kv_cache_prefault: bool = option(
        "commit the KV cache's host memory at start (CPU; a GPU's is committed anyway): resident memory "
        "is flat from the first request and an overcommitted host fails at start, not hours into "
        "serving; costs about 0.25 s of start time per GiB",
        False,
    )
    enable_prefix_caching: bool = option("reuse the KV blocks of shared prompt prefixes", True)
    release_window_blocks: bool = option(
        "sliding-window layers give back the KV blocks that fall behind their window while a request "
        "runs (a block table per group of layers); --no-release-window-blocks keeps every block",
        True,
    )
    prefix_hash_seed: int | None = option(
        "prefix-cache hash seed (default: random per launch)", None, flag="--prefix-cache-seed"
    )
    mm_processor_cache_gb: float = option(
        "GiB of processed images the core keeps, so that an image sent again travels as its hash (0: off)",
        1.0,
    )
    mm_encoder_cache_gb: float = option(
        "GiB of vision-encoder outputs each worker keeps, keyed by image content (LRU)", 0.5
    )

    @property
    def mm_cache_bytes(self) -> int:
        return int(self.mm_processor_cache_gb * 2**30)

    @property
    def encoder_cache_bytes(self) -> int:
        return int(self.mm_encoder_cache_gb * 2**30)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError.bad("block_size", f"must be a power of two, got {self.block_size}")
        at_least(self, 1, "num_kv_blocks", "kv_cache_memory")
        frac = self.kv_cache_memory_fraction
        if frac is not None and not 0.0 < frac <= 1.0:
            raise ConfigError.bad("kv_cache_memory_fraction", f"must be in (0, 1], got {frac}")
        at_least(self, 0, "mm_processor_cache_gb", "mm_encoder_cache_gb")
        opt.check_choices(self)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Continuous-batching limits and policy."""

    max_num_seqs: int = option("most sequences in the engine at once (sizes per-step buffers)", 256)
    max_num_batched_tokens: int = option(
        "token budget of one step (default: the context length, clamped to [2048, 8192])", derived=True
    )
    policy: Literal["fcfs", "priority"] = option(
        "order of admission", "fcfs", keyword="scheduling_policy", flag="--scheduling-policy"
    )
    async_scheduling: bool = option(
        "schedule the next step while workers run the current one (multiprocess engine)", True
    )
    max_num_active_seqs: int | None = option("cap on running requests (<= --max-num-seqs)", None)
    long_prefill_token_threshold: int = option(
        "prefills longer than this share the step budget fairly while others wait "
        "(default: 4% of the context, at least one block; 0 disables)",
        derived=True,
    )
    max_num_queued_requests: int | None = option("refuse (503) new requests beyond this many waiting", None)
    max_num_queued_tokens: int | None = option("refuse (503) beyond this many waiting prompt tokens", None)
    stall_timeout: float = option(
        "seconds with work held and no step completed before /health reports a stall", 60.0
    )
    stall_action: Literal["fail", "report"] = option(
        "on a stall: fail: end every request with an error and stop the engine (a supervisor restarts "
        "it); report: only /health says so, and the engine goes on if the step ever completes",
        "fail",
    )

    def __post_init__(self) -> None:
        at_least(self, 1, "max_num_seqs", "max_num_batched_tokens")
        at_least(self, 1, "max_num_queued_requests", "max_num_queued_tokens")
        at_least(self, 0, "long_prefill_token_threshold")
        opt.check_choices(self)
        active = self.max_num_active_seqs
        if active is not None and not 1 <= active <= self.max_num_seqs:
            limit = f"must be in [1, max_num_seqs={self.max_num_seqs}], got {active}"
            raise ConfigError.bad("max_num_active_seqs", limit, also=("max_num_seqs",))
        if self.stall_timeout <= 0:
            raise ConfigError.bad("stall_timeout", f"must be positive, got {self.stall_timeout}")

    @property
    def max_running(self) -> int:
        return self.max_num_active_seqs or self.max_num_seqs


@dataclass(frozen=True)
class LoadConfig:
    """Where weights come from: the checkpoint on disk, or a preload daemon's cache (`ipc_cache`)."""

    load_format: Literal["auto", "ipc_cache"] = option(
        "auto: from disk; ipc_cache: from a running `ember preload` (disk when none answers)", "auto"
    )
    socket_dir: str | None = option("preload daemons' socket directory (default: a private one)", None)
    preload_wait_timeout: float = option("wait this long for a preload daemon (s)", 0.0)
    weights_file: str | None = option(  # set by `ember snapshot`
        "CPU: serve weights from a copy-on-write mapping of this file", None, hidden=True
    )
    worker_zygote: bool = option(
        "with --load-format ipc_cache, fork workers from the preload zygote when one is running", True
    )

    def __post_init__(self) -> None:
        opt.check_choices(self)


SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: how tokens are proposed and how many per step (`--speculative-config`)."""

    method: Literal["ngram", "draft_model"] = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1  # n-gram: shortest suffix to match
    prompt_lookup_max: int = 4  # n-gram: longest suffix to match (tried first)
    model: str | None = None  # draft_model: the draft checkpoint (same tokenizer as the target)
    adaptive: bool = True  # per-request proposal length from its recent acceptance (spec_decode.py)
    draft: ModelConfig | None = None  # filled by EngineConfig.create from `model`

    def __post_init__(self) -> None:
        one_of(self.method, SPEC_METHODS, "speculative method")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not 1 <= low <= high:
            raise ConfigError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {low} and {high}")
        if self.method == "draft_model" and not self.model:
            raise ConfigError('speculative method "draft_model" needs "model": the draft checkpoint folder')

    @classmethod
    def parse(cls, text: str | Mapping[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the `speculative_config` option's JSON (or a dict); every error names the option, and
        unknown keys are an error naming them."""
        if isinstance(text, SpeculativeConfig):
            return text
        if text is None or text == "":
            return None
        try:
            raw = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as e:
            raise _speculative_error(f"not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise _speculative_error(f"must be a JSON object, got {text!r}")
        known = set(cls.__dataclass_fields__) - {"draft"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise _speculative_error(
                f"unknown speculative-config key {unknown[0]!r}; known: {', '.join(sorted(known))}"
            )
        try:
            return cls(**raw)
        except ConfigError as e:
            raise _speculative_error(str(e)) from None


def _speculative_error(problem: str) -> ConfigError:
    return ConfigError(f"speculative_config: {problem}", option="speculative_config")


@dataclass(frozen=True)
class DeviceConfig:
    """Where workers run and which attention backend they use (None: chosen by device)."""

    device: str = option("cpu, cuda, cuda:N, or auto (CUDA when present)", "auto")
    attention_backend: Literal["torch", "triton"] | None = option(
        "attention kernels (default: triton on CUDA, torch on CPU)", None
    )

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError.bad("device", f"must be cpu, cuda, cuda:N or auto, got {self.device!r}")
        opt.check_choices(self)

    @property
    def resolved(self) -> str:
        """ "auto" means CUDA when this torch build supports it and an NVIDIA device is present; decided
        without importing torch, which costs seconds in processes that never compute (frontend, core)."""
        from coreproc.base.host import cuda_present

        if self.device != "auto":
            return self.device
        return "cuda" if cuda_present() else "cpu"

    @property
    def resolved_type(self) -> str:
        return self.resolved.split(":")[0]


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The root: everything an engine needs, built once."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig  # no default: its budget and long-prefill threshold derive from the model
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    # processors beyond the built-ins: installed entry points (found by `create`), then module:Class flags
    logits_processors: tuple[str, ...] = option(
        "extra logits processors (built-ins and ember.logits_processors entry points always load)",
        (),
        metavar="MODULE:CLASS",
    )
    speculative: SpeculativeConfig | None = option(
        'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'',
        None,
        keyword="speculative_config",
        metavar="JSON",
    )
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may ask for
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @classmethod
    def create(cls, model: str | os.PathLike | None = None, **options: Any) -> EngineConfig:
        """Build and validate the whole tree from flat keywords: one per option of `ENGINE_SECTIONS`
        (the CLI's engine flags), plus `request_limits` (a RequestLimits or a mapping of its fields)."""
        values = opt.defaults(ENGINE_SECTIONS)
        extra = options.pop("request_limits", None)
        unknown = sorted(set(options) - set(values))
        if unknown:
            near = difflib.get_close_matches(unknown[0], list(values), n=1)
            raise ConfigError(
                f"unknown engine option {unknown[0]!r}" + (f"; did you mean {near[0]!r}?" if near else "")
            )
        values.update(options, model=model)
        parts = {
            title: {s.field: values[s.keyword] for s in opt.settings(((title, sec),))}
            for title, sec in ENGINE_SECTIONS
        }
        # each section checks the user's values (naming their keywords) before anything derives from them
        device, cache = DeviceConfig(**parts["device"]), CacheConfig(**parts["cache"])
        parallel = ParallelConfig(**parts["parallel"])
        m = parts["model"]
        model_cfg = ModelConfig.from_dir(
            m["model"], m["dtype"], m["max_model_len"], m["seed"], device.resolved_type, m["quantization"],
            m["revision"],
        )  # fmt: skip
        refuse_unsupported(model_cfg, parallel.tensor_parallel_size)
        sched = parts["scheduler"]
        if sched["max_num_batched_tokens"] is None:
            sched["max_num_batched_tokens"] = max(2048, min(model_cfg.max_model_len, 8192))
        if sched["long_prefill_token_threshold"] is None:  # 4% of the context, at least one block
            sched["long_prefill_token_threshold"] = max(cache.block_size, model_cfg.max_model_len // 25)
        flags = values["logits_processors"]
        processors = _check_processors((flags,) if isinstance(flags, str) else tuple(flags), model_cfg)
        speculative = SpeculativeConfig.parse(values["speculative_config"])
        if speculative is not None:  # verification needs each step's tokens before the next is planned
            sched["async_scheduling"] = False
        if speculative is not None and speculative.method == "draft_model":
            tp = parallel.tensor_parallel_size
            draft = read_draft(speculative.model, model_cfg, tp, device.resolved_type)
            speculative = dataclasses.replace(speculative, draft=draft)
        scheduler = SchedulerConfig(**sched)
        given = parts["request limits"]
        if extra is not None:  # `request_limits=`: a RequestLimits, or a mapping of some fields
            given |= dataclasses.asdict(extra) if isinstance(extra, RequestLimits) else dict(extra)
        limits = RequestLimits.of(given).resolve(scheduler.max_num_seqs, model_cfg.vocab_size)
        config = cls(
            model=model_cfg,
            cache=cache,
            scheduler=scheduler,
            parallel=parallel,
            device=device,
            load=LoadConfig(**parts["load"]),
            lora=LoRAConfig(**parts["lora"]),
            logits_processors=processors,
            speculative=speculative,
            limits=limits,
        )
        if config.parallel.pipeline_parallel_size > 1:
            _check_pipeline(config)
        return config

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.model.max_model_len // self.cache.block_size)


def _check_pipeline(config: EngineConfig) -> None:
    """Refuse, in one line each, what pipeline stages cannot serve in this version; check the layer
    partition against the model."""
    pp, load = config.parallel.pipeline_parallel_size, config.load
    config.parallel.stage_layers(config.model.num_layers)
    draft = config.speculative is not None and config.speculative.method == "draft_model"
    fp8 = "an fp8 KV cache (kv_cache_dtype: its scales come from a whole-model pass)"
    refused = [  # (refused, what, the option that asks for it)
        (load.load_format == "ipc_cache", "the preload weight cache (load_format=ipc_cache)", "load_format"),
        (load.weights_file is not None, "a snapshot's weights file", ""),
        (config.model.is_multimodal, "a vision-language model", ""),
        (config.lora.enable_lora, "LoRA adapters (enable_lora)", "enable_lora"),
        (draft, "a draft model (speculative_config)", "speculative_config"),
        (config.cache.kv_cache_dtype != "auto", fp8, "kv_cache_dtype"),
    ]
    for hit, what, other in refused:
        if hit:
            raise ConfigError(
                f"{what} does not support pipeline parallelism; use pipeline_parallel_size=1, not {pp}",
                option="pipeline_parallel_size",
                also=(other,) if other else (),
            )


def _check_processors(flags: tuple[str, ...], model: ModelConfig) -> tuple[str, ...]:
    """Installed entry points (looked up once, here) then the flags' processors; each must load."""
    from coreproc.base.logits_processors import (
        ProcessorContext,
        engine_specs,
        installed_specs,
        load_processors,
    )

    specs = (*installed_specs(), *flags)
    if specs:  # fail fast, in the caller's process, on a processor that cannot load
        try:
            load_processors(engine_specs(specs), ProcessorContext(model.vocab_size, model.max_model_len))
        except ValueError as e:
            raise ConfigError(f"logits_processors: {e}", option="logits_processors") from None
    return specs


# every engine setting, by section: the CLI's argument groups and `create()`'s keywords
ENGINE_SECTIONS: tuple[tuple[str, type], ...] = (
    ("model", ModelConfig),
    ("cache", CacheConfig),
    ("scheduler", SchedulerConfig),
    ("parallel", ParallelConfig),
    ("device", DeviceConfig),
    ("load", LoadConfig),
    ("lora", LoRAConfig),
    ("engine", EngineConfig),
    ("request limits", RequestLimits),
)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine flags of every command that builds an engine: one argument group per section."""
    opt.add_arguments(p, ENGINE_SECTIONS)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed engine flags as `EngineConfig.create` keywords (a positional model wins over --model)."""
    kwargs = opt.collect(args, ENGINE_SECTIONS)
    kwargs["model"] = getattr(args, "model", None) or kwargs["model"]
    return kwargs
