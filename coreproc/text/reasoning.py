"""Reasoning parsing: splits a model's `<think>…</think>` reasoning from its answer.

Runs in the HTTP frontend and in batch mode, after detokenization; pure Python (no torch, no
transformers). `split` takes a whole output and returns (reasoning, content); `feed`/`finish` take the
same output in pieces and return (reasoning piece, content piece), holding back a partial tag. Both keep
the text exactly as written; None (streaming: "") stands for empty. Whether an output begins inside
reasoning is known from its first characters (`<think>`) and from the prompt (`thinking`: the chat
template left a `<think>` open), so answers without reasoning stream at once.
"""

from __future__ import annotations

from typing import ClassVar


class ReasoningParser:
    """Base: `start`/`end` tags; subclasses say when an output begins inside reasoning. `thinking`:
    the prompt ends inside an open reasoning block (the template wrote `<think>`)."""

    name: ClassVar[str] = ""
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"

    def __init__(self, thinking: bool = False) -> None:
        self.thinking = thinking
        self._text = ""
        self._opened: bool | None = None  # whether the output starts with `start`; None until known
        self._ended = False  # whether `end` has been seen
        self._pos = 0  # the text before this has been returned
        self._search = 0  # where to look for `end` next

    def _reasoning_first(self, opened: bool) -> bool:
        """Whether the output begins with reasoning (up to `end`), else it is all content."""
        raise NotImplementedError

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output."""
        opened = text.startswith(self.start)
        if not self._reasoning_first(opened):
            return None, text or None
        body = text[len(self.start) :] if opened else text
        i = body.find(self.end)
        if i >= 0:
            return body[:i] or None, body[i + len(self.end) :] or None
        return body or None, None

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning piece, content piece) for the next piece of the output."""
        self._text += delta
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        """The pieces held back until the end of the output."""
        return self._step(final=True)

    def _step(self, final: bool) -> tuple[str, str]:
        text, reasoning = self._text, ""
        if self._opened is None:
            if not final and len(text) < len(self.start) and self.start.startswith(text):
                return "", ""
            self._opened = text.startswith(self.start)
            self._pos = self._search = len(self.start) if self._opened else 0
            self._ended = not self._reasoning_first(self._opened)  # no reasoning: all content
        if not self._ended:
            i = text.find(self.end, self._search)
            if i >= 0:
                reasoning, self._ended, self._pos = text[self._pos : i], True, i + len(self.end)
            else:  # until `end` comes, this is reasoning
                stop = len(text) if final else len(text) - _held(text, self._pos, self.end)
                reasoning, self._pos = text[self._pos : stop], stop
            self._search = max(self._search, len(text) - len(self.end) + 1)
        if not self._ended:
            return reasoning, ""
        content, self._pos = text[self._pos :], len(text)
        return reasoning, content


def _held(text: str, start: int, tag: str) -> int:
    """How many characters at the end of text[start:] could be the beginning of `tag`."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class DeepSeekR1ReasoningParser(ReasoningParser):
    """The prompt ends with `<think>`, so the output may not repeat it; without `</think>`, all reasoning."""

    name = "deepseek_r1"

    def _reasoning_first(self, opened: bool) -> bool:
        return True


class Qwen3ReasoningParser(ReasoningParser):
    """Reasoning first when the output opens with `<think>` or the prompt left one open; otherwise
    (thinking turned off, or a model that does not think) all of it is content."""

    name = "qwen3"

    def _reasoning_first(self, opened: bool) -> bool:
        return opened or self.thinking


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The reasoning parser class called `name`."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]
