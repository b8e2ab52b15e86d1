"""OpenAI request schema: `/v1/completions` and `/v1/chat/completions` bodies, and Ember's extras.

Runs in the HTTP frontend and in batch mode (both import it from here). Receives request bodies (JSON
bytes or dicts), validates them into frozen msgspec Structs (`RequestError` names the bad field), checks
them against the server's `RequestLimits` before anything is tokenized, and maps them to the engine's
`SamplingParams`. Responses are built in `openai_responses.py`. Defaults follow vLLM: completions
`max_tokens` 16, chat `max_tokens` None (up to the context), temperature 1.0, n 1.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from coreproc.base.errors import EmberError, InvalidParam
from coreproc.base.limits import RequestLimits
from coreproc.base.protocol import SamplingParams, StructuredSpec
from coreproc.text.openai_fields import (
    AssistantToolCall,
    FieldPolicy,
    ResponseFormat,
    StructuredOutputsParam,
    Tool,
    ToolChoice,
    unsupported_field,
)

MAX_LOGPROBS = 20


class RequestError(EmberError, ValueError):
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
    """One part of a message's content: "text", or an image ("image_url" as OpenAI's chat API sends
    it, {"url": ...} or a string; "input_image" as its Responses API does; "image" with `image`)."""

    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None
    image: str | None = None  # the URL of an {"type": "image"} part
    detail: str | None = None  # an input_image's resolution hint: accepted, unused (one per checkpoint)


class ChatMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    annotations: Any = None  # what OpenAI's clients echo back from a returned message: ignored
    audio: Any = None
    function_call: Any = None


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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParam | None = None  # vLLM's extra: json, regex, choice, ...
    user: str | None = None  # bookkeeping fields: accepted, unused
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    cache_salt: str | None = None
    priority: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None  # token id (as a string, like OpenAI) -> bias
    allowed_token_ids: list[int] | None = None
    bad_words: str | list[str] | None = None
    logits_processor_args: dict[str, Any] | None = None  # custom processors' arguments, by name


class CompletionRequest(_Common, frozen=True, kw_only=True):
    prompt: str | list[Any]  # str | list[str] | list[int] | list[list[int]], checked by `prompt_inputs`
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None  # accepted only as n (vLLM's v1 engine dropped it; Ember never had it)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" (vLLM's extension)
    suffix: str | None = None  # refused when set (see openai_fields.UNSUPPORTED)


class ChatCompletionRequest(_Common, frozen=True, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    # vLLM's image extras, refused unless the server runs with --trust-request-mm-kwargs (media_config)
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    # in OpenAI's schema, refused when set (see openai_fields.UNSUPPORTED)
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """`POST /tokenize`: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None  # rendered by the chat template as for a chat request
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """`POST /detokenize`: token ids back to text."""

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(msgspec.Struct, frozen=True, kw_only=True):
    """`POST /v1/load_lora_adapter` (vLLM's spelling): serve a PEFT LoRA folder on the server's host
    as the model `lora_name`; `load_inplace` replaces the weights of a name already loaded."""

    lora_name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    lora_path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(msgspec.Struct, frozen=True, kw_only=True):
    """`POST /v1/unload_lora_adapter`: stop serving an adapter (running requests finish with it)."""

    lora_name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


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


def parse_body(body: bytes | str | dict, typ: type, fields: FieldPolicy | None = None) -> Any:
    """Decode and validate a JSON body into `typ`; RequestError names the first bad or unknown field."""
    try:
        value = msgspec.json.decode(body) if isinstance(body, (bytes, bytearray, memoryview, str)) else body
        if isinstance(value, dict):
            if value is body and fields is not None and fields.allow_unknown:
                value = msgspec.json.decode(
                    msgspec.json.encode(value)
                )  # dropping fields must not touch theirs
            unknown = (fields or FieldPolicy()).check(value, typ)
            if unknown:
                raise RequestError(
                    f"unknown field {unknown[0]!r}: not part of this API (a typo?); a server started with "
                    "--allow-unknown-fields ignores unknown fields",
                    unknown[0],
                )
        return msgspec.convert(value, typ)
    except msgspec.ValidationError as e:
        message = _AT.sub("", str(e))
        param = _param_of(str(e))
        raise RequestError(f"{param}: {message}" if param else message, param) from None
    except msgspec.DecodeError as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError("the request body nests too deeply to be a valid request") from None


