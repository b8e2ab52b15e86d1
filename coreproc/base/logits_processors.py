"""Custom logits processors: one class per processor, validated at admission, applied batched.

Imported by the scheduler process (to validate each request's arguments when it is admitted, without
torch) and by the workers (to apply them to the logits of the rows that use them). A processor is a
subclass of `LogitsProcessor` with a unique `name`; its per-request arguments travel in
`SamplingParams.logits_processor_args[name]` (built-ins read their own typed fields). Processors come
from three places, in this order: the built-ins (`logit_bias`, `allowed_token_ids`, `bad_words`,
`min_tokens`, in `workers/logits_builtin.py`), the entry-point group `ember.logits_processors`, and
`--logits-processors module:Class`. Entry points are looked up once, when the engine's config is
created (a scan of installed packages takes ~0.1 s), and travel in `EngineConfig.logits_processors`,
so the core and worker processes start without scanning. Raw logprobs reported to callers are taken
before processors run.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any, ClassVar

from coreproc.base.errors import InvalidParam
from coreproc.base.protocol import SamplingParams

ENTRY_POINT_GROUP = "ember.logits_processors"
BUILTIN_SPECS = (
    "workers.logits_builtin:LogitBias",
    "workers.logits_builtin:AllowedTokenIds",
    "workers.logits_builtin:BadWords",
    "workers.logits_builtin:MinTokens",
)


@dataclass(frozen=True)
class ProcessorContext:
    """What a processor may know about the engine it runs in."""

    vocab_size: int
    max_model_len: int
    device: str = "cpu"  # the workers' device ("cpu", "cuda:0"); the scheduler builds with "cpu"


@dataclass
class Row:
    """One row of the logits a processor sees: which request, its settings and tokens so far."""

    index: int  # row in the logits tensor
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # tokens generated before the one being chosen
    eos_ids: list[int]
    req_id: str = ""  # the engine request this row samples for (a request may have several rows)


class LogitsProcessor:
    """Base class. Subclasses set `name` and implement `validate_params`, `is_active`, `apply`."""

    name: ClassVar[str] = ""

    def __init__(self, ctx: ProcessorContext) -> None:
        self.ctx = ctx

    def args(self, params: SamplingParams) -> Any:
        """This processor's per-request arguments (None when the request does not use it)."""
        return params.logits_processor_args.get(self.name)

    def validate_params(self, params: SamplingParams) -> None:
        """Raise `InvalidParam` (or ValueError) if this request's arguments are unusable. Called at
        admission, in the scheduler process, for every request."""

    def is_active(self, params: SamplingParams) -> bool:
        """Whether this request needs this processor (default: it has arguments for it)."""
        return self.args(params) is not None

    def apply(self, logits: Any, rows: list[Row]) -> Any:
        """Change `logits` ([N, vocab] float32 tensor) at `row.index` for each active row; return it."""
        raise NotImplementedError


def _load_class(spec: str) -> type[LogitsProcessor]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"logits processor {spec!r}: expected module:Class")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"logits processor {spec!r} cannot be loaded: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor) and cls.name):
        raise ValueError(f"logits processor {spec!r} is not a LogitsProcessor subclass with a name")
    return cls


def installed_specs() -> tuple[str, ...]:
    """The module:Class of every processor installed under the entry-point group. Reading every
    installed package's entry points takes ~20 ms, so the answer is kept (in `_installed`, which a
    zygote's children inherit) until a directory on sys.path changes (an install or an upgrade)."""
    key = tuple(_modified(path) for path in sys.path)
    if _installed.get("key") != key:
        from importlib import metadata  # ~40 ms, paid only where plugins are looked for

        found = tuple(sorted(ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)))
        _installed.clear()
        _installed.update(key=key, specs=found)
    return _installed["specs"]


_installed: dict[str, tuple] = {}  # "key": sys.path's modification times, "specs": what they held


def _modified(path: str) -> int:
    try:
        return os.stat(path or ".").st_mtime_ns
    except OSError:
        return 0


def processor_specs(extra: tuple[str, ...] = ()) -> list[str]:
    """Every processor to load: built-ins, installed entry points, then `extra` (module:Class)."""
    return engine_specs((*installed_specs(), *extra))


def engine_specs(configured: tuple[str, ...]) -> list[str]:
    """The built-ins, then an engine's configured processors (already resolved by its config)."""
    return [*BUILTIN_SPECS, *configured]


def load_processors(specs: list[str], ctx: ProcessorContext) -> list[LogitsProcessor]:
    """Instantiate processors; a spec that cannot load or a duplicate name is a ValueError."""
    processors: list[LogitsProcessor] = []
    names: set[str] = set()
    for spec in dict.fromkeys(specs):  # the same class listed twice (entry point and flag) loads once
        cls = _load_class(spec)
        if cls.name in names:
            raise ValueError(f"two logits processors are named {cls.name!r} ({spec})")
        names.add(cls.name)
        processors.append(cls(ctx))
    return processors


def validate_request(processors: list[LogitsProcessor], params: SamplingParams) -> None:
    """Admission check: unknown processor names and every processor's own validation."""
    known = {p.name for p in processors}
    unknown = sorted(set(params.logits_processor_args) - known)
    if unknown:
        raise InvalidParam(
            f"unknown logits processor {unknown[0]!r}; this engine has {', '.join(sorted(known))}",
            "logits_processor_args",
        )
    for proc in processors:
        try:
            proc.validate_params(params)
        except InvalidParam:
            raise
        except (ValueError, TypeError, KeyError) as e:
            raise InvalidParam(f"{proc.name}: {e}", f"logits_processor_args.{proc.name}") from None
