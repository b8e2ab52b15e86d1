"""Tool-call parsing: turns a model's generated text into OpenAI `tool_calls` plus the remaining content.

Runs in the HTTP frontend and in batch mode, after detokenization; pure Python (no torch, no
transformers). `parse` takes a whole output; `feed`/`finish` take the same output in pieces and return
`ToolDelta`s for streamed chunks. Malformed output never raises: `parse` keeps it as content. Streaming
limitation: a call is announced once its name is valid and its arguments object has begun; if its JSON
breaks after that, the call stays as streamed and the rest of its block (llama3_json: output) is dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from typing import ClassVar
from uuid import uuid4

import msgspec

_WS = " \t\r\n"
_DECODER = json.JSONDecoder()
_KEY = re.compile(r'[ \t\r\n]*("(?:[^"\\]|\\.)*")[ \t\r\n]*:[ \t\r\n]*')  # a key and its colon
_COMMA = re.compile(r"[ \t\r\n]*,")
_LEAD = re.compile(r"[ \t\r\n]*(?:<\|python_tag\|>[ \t\r\n]*)?")
_OPEN, _CLOSE, _PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
_Call = tuple[str, str]  # (name, arguments text)


class ToolCall(msgspec.Struct, frozen=True):
    """One complete call; `arguments` is the JSON object's text exactly as the model wrote it."""

    id: str
    name: str
    arguments: str


class ParsedTools(msgspec.Struct, frozen=True):
    content: str | None
    tool_calls: list[ToolCall]


class ToolDelta(msgspec.Struct, frozen=True):
    """A streamed piece: plain `content`, or a piece of call `index` (its first piece carries id and name)."""

    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


def _new_id() -> str:
    return "call_" + uuid4().hex[:24]


def _skip_ws(text: str, i: int) -> int:
    return len(text) - len(text[i:].lstrip(_WS))


def _held(text: str, start: int, tag: str) -> int:
    """How many characters at the end of text[start:] could be the beginning of `tag`."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class _Scan:
    """Incremental scan of one JSON object from `start` (a "{") to where its brackets close (`end`)."""

    def __init__(self, start: int) -> None:
        self.start, self.pos, self.end = start, start + 1, -1
        self.closed: dict[int, int] = {}  # where each top-level value's brackets open -> close
        self._depth, self._in_string, self._escape, self._opened = 1, False, False, -1

    def run(self, text: str) -> None:
        i = self.pos
        while i < len(text) and self.end < 0:
            c = text[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
                self._opened = i if self._depth == 2 else self._opened
            elif c in "}]":
                self._depth -= 1
                if self._depth == 1:
                    self.closed[self._opened] = i + 1
                elif self._depth == 0:
                    self.end = i + 1
            i += 1
        self.pos = i

    def spans(self, text: str) -> dict[str, tuple[int, int]]:
        """Each top-level key's value span scanned so far; the end is -1 while the value is unfinished."""
        spans: dict[str, tuple[int, int]] = {}
        i = self.start + 1
        while (m := _KEY.match(text, i, self.pos)) and m.end() < self.pos:
            i = m.end()
            try:
                key = json.loads(m.group(1))
            except ValueError:
                return spans
            if text[i] in "{[":
                spans[key] = (i, self.closed.get(i, -1))
            else:
                try:
                    spans[key] = (i, _DECODER.raw_decode(text, i)[1])
                except ValueError:
                    spans[key] = (i, -1)
            if spans[key][1] < 0:
                return spans
            if not (m := _COMMA.match(text, spans[key][1], self.pos)):
                return spans
            i = m.end()
        return spans


class _Content:
    """Streams content with the whole content's leading and trailing whitespace left out."""

    def __init__(self) -> None:
        self.started, self.held = False, ""

    def add(self, piece: str) -> list[ToolDelta]:
        piece = self.held + piece if self.started else piece.lstrip()
        text = piece.rstrip()
        self.held = piece[len(text) :]
        if not text:
            return []
        self.started = True
        return [ToolDelta(content=text)]


