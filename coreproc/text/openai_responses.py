"""OpenAI response shapes: completion and chat objects, streaming chunks, logprobs and usage.

Runs in the HTTP frontend and in batch mode (both import it from here). Builds the plain dicts OpenAI
clients expect from the offline result types (`RequestOutput` / `CompletionOutput`, whose logprobs are
dicts of token id -> `Logprob`). Logprobs are clamped to a finite floor because JSON has no -inf.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from coreproc.base.protocol import FinishReason
from coreproc.text.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput

if TYPE_CHECKING:
    from coreproc.text.chat_features import OutputParser

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; OpenAI-compatible servers clamp here


def openai_finish_reason(reason: FinishReason | None) -> FinishReason | None:
    """Engine finish reasons pass through as vLLM reports them: stop, length, abort, error."""
    return reason


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def usage_of(results: list[RequestOutput]) -> dict[str, Any]:
    """Usage of one API request: each prompt counted once, every generated sequence counted, and
    the prompt tokens served from the prefix cache (`prompt_tokens_details.cached_tokens`)."""
    prompt = sum(len(r.prompt_token_ids) for r in results)
    completion = sum(len(o.token_ids) for r in results for o in r.outputs)
    return usage(prompt, completion, sum(r.num_cached_tokens for r in results))


def _clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _by_rank(pos: PositionLogprobs) -> list[tuple[int, Logprob]]:
    return sorted(pos.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)


def completion_logprobs(
    token_ids: list[int],
    positions: list[PositionLogprobs | None],
    decode: Callable[[int], str] | None = None,
    start_offset: int = 0,
    as_ids: bool = False,
) -> dict[str, list]:
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs (top-N plus chosen), text_offset.

    A position without logprobs (the first prompt token under echo) gets None and `decode(token_id)`.
    `start_offset` is the text length already sent (streaming chunks continue the offsets). `as_ids`
    (vLLM's `return_tokens_as_token_ids`) names tokens "token_id:N" instead of their text.
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = start_offset
    for tid, pos in zip(token_ids, positions):
        chosen = pos.get(tid) if pos else None
        if chosen is None or pos is None:
            text = decode(tid) if decode else ""
            token_logprobs.append(None)
            top.append(None)
        else:
            text = chosen.decoded_token or ""
            token_logprobs.append(_clamp(chosen.logprob))
            top.append(
                {
                    (f"token_id:{i}" if as_ids else lp.decoded_token or ""): _clamp(lp.logprob)
                    for i, lp in _by_rank(pos)
                }
            )
        tokens.append(f"token_id:{tid}" if as_ids else text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_entry(lp: Logprob) -> dict[str, Any]:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": _clamp(lp.logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(
    token_ids: list[int], positions: list[PositionLogprobs], top_logprobs: int
) -> dict[str, list]:
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [the N most likely]}]}."""
    content = []
    for tid, pos in zip(token_ids, positions):
        chosen = pos.get(tid) or Logprob(LOGPROB_FLOOR)
        alternatives = [_chat_entry(lp) for _, lp in _by_rank(pos)[:top_logprobs]]
        content.append({**_chat_entry(chosen), "top_logprobs": alternatives})
    return {"content": content}


def completion_choices(
    result: RequestOutput,
    *,
    echo: bool = False,
    logprobs: int | None = None,
    first_index: int = 0,
    decode: Callable[[int], str] | None = None,
    as_ids: bool = False,
) -> list[dict[str, Any]]:
    """The choices of one prompt (indices from `first_index`); echo prepends the prompt text."""
    choices = []
    for out in result.outputs:
        lp = None
        if logprobs is not None:
            ids = out.token_ids
            positions: list[PositionLogprobs | None] = list(out.logprobs or [])
            if echo:
                prompt_lps = result.prompt_logprobs or [None] * len(result.prompt_token_ids)
                ids, positions = result.prompt_token_ids + ids, list(prompt_lps) + positions
            lp = completion_logprobs(ids, positions, decode, as_ids=as_ids)
        text = (result.prompt or "") + out.text if echo else out.text
        choices.append(
            {
                "index": first_index + out.index,
                "text": text,
                "logprobs": lp,
                "finish_reason": openai_finish_reason(out.finish_reason),
            }
        )
    return choices


def chat_choice(
    out: CompletionOutput, top_logprobs: int | None = None, parser: OutputParser | None = None
) -> dict[str, Any]:
    """One chat choice; `top_logprobs` None means logprobs were not requested; `parser` splits the
    text into reasoning, content and tool calls."""
    lp = None
    if top_logprobs is not None:
        lp = chat_logprobs(out.token_ids, list(out.logprobs or []), top_logprobs)
    message = {"role": "assistant", "content": out.text} if parser is None else parser.message(out.text)
    finish = openai_finish_reason(out.finish_reason)
    return {
        "index": out.index,
        "message": message,
        "logprobs": lp,
        "finish_reason": finish if parser is None else parser.finish_reason(finish),
    }


def _envelope(
    obj: str, request_id: str, model: str, created: int, choices: list[dict], usage: dict[str, int] | None
) -> dict[str, Any]:
    body: dict[str, Any] = {"id": request_id, "object": obj, "created": created, "model": model}
    body["choices"] = choices
    if usage is not None:
        body["usage"] = usage
    return body


def completion_response(
    request_id: str, model: str, created: int, choices: list[dict], usage: dict[str, int]
) -> dict[str, Any]:
    return _envelope("text_completion", request_id, model, created, choices, usage)


def chat_completion_response(
    request_id: str, model: str, created: int, choices: list[dict], usage: dict[str, int]
) -> dict[str, Any]:
    return _envelope("chat.completion", request_id, model, created, choices, usage)


# ----------------------------------------------------------------------------- streaming chunks


def completion_chunk(
    request_id: str, model: str, created: int, choices: list[dict], usage: dict[str, int] | None = None
) -> dict[str, Any]:
    """One SSE chunk; choices as from `completion_choices` (delta text). Usage-only chunks pass []."""
    return _envelope("text_completion", request_id, model, created, choices, usage)


def chat_delta(
    index: int,
    *,
    role: str | None = None,
    content: str | None = None,
    logprobs: dict | None = None,
    finish_reason: str | None = None,
    fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A chat chunk's choice: the first carries the role, later ones content deltas (or the
    `fields` of an `OutputParser` delta: reasoning_content, tool_calls)."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if fields:
        delta.update(fields)
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk(
    request_id: str, model: str, created: int, choices: list[dict], usage: dict[str, int] | None = None
) -> dict[str, Any]:
    """One SSE chunk of `chat.completion.chunk`; usage only on the last one when asked for."""
    return _envelope("chat.completion.chunk", request_id, model, created, choices, usage)
