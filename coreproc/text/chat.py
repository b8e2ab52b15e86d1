"""Chat rendering: OpenAI messages -> prompt token ids through the checkpoint's chat template.

Runs where requests come in (the HTTP frontend, batch mode, the offline `LLM`), before the core sees them.
Receives messages as dicts or `ChatMessage` structs and returns token ids, rendered with Hugging Face
`apply_chat_template` semantics (tokenized without adding special tokens: a BOS appears only if the
template writes it). Content-part lists are flattened to text, except in a message with image parts
(`image_url`, `image`, `input_image`), which keeps its parts as transformers' processors pass them
(`{"type": "image"}` for each image, so the template writes its image token there); `chat_images`
lists those parts' URLs for the intake (`coreproc.text.media`). Anything the template or the message
shape cannot handle becomes a one-line `RequestError` (HTTP 400).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from coreproc.text.media import ImagePart
from coreproc.text.openai_protocol import ChatMessage, RequestError

TEXT_ONLY = "this model does not take image input"  # image parts sent to a text-only model
IMAGE_TYPES = ("image_url", "image", "input_image")


def _parts(content: Any, index: int) -> list[dict[str, Any]] | None:
    """A list content's parts, checked to be text or image parts (None for string or null content)."""
    if content is None or isinstance(content, str):
        return None
    if not isinstance(content, list):
        raise RequestError(f"messages[{index}].content must be a string or a list of parts", "messages")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise RequestError(
                    f"messages[{index}].content: a text part needs a string 'text'", "messages"
                )
        elif kind not in IMAGE_TYPES:
            raise RequestError(
                f"messages[{index}].content[{j}]: content parts of type {kind!r} are not supported "
                "(text and images only)",
                f"messages[{index}].content",
            )
    return content


def _image_url(part: dict[str, Any], where: str) -> str:
    """The URL of an image part: `image_url` {"url": ...} or a string; `image` for type "image"."""
    value = part.get("image") if part["type"] == "image" and part.get("image") is not None else None
    value = value if value is not None else part.get("image_url")
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise RequestError(f"{where}: an image part needs its URL (image_url.url)", where)
    return value


def chat_images(messages: list[dict] | list[ChatMessage]) -> list[ImagePart]:
    """The image parts of a conversation, in order, with their URLs."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, ChatMessage):
            content = msgspec.to_builtins(m.content)
        else:
            content = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(_parts(content, i) or []):
            if part["type"] != "text":
                where = f"messages[{i}].content[{j}]"
                out.append(ImagePart(_image_url(part, where), where))
    return out


def _template_content(content: Any, index: int, takes_images: bool) -> Any:
    """A message's content for the template: one string (text parts joined by newlines, as vLLM does),
    or, with image parts, the parts (`{"type": "image"}` for images) as transformers passes them."""
    parts = _parts(content, index)
    if parts is None:
        return content or ""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    if not takes_images:
        where = f"messages[{index}].content"
        first = next(j for j, p in enumerate(parts) if p["type"] != "text")
        raise RequestError(f"{where}[{first}]: {TEXT_ONLY}", where)
    return [{"type": "text", "text": p["text"]} if p["type"] == "text" else {"type": "image"} for p in parts]


def template_messages(
    messages: list[dict] | list[ChatMessage], takes_images: bool = False
) -> list[dict[str, Any]]:
    """Messages as the template sees them: dicts with string content, or parts where images are
    (`takes_images`; else image parts are a 400), other keys kept."""
    out = []
    for i, m in enumerate(messages):
        m = msgspec.to_builtins(m) if isinstance(m, ChatMessage) else m
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'", "messages")
        m = {**m, "content": _template_content(m.get("content"), i, takes_images)}
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
    takes_images: bool = False,
) -> list[int]:
    """Prompt token ids for a conversation (RequestError for unsupported content or template errors);
    with `takes_images`, each image part is the template's image token (one; `media` expands it)."""
    import jinja2

    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model's tokenizer has no chat template, so it cannot serve chat requests")
    conversation = template_messages(messages, takes_images)
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
