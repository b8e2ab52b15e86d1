"""Train Ember's bundled quickstart model and its draft (coreproc/assets/default_model/, default_draft/).

The target is a ~5M-parameter Llama (GQA, tied embeddings, 8192-token BPE from frontend.tokenizer_train);
the draft (``--draft``) is a ~1.4M-parameter Llama for speculative decoding that reuses the target's
tokenizer files unchanged. Both are trained from scratch with plain AdamW on next-token loss over the
stdlib's code (tools.train_common: same corpus, same validation split), saved in bfloat16 as complete
Hugging Face folders with a README; the draft's README also records its greedy acceptance rate
against the target. Deterministic for a given seed and thread count. Regenerate with
``python -m tools.train_default`` and ``python -m tools.train_default --draft``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from frontend.make_model import make_config
from frontend.tokenizer_train import save_hf_tokenizer, special_token_ids, train_tokenizer
from tools.train_common import VAL_EVERY, acceptance_prompts, fit, greedy_acceptance, sample, token_streams

HERE = Path(__file__).resolve().parent
ASSETS = HERE.parent / "coreproc" / "assets"
DEFAULT_OUT = ASSETS / "default_model"
DRAFT_OUT = ASSETS / "default_draft"
SHAPE = dict(vocab=8192, hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768, max_pos=2048)
DRAFT_SHAPE = dict(vocab=8192, hidden=128, layers=2, heads=2, kv_heads=1, intermediate=384, max_pos=2048)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SAMPLE_PROMPT = "def fibonacci(n):"
# (steps, batch, seq_len, lr) when not given: the target's run, and a ~10-minute single-thread draft run
DEFAULTS = {False: (1100, 4, 256, 3e-3), True: (1400, 4, 256, 3e-3)}


def write_readme(out: Path, stats: dict, greedy: str, sampled: str) -> None:
    """Describe the model, its training run and two samples in ``out/README.md``."""
    s = stats
    text = f"""# Ember default model

A tiny Llama-architecture model (`LlamaForCausalLM`, {s["params"] / 1e6:.1f}M parameters, bfloat16)
that Ember uses as its quickstart default. It was trained from scratch on the Python
{sys.version_info.major}.{sys.version_info.minor} standard library sources, so it writes Python-looking
text and knows nothing else. It is a smoke-test model, not a useful assistant.

- shape: vocab {SHAPE["vocab"]} (byte-level BPE from `frontend/tokenizer_train.py`), hidden
  {SHAPE["hidden"]}, {SHAPE["layers"]} layers, {SHAPE["heads"]} heads / {SHAPE["kv_heads"]} KV heads (GQA),
  intermediate {SHAPE["intermediate"]}, tied embeddings, max positions {SHAPE["max_pos"]}
- data: {s["files"]} stdlib `.py` files (tests, codecs and pydoc data excluded), comments and
  docstrings stripped by an `ast.parse`/`ast.unparse` round trip; every {VAL_EVERY}th file held out:
  {s["train_tokens"]:,} train / {s["val_tokens"]:,} validation tokens
- training: {s["steps"]} AdamW steps of {s["batch"]} x {s["seq_len"]} tokens
  ({s["seen_tokens"]:,} tokens seen), peak lr {s["lr"]}, seed {s["seed"]}, {s["threads"]} CPU thread(s),
  {s["wall_s"] / 60:.1f} min wall time
- loss: train {s["train_loss"]:.3f} (mean of the last 20 steps), validation {s["val_loss"]:.3f}
  (validation before training: {s["val_loss0"]:.3f})

Special tokens: `<|endoftext|>` (EOS and pad), `<|bos|>` (prepended by the tokenizer),
`<|im_start|>` and `<|im_end|>` (ChatML chat template; the model never saw chat data).

Greedy continuation of `{SAMPLE_PROMPT}` (40 new tokens, transformers `generate`):

```python
{greedy}
```

Sampled continuation (temperature 0.7, top-k 50, `torch.manual_seed({s["seed"]})`, 60 new tokens):

```python
{sampled}
```

