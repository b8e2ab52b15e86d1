"""What one request may ask for: bounds checked wherever requests enter (HTTP, batch mode, the SDK).

Runs in the frontend (at parse time, before any prompt is tokenized) and in the scheduler process
(every `EngineRequest`, whatever path it came by), so a client of `ember core` cannot do through the
socket what HTTP refuses. `RequestLimits` is part of the engine's config, built once; every field is
an engine option (coreproc.base.options) (`--max-n`, `--max-prompts-per-request`, ...), and the core
reports the values to clients in `EngineInfo.limits`. A broken bound raises `InvalidParam` naming
the field and the limit (HTTP 400); a bad limit, `ConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from coreproc.base.errors import ConfigError, InvalidParam
from coreproc.base.options import option


def _limit(default: int | None, help: str) -> Any:
    return option(help, default, metavar="N")


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one API request; `None` fields are resolved by `resolve()` from the engine's sizes."""

    max_n: int = _limit(128, "most sequences (n) one prompt may ask for")
    max_prompts_per_request: int = _limit(256, "most prompts in one completion request")
    max_seqs_per_request: int | None = _limit(
        None, "most sequences (prompts x n) in one request, admitted together (default: --max-num-seqs)"
    )
    max_stop_strings: int = _limit(32, "most stop strings in one request")
    max_stop_token_ids: int = _limit(1024, "most stop_token_ids in one request")
    max_word_chars: int = _limit(
        1024, "longest stop string or bad word, in characters (token-id words: tokens)"
    )
    max_bad_words: int = _limit(256, "most bad_words in one request")
    max_logit_bias: int = _limit(1024, "most logit_bias entries in one request")
    max_allowed_token_ids: int | None = _limit(
        None, "most allowed_token_ids in one request (default: the vocabulary size)"
    )
    max_logits_processor_args_bytes: int = _limit(
        64 * 1024, "largest logits_processor_args object, in bytes of JSON"
    )
    max_json_depth: int = _limit(32, "deepest nesting of free-form JSON values (logits_processor_args, ...)")
    max_messages: int = _limit(2048, "most chat messages in one request")
    max_content_parts: int = _limit(4096, "most content parts over all messages of one chat request")
    max_submit_bytes: int = _limit(
        128 * 2**20,
        "largest submission (one request's sequences, encoded) the core takes; a bigger one is refused "
        "by Ember's clients, and a client that sends one anyway is disconnected",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and (type(value) is not int or value < 1):
                raise ConfigError.bad(f.name, f"must be a positive integer, got {value!r}")

    def resolve(self, max_num_seqs: int, vocab_size: int) -> RequestLimits:
        """Fill the engine-sized defaults (sequences per request, allowed token ids) from the engine's
        checked sizes: the user's own `max_num_seqs` is refused by SchedulerConfig, not here."""
        return dataclasses.replace(
            self,
            max_seqs_per_request=self.max_seqs_per_request or max_num_seqs,
            max_allowed_token_ids=self.max_allowed_token_ids or vocab_size,
        )

    @classmethod
    def of(cls, value: RequestLimits | Mapping[str, Any] | None) -> RequestLimits:
        """From a RequestLimits, a mapping of its fields (unknown names are an error) or None."""
        if value is None or isinstance(value, RequestLimits):
            return value or cls()
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ConfigError(f"unknown request limit {unknown[0]!r}; known: {', '.join(sorted(names))}")
        return cls(**value)

    # ------------------------------------------------------------------ checks

    def check_sequences(self, num_prompts: int, n: int) -> None:
        """Prompts and n of one request, before anything is tokenized or submitted."""
        _at_most(n, self.max_n, "n", "sequences per prompt")
        _at_most(num_prompts, self.max_prompts_per_request, "prompt", "prompts in one request")
        seqs = self.max_seqs_per_request
        if seqs is not None and num_prompts * n > seqs:
            raise InvalidParam(
                f"the request asks for {num_prompts * n} sequences ({num_prompts} prompts x n={n}); "
                f"this server takes at most {seqs} in one request",
                "n",
            )

    def check_sampling(self, params: Any) -> None:
        """The list-valued sampling fields of a `SamplingParams` or of an OpenAI request body (same
        names; a single string counts as a list of one)."""
        stop = _as_list(getattr(params, "stop", None))
        _at_most(len(stop), self.max_stop_strings, "stop", "stop strings")
        for s in stop:
            _at_most(len(s), self.max_word_chars, "stop", "characters in a stop string")
        stop_ids = getattr(params, "stop_token_ids", None) or ()
        _at_most(len(stop_ids), self.max_stop_token_ids, "stop_token_ids", "stop token ids")
        _at_most(len(getattr(params, "logit_bias", None) or ()), self.max_logit_bias, "logit_bias", "entries")
        allowed = getattr(params, "allowed_token_ids", None) or ()
        if self.max_allowed_token_ids is not None:
            _at_most(len(allowed), self.max_allowed_token_ids, "allowed_token_ids", "token ids")
        words = _as_list(getattr(params, "bad_words", None))
        word_ids = getattr(params, "bad_words_token_ids", None) or []
        _at_most(max(len(words), len(word_ids)), self.max_bad_words, "bad_words", "bad words")
        for w in (*words, *word_ids):
            _at_most(len(w), self.max_word_chars, "bad_words", "characters (or tokens) in a bad word")
        args = getattr(params, "logits_processor_args", None)
        if args:
            try:
                size = len(msgspec.json.encode(args))
            except RecursionError:
                size = 0  # far too deep: check_json says so
            _at_most(size, self.max_logits_processor_args_bytes, "logits_processor_args", "bytes of JSON")
            self.check_json(args, "logits_processor_args")

    def check_json(self, value: Any, param: str) -> None:
        """A free-form JSON value nests at most `max_json_depth` levels and holds only 64-bit integers
        (what crosses to the core)."""
        problem = _json_problem(value, self.max_json_depth)
        if problem == "deep":
            raise InvalidParam(
                f"{param}: nests deeper than this server's limit of {self.max_json_depth}", param
            )
        if problem == "int":
            raise InvalidParam(f"{param}: integers must fit in 64 bits", param)


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _at_most(value: int, limit: int, param: str, what: str) -> None:
    if value > limit:
        raise InvalidParam(f"{param}: {value} {what}; this server takes at most {limit}", param)


def _json_problem(value: Any, depth: int) -> str | None:
    """ "deep" if `value` (dicts and lists of JSON values) nests more than `depth` levels, "int" if it
    holds an integer outside 64 bits, else None."""
    if isinstance(value, (dict, list)):
        if depth <= 0:
            return "deep"
        for v in value.values() if isinstance(value, dict) else value:
            problem = _json_problem(v, depth - 1)
            if problem is not None:
                return problem
    elif type(value) is int and not -(2**63) <= value < 2**64:
        return "int"
    return None
