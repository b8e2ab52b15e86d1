"""The adapters an engine serves, by name: loaded at start (`--lora-modules`) or at run time.

Runs in the scheduler process. A request names an adapter; `resolve` gives it the registry's
`LoRARef` (name, weight digest, path), so the workers read the folder the core checked and the prefix
cache keys on the weights' identity. Loading a name again replaces its adapter: requests already
admitted keep the reference (and weights) they were admitted with; new ones get the new weights and
none of the old KV. Unloading refuses new requests; running ones finish on the weights they hold.
"""

from __future__ import annotations

from coreproc.base.errors import InvalidParam
from coreproc.base.lora import LoRAAdapter, LoRAConfig, read_adapter
from coreproc.base.protocol import LoRARef


class LoRARegistry:
    """Name -> adapter, within `--max-cpu-loras` names."""

    def __init__(self, config: LoRAConfig) -> None:
        self.config = config
        self.max_loras = config.max_loras
        self.adapters: dict[str, LoRAAdapter] = {}
        for name, path in config.modules():
            self.load(name, path)

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Check and register an adapter (LoRAError for one Ember cannot serve)."""
        if not self.config.enable_lora:
            raise InvalidParam("LoRA is not enabled in this engine (--enable-lora)", "lora")
        adapter = read_adapter(name, path, self.config.max_lora_rank)
        if name not in self.adapters and len(self.adapters) >= self.config.cpu_slots:
            raise InvalidParam(
                f"this engine serves at most {self.config.cpu_slots} adapters (--max-cpu-loras); "
                f"unload one before loading {name!r}",
                "lora",
            )
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise InvalidParam(f"no LoRA adapter named {name!r} is loaded", "lora")

    def resolve(self, ref: LoRARef) -> LoRARef:
        """The registry's reference for a request's adapter (InvalidParam if none such is loaded, or if
        the request asked for weights the name no longer has)."""
        if not self.config.enable_lora:
            raise InvalidParam("LoRA is not enabled in this engine (--enable-lora)", "lora")
        adapter = self.adapters.get(ref.name)
        if adapter is None:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise InvalidParam(f"no LoRA adapter named {ref.name!r} is loaded (loaded: {known})", "lora")
        if ref.identity and ref.identity != adapter.digest:
            raise InvalidParam(f"LoRA adapter {ref.name!r} has been reloaded with other weights", "lora")
        return adapter.ref
