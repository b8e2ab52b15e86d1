"""Structured outputs, tool calling and reasoning for the OpenAI API: request side and output side.

Runs in the HTTP frontend and in batch mode (both hold one `ChatFeatures`, built once from the
`openai` flags). Request side: `constraint()` turns `response_format`, `structured_outputs` and a
`required` or named `tool_choice` into the `StructuredSpec` the workers enforce (tool calls are
forced in the tool parser's own format, so one parser reads every mode), refusing unsupported
combinations with a 400. Output side: `OutputParser` splits each choice's text into reasoning,
content and tool calls, whole or as streamed deltas (the same result either way).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, cast

from coreproc.base.errors import ConfigError
from coreproc.base.options import option
from coreproc.base.protocol import StructuredKind, StructuredSpec
from coreproc.text.openai_fields import FieldPolicy, NamedToolChoice
from coreproc.text.openai_protocol import ChatCompletionRequest, CompletionRequest, RequestError
from coreproc.text.reasoning import REASONING_PARSERS, ReasoningParser
from coreproc.text.tool_parsers import (
    TOOL_CALL_FORMATS,
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    ParsedTools,
    ToolDelta,
    ToolParser,
)

ToolParserName = Literal["hermes", "llama3_json"]
ReasoningParserName = Literal["qwen3", "deepseek_r1"]
REASONING_TAIL = 64  # prompt tokens searched for an open or closed <think> block
DEFAULT_TOOL_FORMAT = "hermes"  # how `required` / named tool choices are forced without --tool-call-parser


@dataclass(frozen=True)
class ChatFeatures:
    """How the OpenAI endpoints treat unknown fields, tool calls and reasoning text."""

    allow_unknown_fields: bool = option(
        "ignore request fields outside the API (logged once each) instead of answering 400", False
    )
    tool_call_parser: ToolParserName | None = option(
        "how the model writes tool calls: hermes (<tool_call>{json}</tool_call>: Qwen2.5, Hermes, ...) "
        "or llama3_json",
        None,
    )
    enable_auto_tool_choice: bool = option(
        'let the model decide to call tools (tool_choice "auto"; needs --tool-call-parser)', False
    )
    reasoning_parser: ReasoningParserName | None = option(
        "split <think>...</think> reasoning into reasoning_content: qwen3 or deepseek_r1", None
    )

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")

    def fields(self) -> FieldPolicy:
        return FieldPolicy(self.allow_unknown_fields)

    @property
    def tool_format(self) -> str:
        return self.tool_call_parser or DEFAULT_TOOL_FORMAT

    # ------------------------------------------------------------------ requests

    def tool_choice(self, req: ChatCompletionRequest) -> str | NamedToolChoice:
        """The effective tool choice ("none", "auto", "required" or a named function), checked."""
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if req.tools else "none"
        if not req.tools:
            if choice != "none":
                raise RequestError("tool_choice needs tools", "tool_choice")
            return choice
        if choice == "auto" and not self.enable_auto_tool_choice:
            raise RequestError(
                'tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
                '--tool-call-parser; send tool_choice "none", "required" or a named function',
                "tool_choice",
            )
        names = [t.function.name for t in req.tools]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise RequestError(
                f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice"
            )
        return choice

    def constraint(
        self, req: CompletionRequest | ChatCompletionRequest, tokenizer: Any, prompt_ids: list[int]
    ) -> StructuredSpec | None:
        """The output constraint a request asks for (None: free text)."""
        spec = _format_constraint(req)
        if isinstance(req, ChatCompletionRequest):
            tools = self._tools_constraint(req)
            if tools is not None and spec is not None:
                raise RequestError(
                    "response_format / structured_outputs cannot be combined with a required or named "
                    "tool_choice",
                    "tool_choice",
                )
            spec = spec or tools
        if spec is None or not isinstance(req, ChatCompletionRequest):
            return spec
        state = self._reasoning_state(tokenizer, prompt_ids)
        if not (state == "open" or (state == "none" and self.reasoning_parser == "deepseek_r1")):
            return spec  # no reasoning ahead (a qwen3 prompt without an open <think>: none allowed)
        end = tokenizer.encode(REASONING_PARSERS[self.reasoning_parser or ""].end, add_special_tokens=False)
        return StructuredSpec(kind=spec.kind, spec=spec.spec, after=end)  # the answer part only

    def _reasoning_state(self, tokenizer: Any, prompt_ids: list[int]) -> str | None:
        """Where the prompt leaves reasoning: "open" (it ends inside <think>), "closed" (thinking
        turned off: <think></think> written by the template), "none"; None without a parser."""
        if self.reasoning_parser is None:
            return None
        cls = REASONING_PARSERS[self.reasoning_parser]
        tail = tokenizer.decode(prompt_ids[-REASONING_TAIL:])
        start, end = tail.rfind(cls.start), tail.rfind(cls.end)
        return "open" if start > end else "closed" if end > start else "none"

    def _tools_constraint(self, req: ChatCompletionRequest) -> StructuredSpec | None:
        choice = self.tool_choice(req)
        if choice in ("none", "auto"):
            return None
        assert req.tools is not None
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        tools = [t for t in req.tools if named is None or t.function.name == named]
        begin, end = TOOL_CALL_FORMATS[self.tool_format]
        tags = [
            {
                "type": "tag",
                "begin": begin.replace("{name}", t.function.name),
                "content": {
                    "type": "json_schema",
                    "json_schema": t.function.parameters or {"type": "object"},
                },
                "end": end,
            }
            for t in tools
        ]
        one = named is not None or req.parallel_tool_calls is False
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True}
        tag = {"type": "structural_tag", "format": {**fmt, "stop_after_first": one}}
        return StructuredSpec(kind="structural_tag", spec=json.dumps(tag))

    def template_kwargs(self, req: ChatCompletionRequest) -> dict[str, Any]:
        """What the chat template sees beyond the messages: `tools` (as transformers passes them) and
        the request's `chat_template_kwargs`."""
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:
            kwargs["tools"] = [{"type": "function", "function": _plain(t.function)} for t in req.tools]
        return kwargs

    # ------------------------------------------------------------------ outputs

    def output_parser(
        self, req: CompletionRequest | ChatCompletionRequest, tokenizer: Any, prompt_ids: list[int]
    ) -> OutputParser | None:
        """A parser for one choice of `req`, or None when its text is the content as it is."""
        if not isinstance(req, ChatCompletionRequest):
            return None
        choice = self.tool_choice(req)
        tools = None
        if choice != "none":
            assert req.tools is not None
            names = [t.function.name for t in req.tools]
            tools = (
                _HermesOrJson(names)
                if self.tool_format == "hermes"
                else TOOL_PARSERS[self.tool_format](names)
            )
        state = self._reasoning_state(tokenizer, prompt_ids)
        reasoning = None
        if state is not None and state != "closed":
            reasoning = REASONING_PARSERS[self.reasoning_parser or ""](thinking=state == "open")
        if tools is None and reasoning is None:
            return None
        return OutputParser(reasoning, tools, named=isinstance(choice, NamedToolChoice))


