"""compare_peers runner for Hugging Face `transformers`: batched greedy `generate` on the job's prompts.

Usage: `python run_transformers.py JOB.json`. Loads the checkpoint with `AutoModelForCausalLM`, warms up,
then times one batched `generate` of all batch prompts (left padding, `min_new_tokens = max_new_tokens`
so EOS is ignored) and one of the single prompt. Prints one JSON line prefixed `PEER_RESULT `.
Self-contained: it imports nothing from Ember.
"""

from __future__ import annotations

import json
import sys
import time

from workload import run_workload  # this folder (the script's own)


def main(job_path: str) -> None:
    job = json.loads(open(job_path).read())
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(job["threads"])
    load_start = time.time()
    dtype = "auto" if job["dtype"] == "auto" else getattr(torch, job["dtype"])
    tok = AutoTokenizer.from_pretrained(job["model"])
    device = job.get("device", "cpu")
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=dtype).to(device)
    model.eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ready_at = time.time()

    def generate(prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        if device != "cpu":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        return seconds, int((out.shape[1] - width) * len(prompts))

    run_workload(
        job,
        generate,
        version=f"transformers {transformers.__version__} (torch {torch.__version__})",
        ready_at=ready_at,
        load_s=ready_at - load_start,
        threads=torch.get_num_threads(),
    )


if __name__ == "__main__":
    main(sys.argv[1])
