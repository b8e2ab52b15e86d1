"""Turns `EngineOutput` deltas from the core into text, logprobs and finished results.

Runs in the HTTP frontend, batch mode and the offline API's process. A request with n > 1 fans out into
n engine requests ("{i}_{id}", seeds offset by i), whose results are gathered under the parent; a
request's sequences are built first and registered only once the engine has admitted them all, each with
its index among the API request's choices (`choice_index`: prompt k's sequence i is k * n + i). Stop
strings are found here after detokenization; the processor returns those engine request ids so the
caller can abort them in the core. `process()` returns one `SequenceDelta` per sequence that changed
(for streaming) and keeps the running totals for `RequestOutput`s.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from coreproc.base.protocol import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    LoRARef,
    MultiModalRef,
    SamplingParams,
    TokenLogprobs,
)
from coreproc.text.detokenizer import IncrementalDetokenizer
from coreproc.text.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput


@dataclass
class SequenceDelta:
    """What one sequence gained in one step (for streaming)."""

    request_id: str
    index: int  # the sequence's index within its prompt's n
    choice_index: int  # ... within the API request's choices (all prompts x n)
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None


@dataclass
class Sequence:
    parent: ParentRequest
    index: int
    choice_index: int
    detok: IncrementalDetokenizer
    output: CompletionOutput
    want_logprobs: bool

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None


@dataclass
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def result(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.output for s in self.sequences],
            prompt_logprobs=self.prompt_logprobs,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
        )


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sampling params of sequence `index` of an n > 1 request."""
    if params.n == 1:
        return params
    return msgspec.structs.replace(
        params,
        n=1,
        seed=None if params.seed is None else params.seed + index,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
    )


