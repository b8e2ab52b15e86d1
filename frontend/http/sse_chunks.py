"""The SSE chunks of one streaming completion or chat response (`data: {...}` events).

Runs in the HTTP server process, for frontend/http/completions.py's `stream`: `opening` (a chat's role chunk,
a completion's echoed prompts), `delta` (one sequence's new text as a chunk: through the chat's
reasoning / tool-call parser when it has one, with logprobs and the finish reason), `usage` (the
final usage chunk when asked for).
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from coreproc.base.protocol import SamplingParams
from coreproc.text import openai_responses as oresp
from coreproc.text.chat_features import OutputParser
from coreproc.text.openai_protocol import ChatCompletionRequest, CompletionRequest
from coreproc.text.output_processor import SequenceDelta
from coreproc.text.outputs import RequestOutput
from coreproc.text.render import Prompt

_json = msgspec.json.Encoder()


def sse(obj: dict) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


class Streamed(Protocol):
    """What the chunks are made of: frontend/http/completions.py's `Generation` (its request, serving context,
    prompts, sampling parameters, id and results)."""

    req: CompletionRequest | ChatCompletionRequest
    ctx: Any  # serving.ServingContext: its tokenizer, decode and chat features
    prompts: list[Prompt]
    params: list[SamplingParams]
    hexid: str
    created: int

    @property
    def model_name(self) -> str: ...

    def results(self) -> list[RequestOutput]: ...


class ChunkWriter:
    """The chunks of `gen`'s response, as its deltas come."""

    def __init__(self, gen: Streamed) -> None:
        self.gen, self.req, self.ctx = gen, gen.req, gen.ctx
        self.chat = isinstance(gen.req, ChatCompletionRequest)
        self.head = (f"{'chatcmpl' if self.chat else 'cmpl'}-{gen.hexid}", gen.model_name, gen.created)
        self.sent_text: dict[int, int] = {}  # choice index -> characters sent (completion text offsets)
        self.parsers: dict[int, OutputParser | None] = {}  # chat choice -> its reasoning / tool-call parser

    def opening(self) -> list[bytes]:
        """A chat's first chunk (each choice's role), or a completion's echoed prompts."""
        gen, req = self.gen, self.req
        if self.chat:
            deltas = [oresp.chat_delta(i, role="assistant", content="") for i in range(gen.params[0].n)]
            return [sse(oresp.chat_chunk(*self.head, deltas))]
        if not isinstance(req, CompletionRequest) or not req.echo:
            return []
        out = []
        for k, prompt in enumerate(gen.prompts):
            for i in range(req.n):
                self.sent_text[k * req.n + i] = len(prompt.text or "")
                choice = {
                    "index": k * req.n + i,
                    "text": prompt.text or "",
                    "logprobs": None,
                    "finish_reason": None,
                }
                out.append(sse(oresp.completion_chunk(*self.head, [choice])))
        return out

    def delta(self, d: SequenceDelta) -> list[bytes]:
        """The chunks of one sequence's delta (none for an empty one, or text a parser holds back)."""
        if not d.text and not d.token_ids and d.finish_reason is None:
            return []
        return self._chat(d) if self.chat else [self._completion(d)]

    def usage(self) -> bytes | None:
        """The usage chunk, when the request asked for it (`stream_options.include_usage`)."""
        if self.req.stream_options is None or not self.req.stream_options.include_usage:
            return None
        usage = oresp.usage_of(self.gen.results())
        return sse((oresp.chat_chunk if self.chat else oresp.completion_chunk)(*self.head, [], usage))

    def _chat(self, d: SequenceDelta) -> list[bytes]:
        req, finish = self.req, oresp.openai_finish_reason(d.finish_reason)
        assert isinstance(req, ChatCompletionRequest), "a chat's delta"
        lp = None
        if req.logprobs and d.logprobs is not None:
            lp = oresp.chat_logprobs(d.token_ids, d.logprobs, req.top_logprobs or 0)
        if d.choice_index not in self.parsers:
            parser = self.ctx.features.output_parser(req, self.ctx.tokenizer, self.gen.prompts[0].ids)
            self.parsers[d.choice_index] = parser
        parser = self.parsers[d.choice_index]
        if parser is None:
            choice = oresp.chat_delta(d.choice_index, content=d.text, logprobs=lp, finish_reason=finish)
            return [sse(oresp.chat_chunk(*self.head, [choice]))]
        pieces: list[dict[str, Any]] = parser.feed(d.text, final=finish is not None)
        if not pieces and finish is None and lp is None:
            return []  # text held back (a tag may be starting)
        pieces = pieces or [{}]
        out = []
        for k, piece in enumerate(pieces):  # logprobs and the finish reason ride on the last
            last = k == len(pieces) - 1
            choice = oresp.chat_delta(
                d.choice_index,
                logprobs=lp if last else None,
                finish_reason=parser.finish_reason(finish) if last else None,
                fields=piece,
            )
            out.append(sse(oresp.chat_chunk(*self.head, [choice])))
        return out

    def _completion(self, d: SequenceDelta) -> bytes:
        req, index = self.req, d.choice_index
        assert isinstance(req, CompletionRequest), "a completion's delta"
        lp = None
        if req.logprobs is not None and d.logprobs is not None:
            sent = self.sent_text.get(index, 0)
            lp = oresp.completion_logprobs(
                d.token_ids, d.logprobs, self.ctx.decode, sent, as_ids=req.return_tokens_as_token_ids
            )
        self.sent_text[index] = self.sent_text.get(index, 0) + len(d.text)
        finish = oresp.openai_finish_reason(d.finish_reason)
        return sse(
            oresp.completion_chunk(
                *self.head, [{"index": index, "text": d.text, "logprobs": lp, "finish_reason": finish}]
            )
        )
