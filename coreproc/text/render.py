"""Turns an OpenAI request into engine prompts, and finished results into an OpenAI response body.

Runs in the HTTP frontend and in batch mode (both share it). `render_prompts` tokenizes completion
prompts (strings or token ids, checked against the vocabulary) or renders chat messages with the chat
template; a chat's image parts ride on its `Prompt` (one image token each in the ids) until
`take_images` (or `take_images_async`) has the intake load, process and expand them into
`mm_refs`; `response_body` builds the `text_completion` / `chat.completion` object, usage included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from coreproc.base.protocol import MultiModalRef
from coreproc.text import openai_protocol as oai
from coreproc.text import openai_responses as oresp
from coreproc.text.chat import chat_images, render_chat
from coreproc.text.chat_features import ChatFeatures
from coreproc.text.media import ImagePart, MediaIntake
from coreproc.text.media_config import MediaKwargs
from coreproc.text.openai_protocol import ChatCompletionRequest, CompletionRequest, RequestError
from coreproc.text.outputs import RequestOutput


class Prompt(NamedTuple):
    """One prompt of a request, as rendered."""

    text: str | None  # None for token-id prompts and chats
    ids: list[int]
    images: tuple[ImagePart, ...] = ()  # a chat's image parts not yet taken in (one image token each)
    mm_refs: tuple[MultiModalRef, ...] = ()  # once taken in: `ids` expanded, one ref per image


def render_prompts(
    req: CompletionRequest | ChatCompletionRequest,
    tokenizer: Any,
    vocab_size: int,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    takes_images: bool = False,
) -> list[Prompt]:
    """One prompt per chat request; one per entry of a completion request's `prompt`. A chat's image
    parts are a 400 unless the model `takes_images`."""
    if isinstance(req, ChatCompletionRequest):
        ids = render_chat(
            tokenizer,
            req.messages,
            chat_template,
            add_generation_prompt=req.add_generation_prompt,
            template_kwargs=template_kwargs,
            takes_images=takes_images,  # else image parts are refused
        )
        return [Prompt(None, ids, tuple(chat_images(req.messages)))]
    out: list[Prompt] = []
    for p in oai.prompt_inputs(req):
        if isinstance(p, str):
            out.append(Prompt(p, tokenizer(p).input_ids))
            continue
        if any(t < 0 or t >= vocab_size for t in p):
            raise RequestError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
        out.append(Prompt(tokenizer.decode(p) if req.echo else None, p))
    return out


def take_images(prompt: Prompt, intake: MediaIntake | None, kwargs: MediaKwargs | None = None) -> Prompt:
    """The prompt with its images loaded, processed and expanded (sync: batch mode, `LLM`)."""
    if not prompt.images:
        return prompt
    assert intake is not None, "render_prompts refuses images without takes_images"
    ids, refs = intake.take(prompt.ids, prompt.images, kwargs)
    return Prompt(prompt.text, ids, (), tuple(refs))


async def take_images_async(
    prompt: Prompt, intake: MediaIntake | None, kwargs: MediaKwargs | None = None
) -> Prompt:
    """`take_images` off the event loop (the HTTP server)."""
    if not prompt.images:
        return prompt
    assert intake is not None, "render_prompts refuses images without takes_images"
    ids, refs = await intake.take_async(prompt.ids, prompt.images, kwargs)
    return Prompt(prompt.text, ids, (), tuple(refs))


def response_body(
    req: CompletionRequest | ChatCompletionRequest,
    results: list[RequestOutput],
    model: str,
    created: int,
    hexid: str,
    decode: Callable[[int], str],
    features: ChatFeatures | None = None,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """The non-streaming response of one request, from its finished results (one per prompt);
    `features` parse reasoning and tool calls out of chat choices."""
    usage = oresp.usage_of(results)
    if isinstance(req, ChatCompletionRequest):
        top = (req.top_logprobs or 0) if req.logprobs else None
        choices = [
            oresp.chat_choice(
                o,
                top,
                features.output_parser(req, tokenizer, results[0].prompt_token_ids) if features else None,
            )
            for o in results[0].outputs
        ]
        return oresp.chat_completion_response(f"chatcmpl-{hexid}", model, created, choices, usage)
    choices = []
    for k, r in enumerate(results):
        choices += oresp.completion_choices(
            r,
            echo=req.echo,
            logprobs=req.logprobs,
            first_index=k * req.n,
            decode=decode,
            as_ids=req.return_tokens_as_token_ids,
        )
    return oresp.completion_response(f"cmpl-{hexid}", model, created, choices, usage)