class OutputProcessor:
    """Request table of the frontend side; not thread-safe."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self.sequences: dict[str, Sequence] = {}

    def bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """Token sequences to ban for each word: as written and with a leading space (the form it takes
        mid-sentence), without special tokens."""
        seqs: list[list[int]] = []
        for word in words:
            for form in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(form, add_special_tokens=False)
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs

    def engine_requests(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        eos_token_ids: list[int] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        mm_refs: tuple[MultiModalRef, ...] = (),
        lora: LoRARef | None = None,
    ) -> list[EngineRequest]:
        """The engine requests of one prompt's n sequences ("{i}_{id}" when n > 1, seeds offset by i).
        The prompt's images (`mm_refs`) travel with their pixels on the first sequence only; the others
        name them by hash, which the core resolves from the same submission. Nothing is registered:
        call `register` once the engine has admitted them."""
        if params.bad_words and not params.bad_words_token_ids:
            params = msgspec.structs.replace(params, bad_words_token_ids=self.bad_word_ids(params.bad_words))
        now = time.time()
        by_hash = [msgspec.structs.replace(r, data=None) for r in mm_refs]
        return [
            EngineRequest(
                request_id=request_id if params.n == 1 else f"{i}_{request_id}",
                prompt_token_ids=prompt_ids,
                sampling_params=child_params(params, i),
                eos_token_ids=eos_token_ids or [],
                arrival_time=now,
                priority=priority,
                cache_salt=cache_salt,
                mm_refs=list(mm_refs) if i == 0 else by_hash,
                lora=lora,
            )
            for i in range(params.n)
        ]

    def register(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        requests: list[EngineRequest],
        first_choice: int = 0,
    ) -> None:
        """Track the sequences of one prompt (from `engine_requests`) so their outputs can be processed;
        they are the API request's choices from `first_choice` on."""
        parent = ParentRequest(request_id, prompt, list(prompt_ids))
        if requests[0].sampling_params.prompt_logprobs is not None:
            parent.prompt_logprobs = []
        self.parents[request_id] = parent
        for i, er in enumerate(requests):
            sub = er.sampling_params
            seq = Sequence(
                parent,
                i,
                first_choice + i,
                IncrementalDetokenizer(self.tokenizer, prompt_ids, sub),
                CompletionOutput(index=i, logprobs=[] if sub.logprobs is not None else None),
                sub.logprobs is not None,
            )
            parent.sequences.append(seq)
            self.sequences[er.request_id] = seq

    def submit(
        self,
        engine: Any,
        prompts: list[tuple[str, str | None, list[int], SamplingParams]],
        *,
        eos_token_ids: list[int],
        priority: int = 0,
        cache_salt: str | None = None,
        mm_refs: Mapping[str, tuple[MultiModalRef, ...]] | None = None,
        lora: Mapping[str, LoRARef] | None = None,
    ) -> None:
        """Add the sequences of one API request's prompts ((request id, text, token ids, params) each;
        `mm_refs`: the images of a prompt, by request id) to `engine` (an `EngineCore`) together, and
        register them. If the engine refuses them (`InvalidParam`, `QueueFull`), nothing was added or
        registered and the error propagates."""
        refs = mm_refs or {}
        built = [
            (rid, text, ids, self.engine_requests(rid, ids, p, eos_token_ids=eos_token_ids, priority=priority,
                                                  cache_salt=cache_salt, mm_refs=refs.get(rid, ()),
                                                  lora=(lora or {}).get(rid)))
            for rid, text, ids, p in prompts
        ]  # fmt: skip
        engine.add_requests([er for *_, ers in built for er in ers])
        first_choice = 0
        for rid, text, ids, ers in built:
            self.register(rid, text, ids, ers, first_choice)
            first_choice += len(ers)

    def withdraw(self, engine: Any, request_id: str) -> None:
        """Abort whatever of a request still runs in `engine` and forget it."""
        engine.abort_requests(self.discard(request_id))

    def _convert(self, e: TokenLogprobs) -> PositionLogprobs:
        """One position: the chosen token (its rank) first, then the top alternatives."""
        pos: PositionLogprobs = {}
        for j, (tid, lp) in enumerate(zip(e.token_ids, e.logprobs)):
            if tid not in pos:
                rank = e.rank if j == 0 else j
                pos[tid] = Logprob(lp, rank, self.tokenizer.decode([tid]))
        return pos

    def process(self, outputs: list[EngineOutput]) -> tuple[list[SequenceDelta], list[str]]:
        """Apply engine outputs; returns sequence deltas and engine ids to abort (stop strings)."""
        deltas: list[SequenceDelta] = []
        to_abort: list[str] = []
        for eo in outputs:
            seq = self.sequences.get(eo.request_id)
            if seq is None or seq.finished:
                continue
            out, parent = seq.output, seq.parent
            parent.num_cached_tokens = max(parent.num_cached_tokens, eo.num_cached_tokens)
            if eo.new_prompt_logprobs and parent.prompt_logprobs is not None:
                parent.prompt_logprobs.extend(
                    None if e is None else self._convert(e) for e in eo.new_prompt_logprobs
                )
            stop = seq.detok.update(eo.new_token_ids)
            used = seq.detok.tokens_used  # several tokens in one output (speculation): none past a stop
            new_ids, new_raw_lps = eo.new_token_ids[:used], eo.new_logprobs[:used]
            out.token_ids.extend(new_ids)
            out.cumulative_logprob += sum(lp.logprobs[0] for lp in new_raw_lps)
            new_lps = [self._convert(e) for e in new_raw_lps] if seq.want_logprobs else None
            if new_lps is not None and out.logprobs is not None:
                out.logprobs.extend(new_lps)
            if stop is not None:
                out.finish_reason, out.stop_reason = "stop", stop
                if not eo.finished:
                    to_abort.append(eo.request_id)
            elif eo.finished:
                out.finish_reason, out.stop_reason = eo.finish_reason, eo.stop_reason
            finished = out.finish_reason is not None  # (not seq.finished: narrowed to False above)
            text = seq.detok.delta(finished)
            out.text += text
            if finished:
                del self.sequences[eo.request_id]
            deltas.append(
                SequenceDelta(
                    parent.request_id,
                    seq.index,
                    seq.choice_index,
                    text,
                    list(new_ids),
                    new_lps,
                    out.finish_reason,
                    out.stop_reason,
                )
            )
        return deltas, to_abort

    def pop_finished(self, request_id: str) -> RequestOutput | None:
        """The final result of a finished request (removing it), or None while it runs."""
        parent = self.parents.get(request_id)
        if parent is None or not parent.finished:
            return None
        del self.parents[request_id]
        return parent.result()

    def discard(self, request_id: str) -> list[str]:
        """Forget a request; returns the engine ids of its sequences that still run (to abort)."""
        self.parents.pop(request_id, None)
        running = [eid for eid, seq in self.sequences.items() if seq.parent.request_id == request_id]
        for eid in running:
            del self.sequences[eid]
        return running
