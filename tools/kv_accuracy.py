"""Accuracy of the fp8 KV cache at long context: teacher-forced agreement with transformers.

Usage: `python -m tools.kv_accuracy [--models smollm2,qwen-0.5b] [--context 4096] [--window 1024]
[--weights bf16,gguf]`.
Per real model (tools/real_models.py): one text of `--context` tokens (the source of Python's
`argparse` module: real code, the same on every machine with this Python), transformers' float32
next-token distributions at its last `--window` positions, and Ember's over a bf16 and an fp8 KV
cache, for the converted folder in bf16 and for the GGUF file's own bits on the native CPU path:
top-1 agreement with float32's argmax and mean KL(float32 || Ember). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import inspect
import sys

import torch
import torch.nn.functional as F

from tools.real_models import prepare
from tools.teacher_forced import load, prefill_hidden
from workers.kv_scales import kv_cache_dtype

CHUNK = 256  # positions per logits chunk (a 152k vocabulary in float32 is 0.6 MB a position)


def text_ids(hf_dir: str, context: int) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(hf_dir)(inspect.getsource(argparse)).input_ids
    if len(ids) < context:
        sys.exit(f"kv_accuracy: the text has {len(ids)} tokens, fewer than --context {context}")
    return ids[:context]


def window_logprobs(head, hidden: torch.Tensor, window: int) -> list[torch.Tensor]:
    """log-softmax of the next-token logits at the last `window` positions but the final one, by chunk."""
    rows = hidden[-window - 1 : -1]
    return [torch.log_softmax(head(rows[i : i + CHUNK]).float(), -1) for i in range(0, window, CHUNK)]


def reference(hf_dir: str, ids: list[int], window: int) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
        return window_logprobs(model.lm_head, hidden, window)


def compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> tuple[float, float]:
    agree = torch.cat([(g.argmax(-1) == r.argmax(-1)).float() for g, r in zip(got, ref)]).mean().item()
    kl = torch.cat([F.kl_div(g, r, log_target=True, reduction="none").sum(-1) for g, r in zip(got, ref)])
    return agree, kl.mean().item()


def model_rows(name: str, context: int, window: int, weights_kinds: list[str]) -> list[str]:
    paths = prepare(name)
    ids = text_ids(str(paths["hf-v5"]), context)
    ref = reference(str(paths["hf-v5"]), ids, window)
    rows = []
    variants = {"bf16": (paths["hf-v5"], "torch"), "gguf": (paths["gguf"], "cpu_bf16")}
    for weights in weights_kinds:
        path, kernel = variants[weights]
        model = load(str(path), None, torch.bfloat16, context + 1, kernel)
        for kv in ("auto", "fp8"):
            hidden = prefill_hidden(model, [ids], kv_dtype=kv_cache_dtype(kv, torch.bfloat16))
            with torch.inference_mode():
                got = window_logprobs(model.compute_logits, hidden, window)
            agree, kl = compare(ref, got)
            label = "bf16" if kv == "auto" else "fp8 e4m3"
            shown = "bf16" if weights == "bf16" else "GGUF bits"
            rows.append(f"| {name} | {shown} | {label} | {agree:.3f} | {kl:.2e} |")
            print(rows[-1], file=sys.stderr, flush=True)
        del model
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2,qwen-0.5b")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--window", type=int, default=1024, help="positions scored, at the end of the context")
    p.add_argument("--weights", default="bf16,gguf", help="bf16 (converted folder), gguf (own bits)")
    args = p.parse_args(argv)
    if not 0 < args.window < args.context:
        p.error("--window must be between 1 and --context - 1")
    kinds = args.weights.split(",")
    if not kinds or set(kinds) - {"bf16", "gguf"}:
        p.error("--weights takes bf16 and/or gguf")
    lines = [
        f"teacher-forced over the last {args.window} of {args.context} tokens, against transformers float32",
        "",
        "| model | weights | KV cache | top-1 | mean KL |",
        "|---|---|---|---|---|",
    ]
    for name in args.models.split(","):
        lines += model_rows(name, args.context, args.window, kinds)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
