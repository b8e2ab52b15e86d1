"""Train Ember's bundled quickstart model (tools/default_model/) on the local Python standard library.

A ~5M-parameter Llama (GQA, tied embeddings, 8192-token BPE from tools.tokenizer_train) is trained
from scratch with plain AdamW on next-token loss over the stdlib's .py files (code only: comments
and docstrings stripped), holding out every 20th file for validation, then saved in bfloat16 as a
complete Hugging Face folder with a README. Deterministic for a given seed and thread count.
Regenerate with ``python -m tools.train_default``.
"""

from __future__ import annotations

import argparse
import ast
import math
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from tools.make_model import make_config
from tools.tokenizer_train import (
    corpus_files,
    read_text,
    save_hf_tokenizer,
    special_token_ids,
    train_tokenizer,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "default_model"
SHAPE = dict(vocab=8192, hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768, max_pos=2048)
CORPUS_BYTES = 64_000_000  # more than the whole filtered stdlib: take every candidate file
VAL_EVERY = 20  # every 20th file (sorted by path) is held out
SAMPLE_PROMPT = "def fibonacci(n):"


def code_only(source: str) -> str:
    """``source`` without comments and docstrings, re-rendered by ``ast.unparse`` (unparsable: as is).

    A 5M-parameter model trained for minutes learns code much faster than English prose, so the
    default model sees normalised code only.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return source
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    node.body = node.body[1:] or [ast.Pass()]
    return ast.unparse(tree) + "\n"


def token_streams(tok: Tokenizer, eos_id: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Tokenize the corpus as ``<|bos|> code <|endoftext|>`` documents; return (train, val, n_files)."""
    files = corpus_files(CORPUS_BYTES)
    encodings = tok.encode_batch([code_only(read_text(p)) for p in files])
    train: list[int] = []
    val: list[int] = []
    for i, enc in enumerate(encodings):
        (val if i % VAL_EVERY == VAL_EVERY - 1 else train).extend([*enc.ids, eos_id])
    return torch.tensor(train, dtype=torch.long), torch.tensor(val, dtype=torch.long), len(files)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: torch.nn.Module, stream: torch.Tensor, seq_len: int, max_windows: int = 48) -> float:
    """Mean next-token loss over the first ``max_windows`` non-overlapping windows of ``stream``."""
    model.eval()
    n = min(max_windows, len(stream) // seq_len)
    windows = stream[: n * seq_len].view(n, seq_len)
    losses = [float(model(input_ids=w, labels=w).loss) for w in windows.split(8)]
    model.train()
    return sum(losses) / len(losses)


def sample(out_dir: Path, prompt: str, new_tokens: int = 40, temperature: float = 0.0, seed: int = 0) -> str:
    """Reload the saved folder with transformers and continue ``prompt`` (greedy if temperature is 0)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    torch.manual_seed(seed)
    options = (
        dict(do_sample=True, temperature=temperature, top_k=50) if temperature > 0 else dict(do_sample=False)
    )
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, **options)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def write_readme(out: Path, stats: dict, greedy: str, sampled: str) -> None:
    """Describe the model, its training run and two samples in ``out/README.md``."""
    s = stats
    text = f"""# Ember default model

A tiny Llama-architecture model (`LlamaForCausalLM`, {s["params"] / 1e6:.1f}M parameters, bfloat16)
that Ember uses as its quickstart default. It was trained from scratch on the Python
{sys.version_info.major}.{sys.version_info.minor} standard library sources, so it writes Python-looking
text and knows nothing else. It is a smoke-test model, not a useful assistant.

- shape: vocab {SHAPE["vocab"]} (byte-level BPE from `tools/tokenizer_train.py`), hidden
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


def train(out: Path, steps: int, batch: int, seq_len: int, lr: float, seed: int, threads: int) -> dict:
    """Train the default model and save it into ``out``; returns the run statistics."""
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    start = time.time()
    tok = train_tokenizer(SHAPE["vocab"])
    ids = special_token_ids(tok)
    train_ids, val_ids, n_files = token_streams(tok, ids["eos"])
    print(f"corpus: {n_files} files, {len(train_ids):,} train / {len(val_ids):,} val tokens", flush=True)
    shape = {
        k: SHAPE[k] for k in ("vocab", "hidden", "layers", "heads", "kv_heads", "intermediate", "max_pos")
    }
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
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(seed)
    val_loss0 = evaluate(model, val_ids, seq_len)
    print(f"params {params:,}; initial val loss {val_loss0:.3f}", flush=True)
    recent: list[float] = []
    warmup = max(1, min(30, steps // 10))
    for step in range(steps):
        starts = torch.randint(0, len(train_ids) - seq_len, (batch,), generator=gen)
        x = torch.stack([train_ids[s : s + seq_len] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent = (recent + [loss.item()])[-20:]
        if step % 25 == 0 or step == steps - 1:
            rate = (step + 1) * batch * seq_len / (time.time() - start)
            print(f"step {step:4d} loss {recent[-1]:.3f} ({rate:,.0f} tok/s overall)", flush=True)
    val_loss = evaluate(model, val_ids, seq_len)
    train_loss = sum(recent) / len(recent)
    print(f"final train loss {train_loss:.3f}, val loss {val_loss:.3f}", flush=True)

    if out.exists():
        for stale in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
            stale.unlink()
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    eos_ids = [ids["eos"], ids["im_end"]]
    GenerationConfig(bos_token_id=ids["bos"], eos_token_id=eos_ids, pad_token_id=ids["pad"]).save_pretrained(
        out
    )
    save_hf_tokenizer(tok, out, model_max_length=SHAPE["max_pos"])
    wall = time.time() - start
    return dict(
        params=params,
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
        train_loss=train_loss,
        val_loss=val_loss,
        val_loss0=val_loss0,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m tools.train_default``."""
    parser = argparse.ArgumentParser(prog="python -m tools.train_default", description=__doc__)
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})"
    )
    parser.add_argument("--steps", type=int, default=1100)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-readme", action="store_true", help="skip the sample and README.md")
    args = parser.parse_args(argv)
    stats = train(args.out, args.steps, args.batch, args.seq_len, args.lr, args.seed, args.threads)
    if not args.no_readme:
        greedy = sample(args.out, SAMPLE_PROMPT)
        sampled = sample(args.out, SAMPLE_PROMPT, new_tokens=60, temperature=0.7, seed=args.seed)
        print(f"greedy sample:\n{greedy}\n\nsampled (T=0.7):\n{sampled}", flush=True)
        write_readme(args.out, stats, greedy, sampled)
    size = sum(p.stat().st_size for p in args.out.iterdir()) / 1e6
    print(f"wrote {args.out} ({size:.1f} MB) in {(stats['wall_s']) / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
