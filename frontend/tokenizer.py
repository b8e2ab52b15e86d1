"""Loads a checkpoint's tokenizer and the ids that end generation.

Runs in the frontend (and the offline API's process). Uses transformers' fast tokenizer from the
local folder only (never a hub). EOS ids are the union of the tokenizer's EOS token and
generation_config.json's `eos_token_id` (an int or a list), as Hugging Face `generate()` uses them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tokenizer(path: str) -> Any:
    """The fast tokenizer stored in a local checkpoint folder."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {path}: {e}") from None


def eos_token_ids(model_dir: str, tokenizer: Any) -> list[int]:
    """Ids that stop generation unless `ignore_eos` is set."""
    ids: list[int] = []
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ids.extend(value if isinstance(value, list) else [] if value is None else [value])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
