"""Chat rendering: OpenAI messages -> prompt token ids through the checkpoint's chat template.

Runs where requests come in (the HTTP frontend, batch mode, the offline `LLM`), before the core sees them.
Receives messages as dicts or `ChatMessage` structs and returns token ids, rendered with Hugging Face
`apply_chat_template` semantics (tokenized without adding special tokens: a BOS appears only if the
template writes it). Content-part lists are flattened to text; anything the template or the message
shape cannot handle becomes a one-line `RequestError` (HTTP 400).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from coreproc.text.openai_protocol import ChatMessage, RequestError

TEXT_ONLY = "only text content is supported so far"


def _flatten(content: Any, index: int) -> str:
    """A message's content as one string (text parts joined by newlines, as vLLM does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"messages[{index}].content must be a string or a list of parts", "messages")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise RequestError(TEXT_ONLY, f"messages[{index}].content")
        text = part.get("text")
        if not isinstance(text, str):
            raise RequestError(f"messages[{index}].content: a text part needs a string 'text'", "messages")
        texts.append(text)
    return "\n".join(texts)


def template_messages(messages: list[dict] | list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the template sees them: dicts with string content (other keys kept)."""
    out = []
    for i, m in enumerate(messages):
        m = msgspec.to_builtins(m) if isinstance(m, ChatMessage) else m
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'", "messages")
        m = {**m, "content": _flatten(m.get("content"), i)}
        if m.get("tool_calls"):
            m["tool_calls"] = [_template_call(c, i) for c in m["tool_calls"]]
        out.append(m)
    return out


def _template_call(call: Any, index: int) -> Any:
    """A history tool call as templates expect it: `function.arguments` a dict, not JSON text."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"] or "{}")
    except json.JSONDecodeError:
        raise RequestError(
            f"messages[{index}].tool_calls: function.arguments is not valid JSON", "messages"
        ) from None
    return {**call, "function": {**fn, "arguments": arguments}}


def render_chat(
    tokenizer: Any,
    messages: list[dict] | list[ChatMessage],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Prompt token ids for a conversation (RequestError for unsupported content or template errors)."""
    import jinja2

    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model's tokenizer has no chat template, so it cannot serve chat requests")
    conversation = template_messages(messages)
    try:
        ids = tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **(template_kwargs or {}),
        )
    except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:  # raised while rendering
        raise RequestError(f"the chat template failed: {e}", "messages") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # older transformers may return an encoding
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]
