"""The engine's configuration: one root of frozen dataclasses, built once from the CLI or the LLM API.

Runs in every process (the config travels to workers as constructor arguments). Values the engine
learns while running (KV block count, EOS ids) travel in typed messages and are never written back
here. `EngineConfig.create(...)` validates user input and raises `ConfigError` with one clear line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coreproc.limits import RequestLimits
from workers.models import SUPPORTED_ARCHITECTURES
from workers.quant import resolve_name as resolve_quantization

DTYPES = ("auto", "float32", "bfloat16", "float16")
POLICIES = ("fcfs", "priority")


class ConfigError(ValueError):
    """A configuration value is wrong; the message is one line meant for the user."""


def cuda_present() -> bool:
    """Whether the installed torch was built with CUDA and the host has an NVIDIA device."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    version_file = Path(spec.submodule_search_locations[0]) / "version.py"
    try:
        built_with_cuda = re.search(r"^cuda\b.*=\s*['\"]", version_file.read_text(), re.MULTILINE) is not None
    except OSError:
        return False
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return built_with_cuda and bool(glob.glob("/dev/nvidia[0-9]*"))


def engine_version() -> str:
    """The installed ember-serve version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ember-serve")
    except PackageNotFoundError:
        return "0+unknown"


def cpu_has_fast_half(dtype: str = "bfloat16") -> bool:
    """Whether this CPU computes `dtype` (bfloat16 / float16) fast: natively (AVX-512 BF16 / FP16, AMX),
    or, for bfloat16, through Ember's native CPU ops (AVX2 + FMA; not with EMBER_CPU_KERNELS=torch).
    Otherwise torch emulates it, many times slower than float32."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split())
                    break
    except OSError:
        pass
    if flags & {"avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"}:
        return True
    native = os.environ.get("EMBER_CPU_KERNELS", "auto").strip().lower() != "torch"
    return dtype == "bfloat16" and native and {"avx2", "fma"} <= flags


def default_model_dir() -> Path:
    """The small model bundled with Ember, used whenever no model is given."""
    return Path(__file__).resolve().parent.parent / "tools" / "default_model"


