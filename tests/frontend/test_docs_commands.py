"""Every `ember …` command line shown in README.md and docs/*.md parses with the current `ember` command.

Runs in the test process (marker unit): reads the Markdown, builds the real parser of the `ember` command
for each line (`frontend.cli.parser_for`, the one `ember` itself uses) and parses the line; nothing is
started. A doc that shows a renamed or removed flag, a bad choice or a value of the wrong type fails here,
named by file and line, with argparse's message. Relative links between the pages are checked too.

What counts as a command line: in a fenced block whose info string names a shell (bash, sh, shell,
console, zsh), a line that starts with `ember ` (after an optional `$ ` prompt and `NAME=value`
environment settings); a line ending in `\\` goes on with the next. Other blocks hold program output,
tables, diagrams, Python or YAML, and are not read.

How a line is read (the synopsis notation the docs use):
- a `# comment`, and everything from a shell operator (`|`, `||`, `&&`, `;`, `&`, a redirection) on,
  is dropped;
- outside quotes, `[` and `]` are synopsis brackets: dropped, so an optional part is checked as if given;
- a `...` word stands for "more flags" and is dropped;
- a word listing alternatives, `a|b|c` or `{a,b,c}`, is checked once with each alternative;
- placeholders (`MODEL`, `DIR`, `OUT_DIR`, `<path>`) stand as positional or string values; a flag that
  takes a number must show a number;
- a line that uses shell expansion (`$VAR`, `${...}`, `$(...)`) is skipped: its values are unknown;
- `ember snapshot create DIR -- ARGS` is checked as `ember serve ARGS` too.
"""

from __future__ import annotations

import io
import re
import shlex
from contextlib import redirect_stderr, redirect_stdout

import pytest

from frontend.cli import parser_for
from tests.paths import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELLS = {"bash", "sh", "shell", "console", "zsh"}
COMMAND = re.compile(r"^(?:\$ )?(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(ember\s.*)$")
OPERATORS = {"|", "||", "&&", ";", "&"}
REDIRECT = re.compile(r"^\d*[<>]")
ALTERNATIVES = re.compile(r"^(--?[\w-]+=)?(?:([\w./-]+(?:\|[\w./-]+)+)|\{([\w./-]+(?:,[\w./-]+)+)\})$")
EXPANSION = re.compile(r"\$[A-Za-z_{(]")
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")


def fenced_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, the block's language, the line) for every line inside a fenced block."""
    out: list[tuple[int, str, str]] = []
    fence, lang = "", ""
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if not fence and m:
            fence, lang = m.group(1), m.group(2).lower()
        elif fence and m and m.group(1).startswith(fence) and not m.group(2):
            fence = ""
        elif fence:
            out.append((number, lang, line))
    return out


def command_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command) for each `ember` command line of a page's shell blocks, continuations joined."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, lang, line in fenced_lines(text):
        if lang not in SHELLS:
            continue
        if pending is not None:
            start, head = pending
            joined = head + " " + line.strip()
        else:
            m = COMMAND.match(line.strip())
            if m is None:
                continue
            start, joined = number, m.group(1)
        if joined.endswith("\\"):
            pending = (start, joined[:-1].rstrip())
        else:
            pending = None
            out.append((start, joined))
    return out


def drop_brackets(line: str) -> str:
    """The line without the synopsis brackets `[` `]` that stand outside quotes."""
    out, quote = [], ""
    for ch in line:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[]":
            continue
        out.append(ch)
    return "".join(out)


def argvs(line: str) -> list[list[str]]:
    """The argument lists (after `ember`) a documented line stands for: one per alternative shown."""
    words = shlex.split(drop_brackets(line), comments=True)[1:]
    for i, word in enumerate(words):
        if word in OPERATORS or REDIRECT.match(word):
            words = words[:i]
            break
    choices: list[list[str]] = []
    for word in words:
        if word in ("...", "…"):
            continue
        m = ALTERNATIVES.match(word)
        if m is None:
            choices.append([word])
        else:
            prefix = m.group(1) or ""
            options = m.group(2).split("|") if m.group(2) else m.group(3).split(",")
            choices.append([prefix + option for option in options])
    width = max((len(c) for c in choices), default=1)
    return [[c[min(i, len(c) - 1)] for c in choices] for i in range(width)]


