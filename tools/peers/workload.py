"""The timed part every compare_peers runner shares: warm up, time the batch, time one prompt alone.

Imported by the runner scripts from their own folder (each runs under its peer's Python, so this file
imports nothing beyond the standard library). `generate(prompts, new_tokens)` is the peer's batched
greedy call returning (seconds, output tokens); the result is printed as one `PEER_RESULT ` JSON line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

Generate = Callable[[list[list[int]], int], tuple[float, int]]


def run_workload(job: dict[str, Any], generate: Generate, **fields: Any) -> None:
    """Warm-up (4 new tokens), then the batch and the single prompt; prints the result line with
    `fields` (version, ready_at, load_s, threads, ...) added."""
    generate(job["warmup_prompts"], 4)
    out_len = job["output_len"]
    batch_s, batch_tokens = generate(job["batch_prompts"], out_len)
    single_s, single_tokens = generate([job["single_prompt"]], out_len)
    result = {
        **fields,
        "batch_seconds": batch_s,
        "batch_output_tokens": batch_tokens,
        "single_seconds": single_s,
        "single_output_tokens": single_tokens,
        "pid": os.getpid(),
    }
    print("PEER_RESULT " + json.dumps(result), flush=True)
