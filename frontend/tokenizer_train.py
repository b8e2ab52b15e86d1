"""Train a small deterministic byte-level BPE tokenizer on the local Python standard library.

Nothing is downloaded: the corpus is a fixed, seeded sample of the stdlib's own ``.py`` sources.
``train_tokenizer`` returns a ``tokenizers.Tokenizer`` (cached per vocab size and seed) and
``save_hf_tokenizer`` writes the Hugging Face files (tokenizer.json, tokenizer_config.json with a
ChatML chat template, special_tokens_map.json) that ``AutoTokenizer.from_pretrained`` loads offline.
"""

from __future__ import annotations

import functools
import json
import random
import sysconfig
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|bos|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: <|endoftext|>=0, <|bos|>=1, <|im_start|>=2, <|im_end|>=3.
SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN, IM_START, IM_END)
TOKENIZER_MIN_CORPUS_BYTES = 3_000_000
TOKENIZER_BYTES_PER_TOKEN = 320  # enough text for a 32k vocab to fill up
# Split pattern of the Qwen2 family. transformers rebuilds any model_type="qwen2" tokenizer with
# NFC + this split + ByteLevel(use_regex=False) whatever tokenizer.json says, so every checkpoint
# uses exactly that pipeline and all loaders (tokenizers, AutoTokenizer for any arch) agree.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "encodings", "pydoc_data", "__pycache__"}
)

# ChatML; the BOS token leads the rendered prompt because apply_chat_template tokenizes with
# add_special_tokens=False, so the rendered text must carry it itself (as Llama-3 templates do).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def stdlib_root() -> Path:
    """The directory holding this interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _candidate_files(root: Path) -> list[Path]:
    files = [p for p in root.rglob("*.py") if not _EXCLUDED_DIRS & set(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def corpus_files(max_bytes: int, seed: int = 0) -> list[Path]:
    """A fixed sample of stdlib ``.py`` files totalling at most ``max_bytes``, sorted by path.

    The candidates (tests, codec tables and generated docs excluded) are sorted, shuffled with a
    seeded RNG so the sample spans the whole library, and taken as a prefix until the budget is
    spent; a larger budget therefore always yields a superset of a smaller one.
    """
    root = stdlib_root()
    order = _candidate_files(root)
    random.Random(seed).shuffle(order)
    chosen: list[Path] = []
    total = 0
    for path in order:
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    return sorted(chosen, key=lambda p: p.relative_to(root).as_posix())


def read_text(path: Path) -> str:
    """Read a source file as UTF-8, replacing undecodable bytes so every run sees the same text."""
    return path.read_bytes().decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=8)
def train_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    """Train (once per process and arguments) a byte-level BPE with ``vocab_size`` entries.

    The four special tokens take ids 0-3 and a template post-processor prepends ``<|bos|>``.
    tokenizer.json is byte-identical across runs, processes and rayon thread counts (checked for
    1-16 threads; tests/frontend/test_make_model.py re-checks a second training in-process).
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS) + 1}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    budget = max(TOKENIZER_MIN_CORPUS_BYTES, TOKENIZER_BYTES_PER_TOKEN * vocab_size)
    texts = [read_text(p) for p in corpus_files(budget, seed)]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """Ids of the special tokens, keyed by role: bos, eos, pad, im_start, im_end."""
    ids = {
        "bos": tok.token_to_id(BOS_TOKEN),
        "eos": tok.token_to_id(EOS_TOKEN),
        "pad": tok.token_to_id(EOS_TOKEN),
        "im_start": tok.token_to_id(IM_START),
        "im_end": tok.token_to_id(IM_END),
    }
    missing = [k for k, v in ids.items() if v is None]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens: {missing}")
    return ids


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def save_hf_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    specials = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": EOS_TOKEN,
    }
    config = {
        **specials,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(model_max_length),
        "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(
        out / "special_tokens_map.json", {**specials, "additional_special_tokens": [IM_START, IM_END]}
    )
