"""SmolLM3ForCausalLM: Llama whose every fourth layer has no positional encoding (NoPE).

Runs in worker processes. `no_rope_layers[i]` is 1 where layer i rotates and 0 where it does not;
sliding windows apply only with `use_sliding_window`. Everything else is Llama's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from workers.models.llama import LlamaForCausalLM
from workers.models.parts import DecoderParts, LayerKind


class SmolLM3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_parts(cls, cfg: Any) -> DecoderParts:
        llama = super().decoder_parts(cfg)
        slides = bool(getattr(cfg, "use_sliding_window", False))
        layers = tuple(
            LayerKind(kind.window if slides else None, rope="default" if cfg.no_rope_layers[i] else None)
            for i, kind in enumerate(llama.layers)
        )
        return dataclasses.replace(llama, layers=layers)
