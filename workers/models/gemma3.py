"""Gemma3ForCausalLM (text): five sliding-window layers to one global, each kind with its own rope base.

Runs in worker processes. Gemma 2's parts (workers/models/gemma2.py: sandwich norms scaling by
1 + weight, `query_pre_attn_scalar`, GeGLU, scaled embeddings, the final soft cap when the config sets
one) with q/k norms per head; `layer_types` says which layers slide, and `rope_parameters` holds one
entry per layer type (local and global bases, the global one possibly scaled).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from workers.models.gemma2 import Gemma2ForCausalLM
from workers.models.parts import DecoderParts, LayerKind


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    @classmethod
    def decoder_parts(cls, cfg: Any) -> DecoderParts:
        gemma2 = super().decoder_parts(cfg)
        layers = tuple(
            LayerKind(kind.window, rope=cfg.layer_types[i]) for i, kind in enumerate(gemma2.layers)
        )
        # the config may name an attention soft cap, which Gemma 3 does not apply (transformers,
        # llama.cpp): the final one only
        return dataclasses.replace(gemma2, layers=layers, qk_norm="head", attn_softcap=0.0)
