"""Incremental detokenization with stop strings, one instance per generated sequence.

Runs in the HTTP frontend, batch mode and the offline API's process. Text is produced with tokenizers'
DecodeStream, which holds back bytes until they form whole UTF-8 characters, so no delta ever carries a
broken character. Stop strings are searched only in the newly added text plus a look-back window; while
a sequence runs, the last `len(longest stop) - 1` characters are held back so that a stop string split
across deltas is never streamed before it is recognised.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from coreproc.base.protocol import SamplingParams

# prompt tokens fed to the stream first, so the first generated token decodes in context
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Accumulates the text of one sequence and reports a matched stop string."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: SamplingParams) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(
            ids=list(prompt_ids[-_CONTEXT_TOKENS:]), skip_special_tokens=params.skip_special_tokens
        )
        self.stops = list(params.stop)
        self.include_stop = params.include_stop_str_in_output
        self._max_stop = max((len(s) for s in self.stops), default=0)
        self._hold = self._max_stop - 1 if self.stops and not self.include_stop else 0
        self.text = ""
        self._sent = 0

    def update(self, token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now appears (the text is then truncated, and
        `tokens_used` says how many of `token_ids` it took: tokens after the stop do not count)."""
        self.tokens_used = len(token_ids)
        for i, token in enumerate(token_ids):
            piece = self._stream.step(self._backend, token)
            if not piece:
                continue
            self.text += piece
            if self.stops:
                hit = self._find_stop(len(piece))
                if hit is not None:
                    self.tokens_used = i + 1
                    return hit
        return None

    def _find_stop(self, new_chars: int) -> str | None:
        start = max(0, len(self.text) - new_chars - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = self.text.find(stop, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop)] if self.include_stop else self.text[:at]
        return stop

    def delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, the possible start of a stop string is held back."""
        end = len(self.text) if finished else max(self._sent, len(self.text) - self._hold)
        out = self.text[self._sent : end]
        self._sent = end
        return out
