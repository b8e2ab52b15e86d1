"""The bundled draft model (coreproc/assets/default_draft) and its training helpers (tools/train_common).

Checks that the committed draft shares the target's tokenizer and special tokens and is smaller, that
the speculative-decoding arithmetic and the acceptance measurement are right on known cases, and that
the training loop lowers the loss of a tiny model on a learnable stream. No corpus is tokenized here.
Run: `pytest -q tests/tools/test_train_draft.py`.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.paths import ASSETS
from tools.train_common import accepted_per_round, fit, greedy_acceptance
from tools.train_default import DRAFT_SHAPE, TOKENIZER_FILES

TOOLS = ASSETS
TARGET, DRAFT = TOOLS / "default_model", TOOLS / "default_draft"


@pytest.mark.unit
def test_draft_shares_the_targets_tokenizer() -> None:
    for name in TOKENIZER_FILES:
        assert (DRAFT / name).read_bytes() == (TARGET / name).read_bytes(), name
    target = json.loads((TARGET / "config.json").read_text())
    draft = json.loads((DRAFT / "config.json").read_text())
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings"):
        assert draft[key] == target[key], key
    assert (draft["hidden_size"], draft["num_hidden_layers"]) == (
        DRAFT_SHAPE["hidden"],
        DRAFT_SHAPE["layers"],
    )
    assert draft["dtype"] == "bfloat16"
    gen = json.loads((DRAFT / "generation_config.json").read_text())
    assert gen["eos_token_id"] == json.loads((TARGET / "generation_config.json").read_text())["eos_token_id"]
    size = (DRAFT / "model.safetensors").stat().st_size
    assert size < (TARGET / "model.safetensors").stat().st_size / 2
    assert "default_model" in (DRAFT / "README.md").read_text()


@pytest.mark.unit
@pytest.mark.parametrize(
    "matches, k, expected",
    [
        ([True] * 10, 4, 10 / 2),  # two full rounds: 4 accepted + 1 target token each
        ([False] * 6, 4, 1.0),  # every round yields only the target's token
        ([True, False, True, True], 1, 4 / 2),  # round 1 takes positions 0-1, round 2 positions 2-3
        ([True, True, False, True, True, True], 2, 6 / 2),
    ],
)
def test_accepted_per_round(matches: list[bool], k: int, expected: float) -> None:
    assert accepted_per_round(matches, k) == pytest.approx(expected)


@pytest.mark.model
def test_a_model_accepts_all_of_its_own_tokens(make_ckpt) -> None:
    ckpt = make_ckpt("llama")
    prompts = [[5, 9, 17, 33, 65], [100, 7, 7, 7]]
    r = greedy_acceptance(ckpt, ckpt, prompts, new_tokens=6, k=4)
    assert (r["prompts"], r["positions"]) == (2, 12)
    assert r["acceptance"] == 1.0 and r["target_self_agreement"] == 1.0
    assert r["tokens_per_step"] == pytest.approx(6.0 / 2)  # 4 accepted + 1, then the last 1


@pytest.mark.model
def test_fit_lowers_the_loss_on_a_learnable_stream() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().train()
    stream = torch.arange(4000) % 7 + 3  # a period-7 cycle: easy to learn
    stats = fit(model, stream, stream[:400], steps=40, batch=4, seq_len=16, lr=1e-2, seed=0, start=0.0)
    assert stats["params"] == sum(p.numel() for p in model.parameters())
    assert stats["val_loss"] < 0.5 * stats["val_loss0"]
