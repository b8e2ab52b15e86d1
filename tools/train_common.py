"""Shared pieces of Ember's bundled-model training (tools/train_default.py): data, loop, checks.

The corpus is the local Python standard library's code (comments and docstrings stripped), every
``VAL_EVERY``-th file held out for validation. ``fit`` runs plain AdamW on next-token loss over
random windows of the training stream; ``sample`` and ``greedy_acceptance`` reload saved folders
with transformers to show a continuation and to measure how often a draft model's greedy token
matches a target's (the acceptance rate of greedy speculative decoding). CPU only; no downloads.
"""

from __future__ import annotations

import ast
import math
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from frontend.tokenizer_train import corpus_files, read_text

CORPUS_BYTES = 64_000_000  # more than the whole filtered stdlib: take every candidate file
VAL_EVERY = 20  # every 20th file (sorted by path) is held out


def code_only(source: str) -> str:
    """``source`` without comments and docstrings, re-rendered by ``ast.unparse`` (unparsable: as is).

    A few-million-parameter model trained for minutes learns code much faster than English prose, so
    the bundled models see normalised code only.
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


def validation_texts() -> list[str]:
    """The held-out files' code (as the model saw it), in path order."""
    files = corpus_files(CORPUS_BYTES)
    return [code_only(read_text(p)) for i, p in enumerate(files) if i % VAL_EVERY == VAL_EVERY - 1]


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


def fit(
    model: torch.nn.Module,
    train_ids: torch.Tensor,
    val_ids: torch.Tensor,
    *,
    steps: int,
    batch: int,
    seq_len: int,
    lr: float,
    seed: int,
    start: float,
) -> dict:
    """Train ``model`` in place with AdamW on random windows; returns losses (val before/after, train).

    ``start`` is the run's start time (``time.time()``), used only for the tokens/s progress lines.
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(seed)
    val_loss0 = evaluate(model, val_ids, seq_len)
    params = sum(p.numel() for p in model.parameters())
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
    return dict(params=params, val_loss0=val_loss0, val_loss=val_loss, train_loss=train_loss)


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


def acceptance_prompts(tok: Tokenizer, n: int, prompt_len: int) -> list[list[int]]:
    """``n`` held-out prompts of ``prompt_len`` tokens, cut from the middle of the longest validation files.

    Cut without the BOS token, as the training windows are."""
    encodings = tok.encode_batch(validation_texts(), add_special_tokens=False)
    longest = sorted(range(len(encodings)), key=lambda i: -len(encodings[i].ids))[:n]
    prompts = []
    for i in sorted(longest):
        ids = encodings[i].ids
        mid = max(0, len(ids) // 2 - prompt_len // 2)
        prompts.append(ids[mid : mid + prompt_len])
    return prompts


def accepted_per_round(matches: list[bool], k: int) -> float:
    """Mean tokens a greedy speculative round of ``k`` proposals yields, given per-position matches.

    With greedy verification the draft always continues the target's own prefix, so a round starting
    at position i accepts the leading run of matches from i (at most k) plus one target token.
    """
    i, rounds = 0, 0
    while i < len(matches):
        run = 0
        while run < k and i + run < len(matches) and matches[i + run]:
            run += 1
        i += run + 1
        rounds += 1
    return len(matches) / max(1, rounds)


@torch.no_grad()
def greedy_acceptance(
    target_dir: Path, draft_dir: Path, prompts: list[list[int]], new_tokens: int = 64, k: int = 4
) -> dict:
    """How often the draft's greedy next token equals the target's, along the target's greedy text.

    The target (float32) generates ``new_tokens`` greedy tokens per prompt; one draft forward pass
    over prompt + generation then gives the draft's argmax after each target prefix. Returns the
    match fraction, the agreement of the target's one-pass argmax with its own step-by-step tokens (an
    alignment check: ~1.0) and the mean tokens per target step of greedy speculative decoding with
    ``k`` proposals.
    """
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    matches: list[list[bool]] = []
    self_agree = 0
    for ids in prompts:
        gen: list[int] = []
        for _ in range(new_tokens):  # plain argmax over the whole prefix: no EOS stop, no logits processors
            logits = target(input_ids=torch.tensor([ids + gen]), use_cache=False).logits
            gen.append(int(logits[0, -1].argmax()))
        full = torch.tensor([ids + gen])
        # logits at position p predict token p + 1: the generated span is predicted by [len-1, end-1)
        span = slice(len(ids) - 1, full.shape[1] - 1)
        draft_next = draft(input_ids=full, use_cache=False).logits[0, span].argmax(-1)
        target_next = target(input_ids=full, use_cache=False).logits[0, span].argmax(-1)
        matches.append((draft_next == torch.tensor(gen)).tolist())
        self_agree += int((target_next == torch.tensor(gen)).sum())
    positions = sum(len(m) for m in matches)
    return dict(
        prompts=len(prompts),
        positions=positions,
        acceptance=sum(map(sum, matches)) / positions,
        target_self_agreement=self_agree / positions,
        k=k,
        tokens_per_step=sum(accepted_per_round(m, k) for m in matches) / len(matches),
    )
