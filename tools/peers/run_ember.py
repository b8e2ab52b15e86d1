"""compare_peers runner for Ember itself, through its offline API (`coreproc.LLM`) in this process.

Usage: `python -m tools.peers.run_ember JOB.json` from the repository root. Starts as Ember's own engine
process does (`coreproc.base.boot`: no garbage collection from the first import until the engine is
up, then `settle()`), builds the engine (on the job's GGUF file when it names one), times its first
request's first token, warms up, times one
`generate` of all batch prompts, one streamed single request and one long prompt's prefill (the timing
functions of `ember bench throughput` / `ember bench latency`), and prints one JSON line prefixed
`PEER_RESULT `.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path


def ember_version() -> str:
    try:
        version = metadata.version("ember-serve")
    except metadata.PackageNotFoundError:
        version = "?"
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    return f"ember-serve {version}" + (f" ({commit})" if commit else "")


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    gc.disable()
    import torch

    torch.set_num_threads(job["threads"])
    from coreproc.base import boot
    from coreproc.base.config import EngineConfig
    from coreproc.base.protocol import SamplingParams
    from coreproc.client.llm import LLM
    from frontend.bench.latency import time_request

    params = SamplingParams(temperature=0.0, max_tokens=job["output_len"], ignore_eos=True)
    load_start = time.time()
    model = job.get("gguf") or job["model"]
    config = EngineConfig.create(
        model, dtype=job["dtype"], max_model_len=job["max_model_len"], device=job.get("device", "cpu")
    )
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    with LLM(config=config, show_progress=False) as llm:
        ready_at = time.time()
        boot.settle()
        device = llm.engine.executor.ready[0].device
        first = time_request(llm, job["warmup_prompts"][0], one, device)
        llm.generate(job["warmup_prompts"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(job["batch_prompts"], params, use_tqdm=False)
        batch_s = time.perf_counter() - start
        single = time_request(llm, job["single_prompt"], params, device)
        prefill = time_request(llm, job["prefill_prompt"], one, device)
    result = {
        "version": ember_version(),
        "ready_at": ready_at,
        "load_s": ready_at - load_start,
        "batch_seconds": batch_s,
        "batch_output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "single_seconds": single.latency_s,
        "single_output_tokens": single.output_tokens,
        "single_decode_tps": single.decode_tps,
        "prefill_tps": len(job["prefill_prompt"]) / prefill.ttft_s,
        "first_token_after_ready_s": first.ttft_s,
        "threads": torch.get_num_threads(),
        "device": device,
        "pid": os.getpid(),
    }
    print("PEER_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
