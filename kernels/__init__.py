"""Attention kernels of Ember: paged KV-cache write, decode and prefill attention.

Each op has a pure-torch reference (CPU, tests) and a Triton version (CUDA; CPU via
TRITON_INTERPRET=1). Model code only needs `select_backend` and `AttentionMetadata`; the ops
live in kv_write.py, decode_attention.py and prefill_attention.py.
"""

from __future__ import annotations

from kernels.backend import AttentionBackend, select_backend
from kernels.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "select_backend"]
