"""Structured outputs in the worker: one xgrammar matcher per constrained request, one mask per step.

Runs in each worker process (in-process for the offline engine), inside the sampler. A request whose
`SamplingParams.structured` is set (a `StructuredSpec`: JSON schema, json_object, regex, choice,
EBNF grammar or structural tag) gets a matcher the first time it samples; its grammar is compiled
against the checkpoint's tokenizer (loaded with xgrammar on first use, once) and cached by spec.
Every step each constrained row's matcher is brought to that row's output (new tokens accepted,
rejected speculative tokens rolled back), fills its row of one bitmask, and a single masked fill
applies it; rows without a grammar are untouched. A spec xgrammar refuses fails only its own
request: `pop_failed()` names it, and the runner reports it in `RunnerOutput.failed`.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from coreproc.base.logits_processors import Row
from coreproc.base.protocol import StructuredSpec

log = logging.getLogger("ember.worker")

_SOURCE = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
MAX_WHITESPACE = 16  # consecutive JSON whitespace characters a constrained output may write
_BOUNDED_CHARS = r"[^\"\\\r\n]"  # a bounded string's characters, as xgrammar prints them
_JSON_CHARS = r"[^\0-\x1f\"\\]"  # what JSON allows unescaped: no control character, quote, backslash


@dataclass
class _Constraint:
    """One request's grammar state: the output tokens its matcher has accepted so far."""

    matcher: Any
    after: list[int]
    start: int | None = None  # output index where the constraint begins (None: `after` not seen yet)
    accepted: list[int] = field(default_factory=list)


def vocab_type(backend: Any) -> tuple[str, bool]:
    """xgrammar's vocabulary type (BYTE_LEVEL, BYTE_FALLBACK, RAW) and add_prefix_space for a
    `tokenizers` backend, read from its decoder and pre-tokenizer."""
    decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    parts = decoder.get("decoders", [decoder])
    types = {p.get("type") for p in parts}
    if "ByteLevel" in types:
        return "BYTE_LEVEL", False
    if "ByteFallback" in types:
        pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else {}
        norm = json.loads(backend.normalizer.__getstate__()) if backend.normalizer is not None else {}
        prefix = pre.get("prepend_scheme") in ("always", "first") or "Prepend" in json.dumps(norm)
        return "BYTE_FALLBACK", prefix
    return "RAW", False


