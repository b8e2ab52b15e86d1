"""LoRA adapters: the `lora` settings, and what a PEFT adapter folder says, checked before any weight moves.

Part of the shared base (the scheduler process registers adapters, the workers load their weights,
the frontend names them). A PEFT LoRA folder holds `adapter_config.json` and `adapter_model.safetensors`
(tensors `base_model.model.model.layers.N.{self_attn,mlp}.X.lora_{A,B}.weight`). `read_adapter` reads
the config and the safetensors header (no tensors, no torch) and refuses, in one line, what Ember does
not serve: DoRA, biases, per-module ranks or alphas, modules saved whole (embeddings, heads), targets
other than the q/k/v/o/gate/up/down projections, a rank above `--max-lora-rank`. An adapter's identity
is the sha256 of its weight file: the prefix cache keys on ("lora", name, digest), so reloading other
weights under a name never reuses the old KV.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coreproc.base.errors import ConfigError, EmberError
from coreproc.base.options import at_least, option
from coreproc.base.protocol import LoRARef

# the projections an adapter may target, and the Ember layer (and segment) each one lands in; ALL: a
# projection fused in the checkpoint (Phi-3's), whose adapter covers every segment of the layer
ALL = -1
TARGETS: dict[str, tuple[str, int]] = {
    "qkv_proj": ("self_attn.qkv_proj", ALL),
    "gate_up_proj": ("mlp.gate_up_proj", ALL),
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


class LoRAError(EmberError, ValueError):
    """An adapter Ember cannot serve (or cannot find); the message names it and why."""


@dataclass(frozen=True)
class LoRAConfig:
    """Serving LoRA adapters of the base model."""

    enable_lora: bool = option("serve LoRA adapters (PEFT folders) on top of the model", False)
    lora_modules: tuple[str, ...] = option("adapters to load at start", (), metavar="NAME=PATH")
    max_loras: int = option("most adapters one step may mix (device slots)", 4)
    max_lora_rank: int = option("largest adapter rank accepted", 16)
    max_cpu_loras: int | None = option(
        "adapters each worker keeps in host memory (default: twice --max-loras)", None
    )

    def __post_init__(self) -> None:
        at_least(self, 1, "max_loras", "max_lora_rank")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError.bad(
                "max_cpu_loras",
                f"must be at least max_loras={self.max_loras}, got {self.max_cpu_loras}",
                also=("max_loras",),
            )
        if self.lora_modules and not self.enable_lora:
            raise ConfigError.bad("lora_modules", "needs enable_lora", also=("enable_lora",))
        for spec in self.lora_modules:
            name, eq, path = spec.partition("=")
            if not (eq and name and path):
                raise ConfigError.bad("lora_modules", f"takes NAME=PATH, got {spec!r}")

    @property
    def cpu_slots(self) -> int:
        return self.max_cpu_loras or 2 * self.max_loras

    def modules(self) -> list[tuple[str, str]]:
        """The (name, path) pairs of `--lora-modules`."""
        return [(s.partition("=")[0], s.partition("=")[2]) for s in self.lora_modules]


@dataclass(frozen=True)
class LoRAAdapter:
    """A checked adapter: where it is, its shape, and its identity."""

    name: str
    path: str
    rank: int
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...]  # the PEFT module names it carries weights for (q_proj, ...)
    digest: str  # sha256 of adapter_model.safetensors

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def ref(self) -> LoRARef:
        return LoRARef(self.name, self.digest, self.path)


def read_adapter(name: str, path: str | Path, max_rank: int) -> LoRAAdapter:
    """Check a PEFT LoRA folder (LoRAError, one line, for what cannot be served)."""
    folder = Path(path)
    where = f"LoRA adapter {name!r} ({folder})"
    if not (folder / CONFIG_FILE).is_file():
        raise LoRAError(f"{where}: no {CONFIG_FILE} (is it a PEFT adapter folder?)")
    if not (folder / WEIGHTS_FILE).is_file():
        raise LoRAError(f"{where}: no {WEIGHTS_FILE}")
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"{where}: unreadable {CONFIG_FILE}: {e}") from None
    _check_config(cfg, where, max_rank)
    data = (folder / WEIGHTS_FILE).read_bytes()
    targets: set[str] = set()
    for tensor, shape in _header(data, where).items():
        match = TENSOR_NAME.match(tensor)
        if match is None or match.group(2) not in TARGETS:
            raise LoRAError(
                f"{where}: tensor {tensor} is not a LoRA weight of a q/k/v/o/gate/up/down projection "
                "(embeddings, heads and other modules are not supported)"
            )
        rank_dim = shape[0] if match.group(3) == "A" else shape[-1]
        if rank_dim != cfg["r"]:
            raise LoRAError(f"{where}: tensor {tensor} has rank {rank_dim}, the config says {cfg['r']}")
        targets.add(match.group(2))
    if not targets:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoRAAdapter(
        name=name,
        path=str(folder.resolve()),
        rank=int(cfg["r"]),
        alpha=float(cfg.get("lora_alpha") or cfg["r"]),
        use_rslora=bool(cfg.get("use_rslora")),
        targets=tuple(sorted(targets)),
        digest=hashlib.sha256(data).hexdigest(),
    )


def _check_config(cfg: Any, where: str, max_rank: int) -> None:
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{where}: not a LoRA adapter (peft_type {cfg.get('peft_type')!r})")
    unsupported = {
        "use_dora": "DoRA adapters",
        "modules_to_save": "adapters that save whole modules (modules_to_save)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "lora_bias": "LoRA biases",
        "layer_replication": "layer replication",
        "trainable_token_indices": "trainable token embeddings",
    }
    for key, what in unsupported.items():
        if cfg.get(key):
            raise LoRAError(f"{where}: {what} are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"{where}: adapters that train biases (bias={cfg['bias']!r}) are not supported")
    if cfg.get("fan_in_fan_out"):
        raise LoRAError(f"{where}: fan_in_fan_out adapters are not supported")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"{where}: its config gives no positive rank r")
    if rank > max_rank:
        raise LoRAError(f"{where}: rank {rank} exceeds --max-lora-rank {max_rank}")


def _header(data: bytes, where: str) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors file's header."""
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
        return {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (struct.error, ValueError, KeyError, TypeError, AttributeError):
        raise LoRAError(f"{where}: {WEIGHTS_FILE} is not a safetensors file") from None