Regenerate (deterministic for a given seed and thread count):

```
python -m tools.train_default --steps {s["steps"]} --batch {s["batch"]} --seq-len {s["seq_len"]} \\
    --lr {s["lr"]} --seed {s["seed"]} --threads {s["threads"]}
```
"""
    (out / "README.md").write_text(text, encoding="utf-8")


def write_draft_readme(out: Path, target: Path, stats: dict, greedy: str, accept: dict) -> None:
    """Describe the draft, its training run, its acceptance rate and a sample in ``out/README.md``."""
    s, d, a = stats, DRAFT_SHAPE, accept
    text = f"""# Ember default draft model

The draft model for speculative decoding with Ember's bundled default model (`coreproc/assets/default_model`,
the target). A smaller Llama-architecture model (`LlamaForCausalLM`, {s["params"] / 1e6:.2f}M parameters,
bfloat16, {s["size_bytes"] / 1e6:.1f} MB on disk) trained from scratch on the same Python
{sys.version_info.major}.{sys.version_info.minor} standard library code, with the same data pipeline and
validation split as the target. It uses the target's tokenizer unchanged: tokenizer.json,
tokenizer_config.json and special_tokens_map.json are byte-for-byte copies from `{target.name}/`.

- shape: vocab {d["vocab"]} (the target's BPE), hidden {d["hidden"]}, {d["layers"]} layers,
  {d["heads"]} heads / {d["kv_heads"]} KV head (GQA, head dim {d["hidden"] // d["heads"]}),
  intermediate {d["intermediate"]}, tied embeddings, max positions {d["max_pos"]}
- data: {s["files"]} stdlib `.py` files, comments and docstrings stripped; every {VAL_EVERY}th file
  held out: {s["train_tokens"]:,} train / {s["val_tokens"]:,} validation tokens
- training: {s["steps"]} AdamW steps of {s["batch"]} x {s["seq_len"]} tokens
  ({s["seen_tokens"]:,} tokens seen), peak lr {s["lr"]}, seed {s["seed"]}, {s["threads"]} CPU thread(s),
  {s["wall_s"] / 60:.1f} min wall time
- loss: train {s["train_loss"]:.3f} (mean of the last 20 steps), validation {s["val_loss"]:.3f}
  (validation before training: {s["val_loss0"]:.3f})
- greedy acceptance against the target: {100 * a["acceptance"]:.1f}% over {a["positions"]} positions
  ({a["prompts"]} held-out prompts cut from validation files, {a["positions"] // a["prompts"]} greedy
  float32 target tokens each; the draft's argmax after each target prefix equals the target's token).
  Greedy speculative decoding with {a["k"]} proposals would yield {a["tokens_per_step"]:.2f} tokens
  per target step. (Target self-agreement on the same check: {100 * a["target_self_agreement"]:.1f}%.)

Greedy continuation of `{SAMPLE_PROMPT}` (40 new tokens, transformers `generate`):

```python
{greedy}
```

Regenerate (deterministic for a given seed and thread count; reads the target's tokenizer):

```
python -m tools.train_default --draft --steps {s["steps"]} --batch {s["batch"]} --seq-len {s["seq_len"]} \\
    --lr {s["lr"]} --seed {s["seed"]} --threads {s["threads"]}
```
"""
    (out / "README.md").write_text(text, encoding="utf-8")


def train(
    out: Path,
    steps: int,
    batch: int,
    seq_len: int,
    lr: float,
    seed: int,
    threads: int,
    draft_of: Path | None = None,
) -> dict:
    """Train the default model (or with ``draft_of`` a draft for that target) into ``out``; return stats."""
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    start = time.time()
    shape = DRAFT_SHAPE if draft_of is not None else SHAPE
    if draft_of is None:
        tok = train_tokenizer(shape["vocab"])
    else:
        tok = Tokenizer.from_file(str(draft_of / "tokenizer.json"))
        if tok.get_vocab_size() != shape["vocab"]:
            raise ValueError(
                f"{draft_of} has a {tok.get_vocab_size()}-token vocabulary, not {shape['vocab']}"
            )
    ids = special_token_ids(tok)
    train_ids, val_ids, n_files = token_streams(tok, ids["eos"])
    print(f"corpus: {n_files} files, {len(train_ids):,} train / {len(val_ids):,} val tokens", flush=True)
    config = make_config(
        "llama",
        **shape,
        head_dim=None,
        tie=True,
        dtype="bfloat16",
        token_ids=ids,
        rope_parameters=None,
        sliding_window=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().train()
    losses = fit(
        model, train_ids, val_ids, steps=steps, batch=batch, seq_len=seq_len, lr=lr, seed=seed, start=start
    )

    if out.exists():
        for stale in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
            stale.unlink()
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    eos_ids = [ids["eos"], ids["im_end"]]
    GenerationConfig(bos_token_id=ids["bos"], eos_token_id=eos_ids, pad_token_id=ids["pad"]).save_pretrained(
        out
    )
    if draft_of is None:
        save_hf_tokenizer(tok, out, model_max_length=shape["max_pos"])
    else:
        for name in TOKENIZER_FILES:
            shutil.copyfile(draft_of / name, out / name)
    wall = time.time() - start
    return dict(
        **losses,
        files=n_files,
        train_tokens=len(train_ids),
        val_tokens=len(val_ids),
        steps=steps,
        batch=batch,
        seq_len=seq_len,
        seen_tokens=steps * batch * seq_len,
        lr=lr,
        seed=seed,
        threads=threads,
        wall_s=wall,
        size_bytes=sum(p.stat().st_size for p in out.glob("*.safetensors")),
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m tools.train_default``."""
    parser = argparse.ArgumentParser(prog="python -m tools.train_default", description=__doc__)
    parser.add_argument(
        "--draft", action="store_true", help="train the draft model for --target (default out: default_draft)"
    )
    parser.add_argument("--target", type=Path, default=DEFAULT_OUT, help="the draft's target folder")
    parser.add_argument("--out", type=Path, default=None, help=f"output folder (default {DEFAULT_OUT.name})")
    parser.add_argument("--steps", type=int, default=None, help="default 1100 (draft: 1400)")
    parser.add_argument("--batch", type=int, default=None, help="default 4")
    parser.add_argument("--seq-len", type=int, default=None, help="default 256")
    parser.add_argument("--lr", type=float, default=None, help="default 3e-3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--accept-prompts", type=int, default=20, help="draft: held-out prompts to check")
    parser.add_argument("--accept-tokens", type=int, default=64, help="draft: greedy tokens per prompt")
    parser.add_argument("--no-readme", action="store_true", help="skip the samples, checks and README.md")
    args = parser.parse_args(argv)
    out = args.out or (DRAFT_OUT if args.draft else DEFAULT_OUT)
    given = (args.steps, args.batch, args.seq_len, args.lr)
    steps, batch, seq_len, lr = (g if g is not None else d for g, d in zip(given, DEFAULTS[args.draft]))
    target = args.target if args.draft else None
    stats = train(out, steps, batch, seq_len, lr, args.seed, args.threads, draft_of=target)
    if not args.no_readme:
        greedy = sample(out, SAMPLE_PROMPT)
        print(f"greedy sample:\n{greedy}\n", flush=True)
        if target is not None:
            prompts = acceptance_prompts(
                Tokenizer.from_file(str(target / "tokenizer.json")), args.accept_prompts, 96
            )
            accept = greedy_acceptance(target, out, prompts, new_tokens=args.accept_tokens)
            print(f"greedy acceptance vs {target.name}: {accept}", flush=True)
            write_draft_readme(out, target, stats, greedy, accept)
        else:
            sampled = sample(out, SAMPLE_PROMPT, new_tokens=60, temperature=0.7, seed=args.seed)
            print(f"sampled (T=0.7):\n{sampled}", flush=True)
            write_readme(out, stats, greedy, sampled)
    size = sum(p.stat().st_size for p in out.iterdir()) / 1e6
    print(f"wrote {out} ({size:.1f} MB) in {(stats['wall_s']) / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
