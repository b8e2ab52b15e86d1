"""OpenAI request and response schema: `/v1/completions` and `/v1/chat/completions` bodies.

Runs in the frontend (batch mode today, the HTTP server later). Receives request bodies (JSON bytes or
dicts), validates them into frozen msgspec Structs (`RequestError` names the bad field), maps them to
the engine's `SamplingParams`, and builds the plain-dict responses and streaming chunks OpenAI clients
expect from the offline result types (`RequestOutput` / `CompletionOutput`). Defaults follow vLLM:
completions `max_tokens` 16, chat `max_tokens` None (up to the context), temperature 1.0, n 1.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from coreproc.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from coreproc.protocol import InvalidParam, SamplingParams

MAX_LOGPROBS = 20
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; OpenAI-compatible servers clamp here


class RequestError(ValueError):
    """A request a client can fix; `error_body()` is the OpenAI error object sent back."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        err_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status
        self.err_type = err_type

    def error_body(self) -> dict[str, Any]:
        return {
            "error": {"message": str(self), "type": self.err_type, "param": self.param, "code": self.code}
        }


# ----------------------------------------------------------------------------- request bodies


class ContentPart(msgspec.Struct, frozen=True):
    """One part of a message's content; only "text" is rendered today (images keep their payload)."""

    type: str
    text: str | None = None
    image_url: dict[str, Any] | None = None


class ChatMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class _Common(msgspec.Struct, frozen=True, kw_only=True):
    """Fields shared by both endpoints (OpenAI's plus vLLM's sampling extensions)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    priority: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class CompletionRequest(_Common, frozen=True, kw_only=True):
    prompt: str | list[Any]  # str | list[str] | list[int] | list[list[int]], checked by `prompt_inputs`
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatCompletionRequest(_Common, frozen=True, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


_MISSING = re.compile(r"missing required field `([^`]+)`")
_AT = re.compile(r" - at `\$\.?([^`]*)`$")


def _param_of(message: str) -> str | None:
    """The field a msgspec validation message is about, as a dotted path ("messages[0].role")."""
    at = _AT.search(message)
    path = at.group(1) if at else ""
    missing = _MISSING.search(message)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


def _parse(body: bytes | str | dict, typ: type) -> Any:
    try:
        if isinstance(body, (bytes, bytearray, memoryview, str)):
            return msgspec.json.decode(body, type=typ)
        return msgspec.convert(body, typ)
    except msgspec.ValidationError as e:
        message = _AT.sub("", str(e))
        param = _param_of(str(e))
        raise RequestError(f"{param}: {message}" if param else message, param) from None
    except msgspec.DecodeError as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None


def parse_completion_request(body: bytes | str | dict) -> CompletionRequest:
    """Validate a `/v1/completions` body; RequestError names the first bad field."""
    req = _parse(body, CompletionRequest)
    prompt_inputs(req)  # shape check
    return req


def parse_chat_request(body: bytes | str | dict) -> ChatCompletionRequest:
    """Validate a `/v1/chat/completions` body; RequestError names the first bad field."""
    req = _parse(body, ChatCompletionRequest)
    if not req.messages:
        raise RequestError("messages must not be empty", "messages")
    return req


def prompt_inputs(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: each a text or a list of token ids."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise RequestError("prompt must not be empty", "prompt")

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)

    if all(isinstance(x, str) for x in p):
        return list(p)
    if is_ids(p):
        return [list(p)]
    if all(is_ids(x) for x in p):
        return [list(x) for x in p]
    raise RequestError(
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
        "prompt",
    )


# ----------------------------------------------------------------------------- sampling params


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def to_sampling_params(
    req: CompletionRequest | ChatCompletionRequest, prompt_len: int, max_model_len: int
) -> SamplingParams:
    """The engine's sampling parameters for one prompt of `prompt_len` tokens (validated)."""
    chat = isinstance(req, ChatCompletionRequest)
    prompt_param = "messages" if chat else "prompt"
    if prompt_len >= max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the {prompt_param}.",
            prompt_param,
        )
    if chat:
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = _or(req.max_completion_tokens, req.max_tokens)
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        top = _or(req.top_logprobs, 0)
        if not 0 <= top <= MAX_LOGPROBS:
            raise RequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
        logprobs, prompt_logprobs = (top if req.logprobs else None), None
    else:
        max_param, max_tokens = "max_tokens", req.max_tokens
        logprobs = req.logprobs
        prompt_logprobs = req.logprobs if req.echo else None
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
    elif max_tokens >= 1 and prompt_len + max_tokens > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {prompt_param}, {max_tokens} in the "
            f"completion). Please reduce the length of the {prompt_param} or completion.",
            max_param,
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(
        n=req.n,
        temperature=_or(req.temperature, 1.0),
        top_p=_or(req.top_p, 1.0),
        top_k=_or(req.top_k, 0),
        min_p=_or(req.min_p, 0.0),
        seed=req.seed,
        presence_penalty=_or(req.presence_penalty, 0.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        repetition_penalty=_or(req.repetition_penalty, 1.0),
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
    )
    try:
        params.validate(MAX_LOGPROBS)
    except InvalidParam as e:
        if e.param == "max_tokens":
            raise RequestError(str(e).replace("max_tokens", max_param), max_param) from None
        raise RequestError(str(e), e.param) from None
    return params


# ----------------------------------------------------------------------------- responses


def openai_finish_reason(reason: str | None) -> str | None:
    """Engine finish reasons pass through as vLLM reports them: stop, length, abort, error."""
    return reason


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def usage_of(results: list[RequestOutput]) -> dict[str, int]:
    """Usage of one API request: each prompt counted once, every generated sequence counted."""
    prompt = sum(len(r.prompt_token_ids) for r in results)
    completion = sum(len(o.token_ids) for r in results for o in r.outputs)
    return usage(prompt, completion)


def _clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _by_rank(pos: PositionLogprobs) -> list[tuple[int, Logprob]]:
    return sorted(pos.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)


def completion_logprobs(
    token_ids: list[int], positions: list[PositionLogprobs | None], decode: Callable[[int], str] | None = None
) -> dict[str, list]:
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs (top-N plus chosen), text_offset.

    A position without logprobs (the first prompt token under echo) gets None and `decode(token_id)`.
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for tid, pos in zip(token_ids, positions):
        chosen = pos.get(tid) if pos else None
        if chosen is None:
            text = decode(tid) if decode else ""
            token_logprobs.append(None)
            top.append(None)
        else:
            text = chosen.decoded_token or ""
            token_logprobs.append(_clamp(chosen.logprob))
            top.append({(lp.decoded_token or ""): _clamp(lp.logprob) for _, lp in _by_rank(pos)})
        tokens.append(text)
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
) -> list[dict[str, Any]]:
    """The choices of one prompt (indices from `first_index`); echo prepends the prompt text."""
    choices = []
    for out in result.outputs:
        lp = None
        if logprobs is not None:
            ids, positions = out.token_ids, list(out.logprobs or [])
            if echo:
                prompt_lps = result.prompt_logprobs or [None] * len(result.prompt_token_ids)
                ids, positions = result.prompt_token_ids + ids, list(prompt_lps) + positions
            lp = completion_logprobs(ids, positions, decode)
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


def chat_choice(out: CompletionOutput, top_logprobs: int | None = None) -> dict[str, Any]:
    """One chat choice; `top_logprobs` None means logprobs were not requested."""
    lp = None
    if top_logprobs is not None:
        lp = chat_logprobs(out.token_ids, list(out.logprobs or []), top_logprobs)
    return {
        "index": out.index,
        "message": {"role": "assistant", "content": out.text},
        "logprobs": lp,
        "finish_reason": openai_finish_reason(out.finish_reason),
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
) -> dict[str, Any]:
    """A chat chunk's choice: the first carries the role, later ones content deltas."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk(
    request_id: str, model: str, created: int, choices: list[dict], usage: dict[str, int] | None = None
) -> dict[str, Any]:
    """One SSE chunk of `chat.completion.chunk`; usage only on the last one when asked for."""
    return _envelope("chat.completion.chunk", request_id, model, created, choices, usage)