def parse_completion_request(
    body: bytes | str | dict, limits: RequestLimits | None = None, fields: FieldPolicy | None = None
) -> CompletionRequest:
    """Validate a `/v1/completions` body within `limits`; RequestError names the first bad field."""
    req = parse_body(body, CompletionRequest, fields)
    _refuse_unsupported(req)
    limits = limits or RequestLimits()
    num_prompts = len(prompt_inputs(req))  # also the shape check
    if req.best_of is not None and req.best_of != req.n:
        raise RequestError("best_of is not supported (only best_of equal to n)", "best_of")
    _check(limits, req, num_prompts)
    return req


def parse_chat_request(
    body: bytes | str | dict, limits: RequestLimits | None = None, fields: FieldPolicy | None = None
) -> ChatCompletionRequest:
    """Validate a `/v1/chat/completions` body within `limits`; RequestError names the first bad field."""
    req = parse_body(body, ChatCompletionRequest, fields)
    _refuse_unsupported(req)
    limits = limits or RequestLimits()
    if not req.messages:
        raise RequestError("messages must not be empty", "messages")
    check_messages(req.messages, limits)
    _check(limits, req, 1)
    for name in ("mm_processor_kwargs", "media_io_kwargs"):
        _check_json(limits, getattr(req, name), name)
    return req


def _refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    name = unsupported_field(req)
    if name is not None:
        raise RequestError(f"{name} is not supported by this server", name)


def check_messages(messages: list[ChatMessage], limits: RequestLimits) -> None:
    """Message and content-part counts, and the nesting of free-form part payloads."""
    if len(messages) > limits.max_messages:
        raise RequestError(
            f"messages: {len(messages)} messages; this server takes at most {limits.max_messages}", "messages"
        )
    parts = [p for m in messages if isinstance(m.content, list) for p in m.content]
    if len(parts) > limits.max_content_parts:
        raise RequestError(
            f"messages: {len(parts)} content parts; this server takes at most {limits.max_content_parts}",
            "messages",
        )
    for part in parts:
        if isinstance(part.image_url, dict):
            _check_json(limits, part.image_url, "messages.content.image_url")


def _check(limits: RequestLimits, req: CompletionRequest | ChatCompletionRequest, num_prompts: int) -> None:
    try:
        limits.check_sequences(num_prompts, req.n)
        limits.check_sampling(req)
    except InvalidParam as e:
        raise RequestError(str(e), e.param) from None


def _check_json(limits: RequestLimits, value: Any, param: str) -> None:
    try:
        limits.check_json(value, param)
    except InvalidParam as e:
        raise RequestError(str(e), e.param) from None


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


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    try:
        out = {int(k): float(v) for k, v in bias.items()}
    except ValueError:
        raise RequestError("logit_bias keys must be token ids", "logit_bias") from None
    if any(not 0 <= k < 2**31 for k in out):
        raise RequestError("logit_bias keys must be token ids", "logit_bias")
    return out


def to_sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    prompt_len: int,
    max_model_len: int,
    structured: StructuredSpec | None = None,
) -> SamplingParams:
    """The engine's sampling parameters for one prompt of `prompt_len` tokens (validated); `structured`
    is the request's output constraint (`ChatFeatures.constraint`)."""
    chat = isinstance(req, ChatCompletionRequest)
    logprobs: int | None
    prompt_param = "messages" if chat else "prompt"
    if prompt_len >= max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the {prompt_param}.",
            prompt_param,
        )
    if isinstance(req, ChatCompletionRequest):
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
        logit_bias=_logit_bias(req.logit_bias),
        allowed_token_ids=req.allowed_token_ids,
        bad_words=[req.bad_words] if isinstance(req.bad_words, str) else list(req.bad_words or []),
        logits_processor_args=dict(req.logits_processor_args or {}),
        structured=structured,
    )
    try:
        params.validate(MAX_LOGPROBS)
    except InvalidParam as e:
        if e.param == "max_tokens":
            raise RequestError(str(e).replace("max_tokens", max_param), max_param) from None
        raise RequestError(str(e), e.param) from None
    return params