@dataclass(frozen=True)
class ModelConfig:
    """The checkpoint and what we read from its config.json (read once, here)."""

    model: str
    architecture: str
    dtype: str  # resolved: float32 | bfloat16 | float16
    max_model_len: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    tokenizer: str
    seed: int = 0
    quantization: str | None = None  # canonical online-quantization method name
    revision: str | None = None  # the user's name for this checkpoint version (part of the cache key)

    @classmethod
    def from_dir(
        cls,
        model: str | os.PathLike | None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        device: str = "cpu",
        quantization: str | None = None,
        revision: str | None = None,
    ) -> ModelConfig:
        """Read config.json. dtype "auto" takes the checkpoint's dtype, except that on a CPU that would
        only emulate it (`cpu_has_fast_half`) it computes in float32 (emulated bf16 is many times slower)."""
        path = Path(model) if model is not None else default_model_dir()
        if not path.is_dir():
            raise ConfigError(f"model directory not found: {path}")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"{path} has no config.json (is it a Hugging Face checkpoint folder?)")
        if not any(path.glob("*.safetensors")):
            raise ConfigError(f"{path} holds no *.safetensors weights")
        hf = json.loads(cfg_file.read_text())
        try:
            quantization = resolve_quantization(quantization)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if hf.get("quantization_config"):
            method = hf["quantization_config"].get("quant_method", "unknown")
            raise ConfigError(f"{path} is a pre-quantized checkpoint ({method}); Ember does not load those")
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or '(none given)'} in {cfg_file}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        if dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        if dtype == "auto":
            dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").replace("torch.", "")
            if dtype not in DTYPES:
                dtype = "float32"
            if dtype != "float32" and device == "cpu" and not cpu_has_fast_half(dtype):
                dtype = "float32"
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        limit = int(hf.get("max_position_embeddings") or 2048)
        if max_model_len is None:
            max_model_len = limit
        elif max_model_len < 2:
            raise ConfigError("max_model_len must be at least 2")
        elif max_model_len > limit:
            raise ConfigError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}"
            )
        return cls(
            model=str(path),
            architecture=arch,
            dtype=dtype,
            max_model_len=max_model_len,
            vocab_size=int(hf["vocab_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            hidden_size=hidden,
            tokenizer=str(path),
            seed=seed,
            quantization=quantization,
            revision=revision,
        )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing and prefix caching."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # fixed count; otherwise derived from the memory budget
    kv_cache_memory: int | None = None  # bytes for KV across all layers
    kv_cache_memory_fraction: float | None = None  # of free memory; default per device
    enable_prefix_caching: bool = True
    prefix_hash_seed: int | None = None  # None: a random seed per launch

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError("num_kv_blocks must be at least 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError("kv_cache_memory must be a positive number of bytes")
        frac = self.kv_cache_memory_fraction
        if frac is not None and not 0.0 < frac <= 1.0:
            raise ConfigError("kv_cache_memory_fraction must be in (0, 1]")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits and policy."""

    max_num_seqs: int = 256  # sizes per-step buffers
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"
    async_scheduling: bool = True  # multiprocess engines schedule step N+1 while step N runs
    max_num_active_seqs: int | None = None  # cap on RUNNING requests (None: max_num_seqs)
    # a prefill longer than this is "long": while other prefills wait it gets a fair share of the
    # step budget, floor(budget / prefills), instead of all of it (0: never share)
    long_prefill_token_threshold: int = 0
    max_num_queued_requests: int | None = None  # new requests beyond this are refused (HTTP 503)
    max_num_queued_tokens: int | None = None  # ... and beyond this many queued prompt tokens
    stall_timeout: float = 60.0  # work held but no step completed for this long: unhealthy

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be at least 1")
        active = self.max_num_active_seqs
        if active is not None and not 1 <= active <= self.max_num_seqs:
            raise ConfigError(
                f"max_num_active_seqs must be in [1, max_num_seqs={self.max_num_seqs}], got {active}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold must be >= 0")
        for name in ("max_num_queued_requests", "max_num_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1")
        if self.stall_timeout <= 0:
            raise ConfigError("stall_timeout must be positive")
        if self.policy not in POLICIES:
            raise ConfigError(
                f"unknown scheduling policy {self.policy!r}; choose one of {', '.join(POLICIES)}"
            )

    @property
    def max_running(self) -> int:
        return self.max_num_active_seqs or self.max_num_seqs


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (each worker gets its own copy with `rank` set) and this engine's DP place."""

    tensor_parallel_size: int = 1
    rank: int = 0
    data_parallel_size: int = 1
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError("tensor_parallel_size must be at least 1")
        if self.data_parallel_size < 1 or not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ConfigError("data_parallel_rank must be in [0, data_parallel_size)")


LOAD_FORMATS = ("auto", "ipc_cache")


@dataclass(frozen=True)
class LoadConfig:
    """Where weights come from: the checkpoint on disk, or a preload daemon's cache (`ipc_cache`)."""

    load_format: str = "auto"
    socket_dir: str | None = None  # where preload daemons listen (default: a private per-user dir)
    preload_wait_timeout: float = 0.0  # seconds to wait for a daemon before loading from disk
    # CPU: after loading, serve the weights from a copy-on-write mapping of this file (snapshots)
    weights_file: str | None = None
    worker_zygote: bool = True  # with ipc_cache, fork workers from the preload zygote when it is there

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"unknown load format {self.load_format!r}; choose one of {', '.join(LOAD_FORMATS)}"
            )


SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: how tokens are proposed and how many per step."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1  # n-gram: shortest suffix to match
    prompt_lookup_max: int = 4  # n-gram: longest suffix to match (tried first)
    model: str | None = None  # draft_model: the draft checkpoint (same tokenizer as the target)
    draft: ModelConfig | None = None  # filled by EngineConfig.create from `model`

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(
                f"unknown speculative method {self.method!r}; choose one of {', '.join(SPEC_METHODS)}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("num_speculative_tokens must be in [1, 16]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft_model" and not self.model:
            raise ConfigError('speculative method "draft_model" needs "model": the draft checkpoint folder')

    @classmethod
    def parse(cls, text: str | dict | None) -> SpeculativeConfig | None:
        """From `--speculative-config` JSON (or a dict); unknown keys are an error naming them."""
        if text is None or text == "":
            return None
        try:
            raw = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
        known = set(cls.__dataclass_fields__) - {"draft"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(
                f"unknown speculative-config key {unknown[0]!r}; known: {', '.join(sorted(known))}"
            )
        return cls(**raw)


@dataclass(frozen=True)
class DeviceConfig:
    """Where workers run and which attention backend they use (None: chosen by device)."""

    device: str = "auto"
    attention_backend: str | None = None

    @property
    def resolved(self) -> str:
        """ "auto" means CUDA when this torch build supports it and an NVIDIA device is present; decided
        without importing torch, which costs seconds in processes that never compute (frontend, core)."""
        if self.device != "auto":
            return self.device
        return "cuda" if cuda_present() else "cpu"

    @property
    def resolved_type(self) -> str:
        return self.resolved.split(":")[0]


def _with_draft(
    spec: SpeculativeConfig, target: ModelConfig, tp: int, seed: int, device: DeviceConfig
) -> SpeculativeConfig:
    """Read the draft checkpoint and check it can serve the target (same vocabulary, context)."""
    if tp != 1:
        raise ConfigError("speculative draft_model needs --tensor-parallel-size 1 in this version")
    draft = ModelConfig.from_dir(
        spec.model,
        dtype=target.dtype,
        max_model_len=target.max_model_len,
        seed=seed,
        device=device.resolved_type,
    )
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(
            f"the draft model's vocabulary ({draft.vocab_size}) differs from the target's "
            f"({target.vocab_size}); a draft must share the target's tokenizer"
        )
    return dataclasses.replace(spec, draft=draft)


@dataclass(frozen=True)
class EngineConfig:
    """The root: everything an engine needs, built once."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    # processors beyond the built-ins: installed entry points (found by `create`), then module:Class flags
    logits_processors: tuple[str, ...] = ()
    speculative: SpeculativeConfig | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may ask for

    @classmethod
    def create(
        cls,
        model: str | os.PathLike | None = None,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        quantization: str | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        scheduling_policy: str = "fcfs",
        async_scheduling: bool = True,
        max_num_active_seqs: int | None = None,
        long_prefill_token_threshold: int | None = None,
        max_num_queued_requests: int | None = None,
        max_num_queued_tokens: int | None = None,
        stall_timeout: float = 60.0,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        kv_cache_memory_fraction: float | None = None,
        enable_prefix_caching: bool = True,
        prefix_hash_seed: int | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        data_parallel_rank: int = 0,
        device: str = "auto",
        attention_backend: str | None = None,
        revision: str | None = None,
        load_format: str = "auto",
        socket_dir: str | None = None,
        preload_wait_timeout: float = 0.0,
        logits_processors: tuple[str, ...] | list[str] = (),
        speculative_config: str | dict | None = None,
        weights_file: str | None = None,
        worker_zygote: bool = True,
        request_limits: RequestLimits | Mapping[str, Any] | None = None,
    ) -> EngineConfig:
        """Build and validate the whole tree from flat, CLI-shaped arguments."""
        device_cfg = DeviceConfig(device=device, attention_backend=attention_backend)
        model_cfg = ModelConfig.from_dir(
            model,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            device=device_cfg.resolved_type,
            quantization=quantization,
            revision=revision,
        )
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(2048, min(model_cfg.max_model_len, 8192))
        from coreproc.logits_processors import (
            ProcessorContext,
            engine_specs,
            installed_specs,
            load_processors,
        )

        logits_processors = (*installed_specs(), *logits_processors)  # looked up once, here
        if logits_processors:  # fail fast, in the caller's process, on a processor that cannot load
            ctx = ProcessorContext(model_cfg.vocab_size, model_cfg.max_model_len)
            load_processors(engine_specs(logits_processors), ctx)
        speculative = SpeculativeConfig.parse(speculative_config)
        if speculative is not None:  # verification needs each step's tokens before the next is planned
            async_scheduling = False
        if speculative is not None and speculative.method == "draft_model":
            speculative = _with_draft(speculative, model_cfg, tensor_parallel_size, seed, device_cfg)
        try:
            limits = RequestLimits.of(request_limits).resolve(max_num_seqs, model_cfg.vocab_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if long_prefill_token_threshold is None:  # default: 4% of the context, at least one block
            long_prefill_token_threshold = max(block_size, model_cfg.max_model_len // 25)
        return cls(
            model=model_cfg,
            cache=CacheConfig(
                block_size=block_size,
                num_kv_blocks=num_kv_blocks,
                kv_cache_memory=kv_cache_memory,
                kv_cache_memory_fraction=kv_cache_memory_fraction,
                enable_prefix_caching=enable_prefix_caching,
                prefix_hash_seed=prefix_hash_seed,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                policy=scheduling_policy,
                async_scheduling=async_scheduling,
                max_num_active_seqs=max_num_active_seqs,
                long_prefill_token_threshold=long_prefill_token_threshold,
                max_num_queued_requests=max_num_queued_requests,
                max_num_queued_tokens=max_num_queued_tokens,
                stall_timeout=stall_timeout,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=tensor_parallel_size,
                data_parallel_size=data_parallel_size,
                data_parallel_rank=data_parallel_rank,
            ),
            device=device_cfg,
            load=LoadConfig(load_format, socket_dir, preload_wait_timeout, weights_file, worker_zygote),
            logits_processors=tuple(logits_processors),
            speculative=speculative,
            limits=limits,
        )

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.model.max_model_len // self.cache.block_size)
