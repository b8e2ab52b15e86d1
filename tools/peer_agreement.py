"""Greedy tokens of Ember and llama.cpp on the same GGUF file: how many prompts agree, and how far.

A repository script (not installed): `python -m tools.peer_agreement FILE.gguf [--prompts 8]
[--max-tokens 32]` starts llama.cpp's `llama-server` (the build `tools/compare_peers` uses) on the
file, sends seeded random token-id prompts one at a time (temperature 0, no BOS added: both engines
get the same ids), runs Ember's offline engine on the same file and prompts, and prints per prompt
the common prefix of the two continuations and, at the end, how many continuations are equal. Greedy
decoding of two engines with different arithmetic (llama.cpp's int8 activations per 32 k against
Ember's per 32 or 256 k) parts at near-ties, so a continuation that agrees for a while and then
differs is expected; one that differs from its first token is not.
"""

from __future__ import annotations

import argparse
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tools.peers.install import llamacpp_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llamacpp_greedy(
    binary: Path, gguf: str, prompts: list[list[int]], max_tokens: int, threads: int
) -> list[list[int]]:
    """llama-server's greedy continuation (token ids) of each prompt."""
    port = free_port()
    cmd = [str(binary), "-m", gguf, "-t", str(threads), "--port", str(port), "-c", "2048", "-np", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        outs = []
        for ids in prompts:
            body = {
                "prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                "return_tokens": True, "ignore_eos": True, "samplers": ["top_k"],
            }  # fmt: skip
            outs.append(list(httpx.post(f"{url}/completion", json=body, timeout=600).json()["tokens"]))
        return outs
    finally:
        proc.terminate()
        proc.wait()


def ember_greedy(gguf: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from coreproc import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    with LLM(gguf, show_progress=False, max_model_len=2048) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.peer_agreement", description=__doc__.splitlines()[0])
    p.add_argument("gguf")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "ember-peers"))
    args = p.parse_args(argv)
    from coreproc.base.gguf_file import GGUFFile

    vocab = int(GGUFFile(args.gguf).hf_config["vocab_size"])
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    # every prefix of 4 or more tokens for one next token: each position's greedy choice (a random
    # model's continuations soon repeat one token, so the prefixes carry the comparison)
    prefixes = [ids[:n] for ids in prompts for n in range(4, len(ids) + 1)]
    binary = llamacpp_server(Path(args.work_dir), True, 2)
    theirs = llamacpp_greedy(binary, args.gguf, prompts + prefixes, args.max_tokens, args.threads)
    ours = ember_greedy(args.gguf, prompts + prefixes, args.max_tokens)
    equal = 0
    for i, (a, b) in enumerate(zip(ours[: len(prompts)], theirs, strict=False)):
        n = common_prefix(a, b)
        equal += n == args.max_tokens
        print(f"prompt {i}: {n} of {args.max_tokens} tokens agree ({len(set(a))} distinct tokens)")
    nexts = sum(a[:1] == b[:1] for a, b in zip(ours[len(prompts) :], theirs[len(prompts) :], strict=True))
    print(f"{equal} of {args.prompts} continuations equal; the next token after each of the prompts' "
          f"{len(prefixes)} prefixes equal on {nexts}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