class StructuredOutputs:
    """Grammar masks for the constrained rows of each step; state per request id."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_ids: list[int]) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._xgr: Any = None
        self._compiler: Any = None
        self._bitmask: torch.Tensor | None = None
        self._states: dict[str, _Constraint | None] = {}  # None: its grammar failed to compile
        self._failed: dict[str, str] = {}
        self.seconds = 0.0  # spent in `apply` on constrained rows since the last `pop_seconds`

    # ------------------------------------------------------------------ compiling

    def _load(self) -> None:
        """Import xgrammar and build its view of the tokenizer (seconds, once per process)."""
        import xgrammar

        from coreproc.base.tokenizer import load_tokenizer

        backend = load_tokenizer(self.tokenizer_path).backend_tokenizer
        vocab = backend.get_vocab(with_added_tokens=True)
        encoded = [""] * min(self.vocab_size, max(vocab.values()) + 1)
        for token, i in vocab.items():
            if i < len(encoded):
                encoded[i] = token
        kind, prefix = vocab_type(backend)
        info = xgrammar.TokenizerInfo(
            encoded,
            getattr(xgrammar.VocabType, kind),
            vocab_size=self.vocab_size,
            stop_token_ids=self.eos_ids or None,
            add_prefix_space=prefix,
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self._xgr = xgrammar

    def compile(self, spec: StructuredSpec) -> Any:
        """The compiled grammar of `spec` (xgrammar caches by spec text); raises on a bad spec."""
        if self._compiler is None:
            self._load()
        c = self._compiler
        if spec.kind in ("json", "json_object"):
            return c.compile_grammar(
                self.json_ebnf(spec.spec if spec.kind == "json" else '{"type": "object"}')
            )
        if spec.kind == "regex":
            return c.compile_regex(spec.spec)
        if spec.kind == "choice":
            options = json.loads(spec.spec)
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(o) for o in options))
        if spec.kind == "grammar":
            return c.compile_grammar(spec.spec)
        assert spec.kind == "structural_tag", spec.kind
        return c.compile_structural_tag(json.dumps(self._tag_grammars(json.loads(spec.spec))))

    def json_ebnf(self, schema: str) -> str:
        """The EBNF grammar of a JSON schema, whitespace bounded (`MAX_WHITESPACE` in a row)."""
        grammar = self._xgr.Grammar.from_json_schema(
            schema, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE
        )
        # xgrammar 0.2.9 lets strings with a min/maxLength hold raw control characters, which is
        # not JSON: the characters of such strings get the class of unbounded ones
        return str(grammar).replace(_BOUNDED_CHARS, _JSON_CHARS)

    def _tag_grammars(self, node: Any) -> Any:
        """A structural tag with each JSON-schema part replaced by `json_ebnf`'s grammar (xgrammar's
        own conversion there bounds no whitespace); vLLM's older `structures` form is translated."""
        if isinstance(node, dict) and "structures" in node and "format" not in node:
            tags = [
                {
                    "type": "tag",
                    "begin": s["begin"],
                    "content": {"type": "json_schema", "json_schema": s["schema"]},
                    "end": s["end"],
                }
                for s in node["structures"]
            ]
            node = {
                "type": "structural_tag",
                "format": {"type": "triggered_tags", "triggers": node.get("triggers", []), "tags": tags},
            }
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                return {"type": "grammar", "grammar": self.json_ebnf(json.dumps(node["json_schema"]))}
            return {k: self._tag_grammars(v) for k, v in node.items()}
        if isinstance(node, list):
            return [self._tag_grammars(v) for v in node]
        return node

    def _state(self, row: Row) -> _Constraint | None:
        if row.req_id in self._states:
            return self._states[row.req_id]
        spec = row.params.structured
        assert spec is not None
        state: _Constraint | None = None
        try:
            compiled = self.compile(spec)
            matcher = self._xgr.GrammarMatcher(compiled, override_stop_tokens=row.eos_ids or None)
            state = _Constraint(matcher, list(spec.after))
        except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses on a bad spec
            lines = str(e).strip().splitlines() or [type(e).__name__]
            message = _SOURCE.sub("", lines[0])  # xgrammar's "[time] file.cc:line: " prefix
            self._failed[row.req_id] = f"invalid {spec.kind} constraint: {message}"
            log.info("request %s: %s", row.req_id, self._failed[row.req_id])
        self._states[row.req_id] = state
        return state

    # ------------------------------------------------------------------ per step

    def _sync(self, state: _Constraint, output_ids: list[int]) -> bool:
        """Bring the matcher to `output_ids`; False when this row is not constrained (the constraint
        has not begun, or a proposal before this position broke the grammar: the row is discarded)."""
        n = len(state.after)
        if state.start is not None and n and output_ids[state.start - n : state.start] != state.after:
            if state.accepted:  # the marker was a proposal that got rejected: start over
                state.matcher.rollback(len(state.accepted))
            state.accepted.clear()
            state.start = None
        if state.start is None:
            if n == 0:
                state.start = 0
            else:
                hit = next(
                    (i + n for i in range(len(output_ids) - n + 1) if output_ids[i : i + n] == state.after),
                    None,
                )
                if hit is None:
                    return False
                state.start = hit
        out = output_ids[state.start :]
        acc = state.accepted
        if out[: len(acc)] != acc:  # a rejected proposal (or a resumed request): roll back to the fork
            common = next(i for i, (a, b) in enumerate(zip(acc, out + [-1])) if a != b)
            state.matcher.rollback(len(acc) - common)
            del acc[common:]
        for token in out[len(acc) :]:
            if state.matcher.is_terminated() or not state.matcher.accept_token(token):
                return False
            acc.append(token)
        return not state.matcher.is_terminated()

    def apply(self, logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """Mask, in place, every token the grammar forbids at each constrained row."""
        masked: list[int] = []
        start = time.perf_counter()
        for row in rows:
            if row.params.structured is None:
                continue
            state = self._state(row)
            if state is None or not self._sync(state, row.output_ids):
                continue
            if self._bitmask is None or self._bitmask.shape[0] < logits.shape[0]:
                self._bitmask = self._xgr.allocate_token_bitmask(max(8, logits.shape[0]), self.vocab_size)
            state.matcher.fill_next_token_bitmask(self._bitmask, row.index)
            masked.append(row.index)
        if masked:
            assert self._bitmask is not None
            bitmask = self._bitmask[: logits.shape[0]].to(logits.device, non_blocking=True)
            self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=masked)
            self.seconds += time.perf_counter() - start
        return logits

    def pop_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def pop_failed(self) -> dict[str, str]:
        """Requests whose constraint could not be compiled since the last call, with the reason."""
        failed, self._failed = self._failed, {}
        return failed

    def forget(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._states.pop(req_id, None)
