"""The files of `ember batch`: OpenAI batch input lines in, one durable output record per request out.

Input lines are checked one by one (a bad line becomes an error record for that line only). The output
is appended a whole line at a time and fsynced; a rerun reads what an earlier run wrote (`scan_output`),
cutting off a line torn by a kill, so that custom_ids already answered are skipped.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import msgspec

from coreproc.base.errors import EmberError

URLS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


# ----------------------------------------------------------------------------- input lines


class LineError(Exception):
    """An input line that is not a valid batch request; becomes an error record for that line only."""

    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.custom_id = custom_id


@dataclass(frozen=True)
class BatchItem:
    line_no: int
    custom_id: str
    kind: str  # "completion" | "chat"
    body: dict


def parse_line(line_no: int, raw: bytes, seen: set[str]) -> BatchItem:
    """One input line; `seen` collects custom_ids so duplicates are refused (LineError)."""
    fail = lambda code, message, cid=None: LineError(code, f"line {line_no}: {message}", cid)
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise fail("invalid_json", f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise fail("invalid_line", "a batch line must be a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise fail("missing_custom_id", "custom_id must be a non-empty string")
    if cid in seen:
        raise fail("duplicate_custom_id", f"custom_id {cid!r} is used by an earlier line", cid)
    seen.add(cid)
    if obj.get("method", "POST") != "POST":
        raise fail("invalid_method", "method must be POST", cid)
    url = obj.get("url")
    if not isinstance(url, str) or url not in URLS:  # a dict or list url is unhashable
        raise fail("invalid_url", f"url must be one of {', '.join(URLS)}; got {url!r}", cid)
    if not isinstance(obj.get("body"), dict):
        raise fail("missing_body", "body must be a JSON object", cid)
    return BatchItem(line_no, cid, URLS[url], obj["body"])


def read_lines(stream: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, content) of every non-blank line."""
    for n, raw in enumerate(stream, 1):
        if raw.strip():
            yield n, raw


def count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


# ----------------------------------------------------------------------------- output records


@dataclass(frozen=True)
class Answered:
    """What an earlier run already wrote: custom_ids with a response, and line-error messages."""

    custom_ids: frozenset[str] = frozenset()
    line_errors: frozenset[str] = frozenset()


def scan_output(path: str) -> Answered:
    """Read an earlier run's output (if any), cutting off a partial last line (killed mid-write)."""
    ids: set[str] = set()
    errors: set[str] = set()
    if not os.path.exists(path):
        return Answered()
    good_end = 0
    with open(path, "r+b") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            good_end += len(raw)
            try:
                rec = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                continue
            if not isinstance(rec, dict):
                continue
            if rec.get("response") is not None and isinstance(rec.get("custom_id"), str):
                ids.add(rec["custom_id"])
            elif isinstance(rec.get("error"), dict):
                errors.add(str(rec["error"].get("message")))
        f.truncate(good_end)
    return Answered(frozenset(ids), frozenset(errors))


class RecordSink:
    """Appends one JSON record per line and makes it durable before returning.

    A record that cannot be written whole (disk full, file size limit, I/O error) is cut off again, so
    the file only ever holds whole lines, and the run stops with an `EmberError` naming the file: its
    request is not answered, and a rerun with the same output redoes it."""

    def __init__(self, path: str) -> None:
        self.path, self.to_stdout = path, path == "-"
        self.unwritten = 0  # records that could not be written (their requests are not answered)
        try:
            self.fd = -1 if self.to_stdout else os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise EmberError(f"cannot write the output file {path}: {e.strerror}") from None

    def write(self, record: dict[str, Any]) -> None:
        data = msgspec.json.encode(record) + b"\n"
        if self.to_stdout:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
            return
        end = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view) :]
            os.fsync(self.fd)
        except OSError as e:
            self.unwritten += 1
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, end)
            raise EmberError(f"cannot write the output file {self.path}: {e.strerror}") from None

    def close(self) -> None:
        if not self.to_stdout:
            os.close(self.fd)


def record(custom_id: str | None, response: dict | None = None, error: dict | None = None) -> dict[str, Any]:
    """One OpenAI batch output line: a response (any status) or a line-level error."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }
