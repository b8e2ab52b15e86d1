"""The built-in logits processors: `logit_bias`, `allowed_token_ids`, `bad_words`, `min_tokens`.

They use the same `LogitsProcessor` interface as third-party processors (see
`coreproc/base/logits_processors.py`) but read typed `SamplingParams` fields. Validation runs in the
scheduler process and must not import torch; `apply` runs in the workers on float32 logits.
"""

from __future__ import annotations

from typing import Any

from coreproc.base.errors import InvalidParam
from coreproc.base.logits_processors import LogitsProcessor, Row
from coreproc.base.protocol import SamplingParams

MAX_BIAS = 100.0


def _check_ids(ids: list[int], vocab: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidParam(f"{param}: token id {bad[0]} is outside the vocabulary [0, {vocab})", param)


class LogitBias(LogitsProcessor):
    """OpenAI's `logit_bias`: add a bias in [-100, 100] to chosen token ids."""

    name = "logit_bias"

    def is_active(self, params: SamplingParams) -> bool:
        return bool(params.logit_bias)

    def validate_params(self, params: SamplingParams) -> None:
        bias = params.logit_bias or {}
        _check_ids(list(bias), self.ctx.vocab_size, "logit_bias")
        for tid, value in bias.items():
            if not -MAX_BIAS <= value <= MAX_BIAS:
                raise InvalidParam(
                    f"logit_bias for token {tid} must be in [-100, 100], got {value}", "logit_bias"
                )

    def apply(self, logits: Any, rows: list[Row]) -> Any:
        import torch

        index, ids, values = [], [], []
        for row in rows:
            for tid, value in (row.params.logit_bias or {}).items():  # set: only active rows come here
                index.append(row.index)
                ids.append(tid)
                values.append(value)
        bias = torch.tensor(values, dtype=logits.dtype, device=logits.device)
        logits.index_put_(
            (torch.tensor(index, device=logits.device), torch.tensor(ids, device=logits.device)),
            bias,
            accumulate=True,
        )
        return logits


class AllowedTokenIds(LogitsProcessor):
    """Only these token ids may be sampled."""

    name = "allowed_token_ids"

    def is_active(self, params: SamplingParams) -> bool:
        return params.allowed_token_ids is not None

    def validate_params(self, params: SamplingParams) -> None:
        allowed = params.allowed_token_ids
        if allowed is None:
            return
        if not allowed:
            raise InvalidParam("allowed_token_ids must not be empty", "allowed_token_ids")
        _check_ids(allowed, self.ctx.vocab_size, "allowed_token_ids")

    def apply(self, logits: Any, rows: list[Row]) -> Any:
        import torch

        keep = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
        for j, row in enumerate(rows):
            keep[j, row.params.allowed_token_ids] = True
        index = torch.tensor([row.index for row in rows], device=logits.device)
        logits[index] = logits[index].masked_fill(~keep, float("-inf"))
        return logits


class BadWords(LogitsProcessor):
    """Never complete a banned token sequence: its last token is masked when the text so far ends
    with the rest of it (single-token words are always masked)."""

    name = "bad_words"

    def is_active(self, params: SamplingParams) -> bool:
        return bool(params.bad_words_token_ids)

    def validate_params(self, params: SamplingParams) -> None:
        if params.bad_words and not params.bad_words_token_ids:
            raise InvalidParam(
                "bad_words given as text need a tokenizer: send bad_words_token_ids", "bad_words"
            )
        for seq in params.bad_words_token_ids:
            if not seq:
                raise InvalidParam("bad_words entries must not be empty", "bad_words")
            _check_ids(seq, self.ctx.vocab_size, "bad_words")

    def apply(self, logits: Any, rows: list[Row]) -> Any:
        for row in rows:
            tokens = row.prompt_ids + row.output_ids
            banned = [
                seq[-1]
                for seq in row.params.bad_words_token_ids
                if len(seq) == 1
                or (len(tokens) >= len(seq) - 1 and tokens[len(tokens) - len(seq) + 1 :] == seq[:-1])
            ]
            if banned:
                logits[row.index, banned] = float("-inf")
        return logits


class MinTokens(LogitsProcessor):
    """No EOS (unless `ignore_eos`) and no `stop_token_ids` before `min_tokens` tokens are out."""

    name = "min_tokens"

    def is_active(self, params: SamplingParams) -> bool:
        return params.min_tokens > 0

    def apply(self, logits: Any, rows: list[Row]) -> Any:
        vocab = logits.shape[1]
        for row in rows:
            p = row.params
            if len(row.output_ids) >= p.min_tokens:
                continue
            banned = [t for t in ([] if p.ignore_eos else row.eos_ids) + p.stop_token_ids if t < vocab]
            if banned:
                logits[row.index, banned] = float("-inf")
        return logits