FEATURE_SECTIONS: tuple[tuple[str, type], ...] = (("openai", ChatFeatures),)


class OutputParser:
    """One choice's text as OpenAI message fields: `reasoning_content`, `content`, `tool_calls`."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, named: bool) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.named = named
        self.num_calls = 0

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model called tools of its own choice, else the engine's."""
        return "tool_calls" if self.num_calls and not self.named and reason == "stop" else reason

    def message(self, text: str) -> dict[str, Any]:
        reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
        out: dict[str, Any] = {"role": "assistant"}
        if self.reasoning is not None:
            out["reasoning_content"] = reasoning
        if self.tools is None:
            out["content"] = content
            return out
        parsed = self.tools.parse(content or "")
        out["content"] = parsed.content
        self.num_calls = len(parsed.tool_calls)
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.tool_calls
        ]
        return out

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """Message deltas for a piece of the text (`final`: the text is complete)."""
        deltas: list[dict[str, Any]] = []
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if final:
                more = self.reasoning.finish()
                reasoning, content = reasoning + more[0], content + more[1]
            if reasoning:
                deltas.append({"reasoning_content": reasoning})
        else:
            content = text
        if self.tools is None:
            if content:
                deltas.append({"content": content})
            return deltas
        pieces = self.tools.feed(content) + (self.tools.finish() if final else [])
        deltas += [self._delta(p) for p in pieces]
        return deltas

    def _delta(self, piece: ToolDelta) -> dict[str, Any]:
        if piece.index is None:
            return {"content": piece.content}
        call: dict[str, Any] = {"index": piece.index}
        if piece.id is not None:
            self.num_calls = max(self.num_calls, piece.index + 1)
            call.update(id=piece.id, type="function")
        function: dict[str, Any] = {}
        if piece.name is not None:
            function["name"] = piece.name
        if piece.arguments is not None:
            function["arguments"] = piece.arguments
        call["function"] = function
        return {"tool_calls": [call]}


def _format_constraint(req: CompletionRequest | ChatCompletionRequest) -> StructuredSpec | None:
    """`response_format` or `structured_outputs` (not both) as a StructuredSpec."""
    rf, so = req.response_format, req.structured_outputs
    if rf is not None and rf.type != "text" and so is not None:
        raise RequestError(
            "send either response_format or structured_outputs, not both", "structured_outputs"
        )
    if rf is not None and rf.type == "json_object":
        return StructuredSpec(kind="json_object")
    if rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise RequestError("response_format json_schema needs json_schema.schema", "response_format")
        return StructuredSpec(kind="json", spec=json.dumps(rf.json_schema.schema))
    if so is None:
        return None
    given = {k: v for k, v in _plain(so).items() if v is not None and v is not False}
    if len(given) != 1:
        raise RequestError(
            "structured_outputs takes exactly one of json, json_object, regex, choice, grammar or "
            "structural_tag",
            "structured_outputs",
        )
    ((kind, value),) = given.items()
    if kind == "json_object":
        return StructuredSpec(kind="json_object")
    if not isinstance(value, str):
        value = json.dumps(value)
    return StructuredSpec(kind=cast(StructuredKind, kind), spec=value)


class _HermesOrJson(ToolParser):
    """hermes, except that an output that is one bare JSON call (`{"name": ..., "arguments": ...}`,
    as small models often write it, without the <tool_call> tags) is read as that call."""

    def __init__(self, names: list[str]) -> None:
        self.hermes, self.bare = HermesToolParser(names), Llama3JsonToolParser(names)
        self.chosen: ToolParser | None = None
        self.held = ""

    def parse(self, text: str) -> ParsedTools:
        return (self.bare if text.lstrip().startswith("{") else self.hermes).parse(text)

    def feed(self, delta: str) -> list[ToolDelta]:
        if self.chosen is not None:
            return self.chosen.feed(delta)
        self.held += delta
        if not self.held.strip():
            return []
        self.chosen = self.bare if self.held.lstrip().startswith("{") else self.hermes
        return self.chosen.feed(self.held)

    def finish(self) -> list[ToolDelta]:
        if self.chosen is None:
            self.chosen = self.hermes
            return self.chosen.feed(self.held) + self.chosen.finish()
        return self.chosen.finish()


def _plain(struct: Any) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(struct)
