"""The KV memory one long request holds, with sliding-window layers giving their blocks back and without.

A repository tool (runs on its own, no weights loaded): the model's layer kinds come from its
config.json through its Ember class's parts, its KV groups from coreproc/base/kv_layout.py, and the
blocks from the scheduler's own KV manager while a request of `--tokens` prompt tokens is prefilled
in chunks and decodes `--decode` more (the workers' part played by a stub that samples a token).

    python -m tools.kv_footprint CHECKPOINT [--tokens 32768] [--block-size 16] [--dtype bfloat16]

Prints, per layout, the most bytes the request held (during its prefill chunks) and while it decodes,
and their ratios.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from coreproc.base.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from coreproc.base.kv_layout import KVLayout, plan_layout
from coreproc.base.protocol import EngineRequest, RunnerOutput, SamplingParams, TokenLogprobs
from coreproc.core.scheduler import Scheduler
from workers.loader import read_hf_config
from workers.models import resolve


def engine_config(model: str, hf: Any, max_model_len: int, block_size: int, budget: int) -> EngineConfig:
    """What the scheduler needs of the checkpoint (its config.json alone: no weights are read)."""
    heads = hf.num_attention_heads
    spec = ModelConfig(
        model=model,
        architecture=hf.architectures[0],
        max_model_len=max_model_len,
        vocab_size=hf.vocab_size,
        num_layers=hf.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        hidden_size=hf.hidden_size,
        tokenizer=model,
    )
    return EngineConfig(
        model=spec,
        cache=CacheConfig(block_size=block_size),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, long_prefill_token_threshold=0),
    )


def held_bytes(
    config: EngineConfig, layout: KVLayout, tokens: int, decode: int, layer_bytes: int
) -> tuple[int, int]:
    """The most KV bytes the request holds at once under `layout` (a block: `slots` layers' pages),
    and what it holds while it decodes."""
    max_blocks = -(-(tokens + decode) // config.cache.block_size) * len(layout.groups) + 1
    sched = Scheduler(config, max_blocks, layout)
    params = SamplingParams(max_tokens=decode, min_tokens=decode, ignore_eos=True)
    sched.add_request(EngineRequest(request_id="r", prompt_token_ids=[7] * tokens, sampling_params=params))
    most = decoding = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        req = sched.requests["r"]
        most = max(most, sum(sched.kv.held_blocks(req)))
        if req.num_output_tokens > 0:
            decoding = max(decoding, sum(sched.kv.held_blocks(req)))
        done = req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders - 1
        sampled = [[7]] if done and req.num_output_placeholders else [[]]
        lps = [[TokenLogprobs([7], [0.0], 1)]] if sampled[0] else [[]]
        sched.update_from_output(out, RunnerOutput(req_ids=["r"], sampled_token_ids=sampled, logprobs=lps))
    return most * layout.slots * layer_bytes, decoding * layout.slots * layer_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--budget", type=int, default=2048, help="tokens per step (prefill chunks)")
    args = parser.parse_args()
    hf = read_hf_config(args.model)
    config = engine_config(args.model, hf, args.tokens + args.decode, args.block_size, args.budget)
    parts = resolve(config.model.architecture).decoder_parts(hf)
    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    layer_bytes = 2 * config.model.num_kv_heads * config.model.head_dim * args.block_size * itemsize
    layouts = {
        "windows give blocks back": plan_layout([k.window for k in parts.layers], config.model.max_model_len),
        "every block kept": KVLayout.full(len(parts.layers)),
    }
    held = {
        name: held_bytes(config, lay, args.tokens, args.decode, layer_bytes) for name, lay in layouts.items()
    }
    for name, lay in layouts.items():
        most, decoding = (b / 2**20 for b in held[name])
        print(f"{name:>26}: {len(lay.groups)} groups, {most:8.1f} MiB at most, {decoding:8.1f} MiB decoding")
    freed, kept = held["windows give blocks back"], held["every block kept"]
    print(f"ratio: {freed[0] / kept[0]:.3f} at most, {freed[1] / kept[1]:.3f} decoding")


if __name__ == "__main__":
    main()