class ToolParser:
    """Base: the streamed text so far and the bookkeeping of the call being streamed."""

    name: ClassVar[str] = ""
    _keys: ClassVar[tuple[str, ...]] = ("arguments",)  # where the arguments object may be, in preference
    _dropped = False  # an announced call broke (streaming), or a later one did (llama3_json)

    def __init__(
        self, tool_names: Collection[str] | None = None, make_id: Callable[[], str] | None = None
    ) -> None:
        self.tool_names = None if tool_names is None else frozenset(tool_names)
        self.make_id = make_id if make_id is not None else _new_id
        self._text = ""
        self._pos = 0  # the text before this is consumed
        self._content = _Content()
        self._index = 0  # calls announced so far
        self._sent = -1  # where the announced call's streamed arguments end; -1: none announced

    def parse(self, text: str) -> ParsedTools:
        """The whole output at once: one final step of a fresh parser, which announces only valid calls."""
        parser = type(self)(self.tool_names, self.make_id)
        parser._text = text
        deltas = parser._step(final=True)
        if parser._dropped:
            return ParsedTools(text.strip() or None, [])
        content = "".join(d.content for d in deltas if d.content is not None)
        calls = [ToolCall(d.id, d.name or "", d.arguments or "") for d in deltas if d.id is not None]
        return ParsedTools(content or None, calls)

    def feed(self, delta: str) -> list[ToolDelta]:
        self._text += delta
        return self._step(final=False)

    def finish(self) -> list[ToolDelta]:
        return self._step(final=True)

    def _step(self, final: bool) -> list[ToolDelta]:
        raise NotImplementedError

    def _name_ok(self, name: object) -> bool:
        return isinstance(name, str) and bool(name) and (self.tool_names is None or name in self.tool_names)

    def _call(self, text: str, scan: _Scan) -> _Call | None:
        """(name, arguments text) of a finished scanned object, or None if it is not a valid call."""
        try:
            obj = json.loads(text[scan.start : scan.end])
        except (ValueError, RecursionError):
            return None
        if not self._name_ok(obj.get("name")):
            return None
        for key in self._keys:
            if key in obj:
                start, end = scan.spans(text)[key]
                return (obj["name"], text[start:end]) if isinstance(obj[key], dict) else None
        return obj["name"], "{}"

    def _stream_call(self, scan: _Scan) -> list[ToolDelta]:
        """Announces the open call once its name is valid and its arguments object has begun; streams it."""
        text, spans = self._text, scan.spans(self._text)
        key = next((k for k in self._keys if k in spans), None)
        if key is None:
            return []
        start, end = spans[key]
        stop = end if end >= 0 else scan.pos
        if self._sent >= 0:
            piece, self._sent = text[self._sent : stop], stop
            return [ToolDelta(index=self._index, arguments=piece)] if piece else []
        name_start, name_end = spans.get("name", (0, -1))
        if name_end < 0 or text[name_start] != '"' or text[start] != "{":
            return []
        name = json.loads(text[name_start:name_end])
        if not self._name_ok(name):
            return []
        self._sent = stop
        return [ToolDelta(index=self._index, id=self.make_id(), name=name, arguments=text[start:stop])]

    def _end_call(self, call: _Call | None) -> list[ToolDelta]:
        """Closes the open call: announces it whole if it was not yet, and moves to the next index."""
        out = []
        if self._sent < 0 and call is not None:
            out = [ToolDelta(index=self._index, id=self.make_id(), name=call[0], arguments=call[1])]
        if self._sent >= 0 or call is not None:
            self._index += 1
        self._dropped |= self._sent >= 0 and call is None
        self._sent = -1
        return out


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3)."""

    name = "hermes"
    _begin = -1  # where the open block's opening tag is; -1 outside blocks
    _scan: _Scan | None = None

    def _step(self, final: bool) -> list[ToolDelta]:
        text, out = self._text, list[ToolDelta]()
        while True:
            if self._begin < 0:
                i = text.find(_OPEN, self._pos)
                if i < 0:
                    stop = len(text) - (0 if final else _held(text, self._pos, _OPEN))
                    out += self._content.add(text[self._pos : stop])
                    self._pos = stop
                    return out
                out += self._content.add(text[self._pos : i])
                self._begin, self._pos, self._scan = i, i, None
            result = self._outcome(text, final)
            if self._scan is not None and (result is None or self._sent >= 0):
                out += self._stream_call(self._scan)
            if result is None:
                return out
            end, call = result
            if call is None and self._sent < 0:
                out += self._content.add(text[self._begin : end])  # a broken block is content
            out += self._end_call(call)
            self._begin, self._pos = -1, end

    def _outcome(self, text: str, final: bool) -> tuple[int, _Call | None] | None:
        """(the open block's end, its call or None when malformed), or None while that is not known yet."""
        after = self._begin + len(_OPEN)
        if self._scan is None:
            j = _skip_ws(text, after)
            if j == len(text) and not final:
                return None
            if j == len(text) or text[j] != "{":
                return _broken(text, after, final)
            self._scan = _Scan(j)
        scan = self._scan
        scan.run(text)
        if scan.end < 0:
            return _broken(text, after, final) if final else None
        k = _skip_ws(text, scan.end)
        if text.startswith(_CLOSE, k):
            return k + len(_CLOSE), self._call(text, scan)
        if len(text) - k < len(_CLOSE) and _CLOSE.startswith(text[k:]):  # the output may end here
            return (len(text), self._call(text, scan)) if final else None
        return _broken(text, scan.end, final)


def _broken(text: str, start: int, final: bool) -> tuple[int, None] | None:
    """A malformed block runs to the first closing tag from `start`, or to the end of the output."""
    i = text.find(_CLOSE, start)
    if i >= 0:
        return i + len(_CLOSE), None
    return (len(text), None) if final else None


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON: `{"name": ..., "parameters": {...}}`, several joined by ";"; text after is content."""

    name = "llama3_json"
    _keys = ("parameters", "arguments")
    _mode = "start"  # start | call | after | content | drop
    _scan: _Scan | None = None

    def _step(self, final: bool) -> list[ToolDelta]:
        text, out = self._text, list[ToolDelta]()
        while True:
            if self._mode == "start":
                lead = _LEAD.match(text)
                assert lead is not None, "it matches the empty string"
                i = lead.end()
                if not final and (i == len(text) or _PYTHON_TAG.startswith(text[_skip_ws(text, 0) :])):
                    return out  # maybe the marker, not yet whole
                if i < len(text) and text[i] == "{":
                    self._mode, self._scan = "call", _Scan(i)
                else:
                    self._mode = "content"  # _pos is 0: all of it
            elif self._mode == "content":
                out += self._content.add(text[self._pos :])
                self._pos = len(text)
                return out
            elif self._mode == "call":
                assert self._scan is not None, "a call is being scanned"
                scan = self._scan
                scan.run(text)
                if (scan.end < 0 and not final) or self._sent >= 0:
                    out += self._stream_call(scan)
                if scan.end < 0 and not final:
                    return out
                call = self._call(text, scan) if scan.end >= 0 else None
                if call is None and self._index == 0 and self._sent < 0:
                    self._mode = "content"  # nothing announced yet: all of it is content, as in `parse`
                    continue
                out += self._end_call(call)
                self._mode, self._pos = ("after", scan.end) if call is not None else ("drop", len(text))
                self._dropped |= call is None
            elif self._mode == "after":
                k = _skip_ws(text, self._pos)
                if k == len(text):
                    return out
                if text[k] != ";":
                    self._mode = "content"  # the text after the calls
                    continue
                i = _skip_ws(text, k + 1)
                if i == len(text):
                    return out
                if text[i] == "{":
                    self._mode, self._scan = "call", _Scan(i)
                else:
                    self._mode, self._dropped = "drop", True
            else:
                return out


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}

# How one call is written, `{name}` standing for the tool's name; the arguments object goes in between.
TOOL_CALL_FORMATS: dict[str, tuple[str, str]] = {
    "hermes": ('<tool_call>\n{"name": "{name}", "arguments": ', "}\n</tool_call>"),
    "llama3_json": ('{"name": "{name}", "parameters": ', "}"),
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The tool parser class called `name`."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]