def parse_error(argv: list[str]) -> str | None:
    """argparse's message for `ember ARGV`, or None when it parses (`--help` parses)."""
    err = io.StringIO()
    try:
        with redirect_stderr(err), redirect_stdout(io.StringIO()):
            args = parser_for(argv).parse_args(argv)
    except SystemExit as e:
        return None if e.code in (0, None) else err.getvalue().strip() or f"exit status {e.code}"
    if getattr(args, "snapshot_command", None) == "create":
        serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
        return parse_error(["serve", *serve_args])
    return None


def collect() -> list[tuple[str, int, str]]:
    found = []
    for page in PAGES:
        for number, line in command_lines(page.read_text(encoding="utf-8")):
            found.append((page.relative_to(REPO).as_posix(), number, line))
    return found


DOC_COMMANDS = collect()


@pytest.mark.unit
@pytest.mark.parametrize(
    "page, number, line", DOC_COMMANDS, ids=[f"{page}:{number}" for page, number, _ in DOC_COMMANDS]
)
def test_documented_command_parses(page: str, number: int, line: str) -> None:
    if EXPANSION.search(line):
        pytest.skip(f"{page}:{number} uses shell expansion; its values are unknown")
    for argv in argvs(line):
        problem = parse_error(argv)
        assert problem is None, f"{page}:{number}: `ember {shlex.join(argv)}` does not parse: {problem}"


@pytest.mark.unit
def test_the_docs_show_commands() -> None:
    """The collector finds the command lines (a broken collector would pass every page)."""
    pages = {page for page, _, _ in DOC_COMMANDS}
    assert len(DOC_COMMANDS) >= 30 and {"docs/COMMANDS.md", "docs/RESTARTS.md", "docs/SCALING.md"} <= pages


@pytest.mark.unit
def test_reading_a_page() -> None:
    page = (
        "```bash\n$ ember serve MODEL --port 8000 \\\n    --host 0.0.0.0   # a comment\n"
        "EMBER_X=1 ember bench throughput [--mode inproc|multiproc] ... | tee log\nls\n```\n"
        "```\nember   ember-serve 0.1.0   (output, not a command)\n```\n"
        "```python\n# ember serve --not-read\n```\n"
    )
    lines = command_lines(page)
    assert lines == [
        (2, "ember serve MODEL --port 8000 --host 0.0.0.0   # a comment"),
        (4, "ember bench throughput [--mode inproc|multiproc] ... | tee log"),
    ]
    assert argvs(lines[1][1]) == [
        ["bench", "throughput", "--mode", "inproc"],
        ["bench", "throughput", "--mode", "multiproc"],
    ]
    assert argvs("ember make-model D --arch {llama,qwen2} --size tiny")[1] == [
        "make-model",
        "D",
        "--arch",
        "qwen2",
        "--size",
        "tiny",
    ]
    assert argvs("ember serve M --limit-mm-per-prompt '{\"image\": [4]}'")[0][-1] == '{"image": [4]}'


@pytest.mark.unit
@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "MODEL", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["serve", "MODEL", "--port", "P"], "invalid int value"),
        (["bench", "latency", "--workload", "nonsense"], "invalid choice"),
        (["snapshot", "create", "DIR", "--", "MODEL", "--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_a_wrong_line_fails(argv: list[str], message: str) -> None:
    problem = parse_error(argv)
    assert problem is not None and message in problem


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings (lower case, punctuation dropped, spaces to hyphens)."""
    inside = {number for number, _, _ in fenced_lines(text)}
    anchors: set[str] = set()
    count: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)
        if m is None or number in inside:
            continue
        base = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = count.get(base, 0)
        anchors.add(f"{base}-{n}" if n else base)  # a repeated heading gets -1, -2, ...
        count[base] = n + 1
    return anchors


def links() -> list[tuple[str, int, str]]:
    out = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        inside = {number for number, _, _ in fenced_lines(text)}
        for number, line in enumerate(text.splitlines(), 1):
            if number in inside:
                continue
            for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
                if not re.match(r"^[a-z]+:", target):
                    out.append((page.relative_to(REPO).as_posix(), number, target))
    return out


DOC_LINKS = links()


@pytest.mark.unit
@pytest.mark.parametrize("page, number, target", DOC_LINKS, ids=[f"{p}:{n}" for p, n, _ in DOC_LINKS])
def test_link_resolves(page: str, number: int, target: str) -> None:
    path, _, anchor = target.partition("#")
    file = (REPO / page).parent / path if path else REPO / page
    assert file.exists(), f"{page}:{number}: {target} names no file"
    if anchor and file.suffix == ".md":
        anchors = heading_anchors(file.read_text(encoding="utf-8"))
        assert anchor in anchors, f"{page}:{number}: {target}: no heading with that anchor"
