"""Engine settings said once: a config field's type, default, help and CLI spelling, as field metadata.

Imported in every process (part of the shared base: of Ember it imports only coreproc.base.errors). A field
declared with `option(...)` is an engine setting: `add_arguments` derives the argparse flags of every
command that builds an engine from it (type and `Literal` choices from the annotation, booleans as
--x / --no-x), `collect` turns parsed arguments into the flat keywords that `EngineConfig.create` and
`LLM(...)` take, and `defaults` is the one place defaults come from. A `derived` option has no
dataclass default: left unset (None), `EngineConfig.create` derives it from the model (its help says
how). Configs refuse a value with a `ConfigError` naming the option's keyword (`check_choices` does
it for every `Literal` option); `flags` is how a command says it with the flag instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from coreproc.base.errors import ConfigError

# a dataclass default of MISSING: the field is required when the dataclass is built directly
MISSING: Any = dataclasses.MISSING


@dataclass(frozen=True)
class Option:
    """How one config field appears to users."""

    help: str
    keyword: str = ""  # the `create()` / `LLM()` keyword; default: the field name
    flag: str = ""  # default: --keyword-with-dashes
    short: str | None = None
    default: Any = None  # what the CLI and `create()` use when the user says nothing
    derived: bool = False  # None means "derived from the model by EngineConfig.create"
    choices: tuple[Any, ...] | None = None  # beyond a Literal annotation (e.g. aliases)
    metavar: str | None = None
    hidden: bool = False  # set by Ember's own tools (e.g. `ember snapshot`), not shown in --help
    dest: str = ""  # argparse destination; default: the keyword
    repeat: bool = False  # a tuple option that adds up: --flag A --flag B (and --flag A B)


def option(
    help: str,
    default: Any = MISSING,
    *,
    derived: bool = False,
    factory: Callable[[], Any] | None = None,
    **kw: Any,
) -> Any:
    """A dataclass field that is an engine setting. `derived=True`: required in the dataclass, None
    (derive it) for users."""
    if derived:
        assert default is MISSING, "a derived option has no default of its own"
        return dataclasses.field(metadata={"option": Option(help, derived=True, **kw)})
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"option": Option(help, **kw)})
    return dataclasses.field(default=default, metadata={"option": Option(help, default=default, **kw)})


@dataclass(frozen=True)
class Setting:
    """An option as bound to its section's field (what the CLI, `create()` and tests walk)."""

    section: str
    field: str
    option: Option
    annotation: Any

    @property
    def keyword(self) -> str:
        return self.option.keyword or self.field

    @property
    def flag(self) -> str:
        return self.option.flag or "--" + self.keyword.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.option.dest or self.keyword

    @property
    def default(self) -> Any:
        return None if self.option.derived else self.option.default


def settings(sections: tuple[tuple[str, type], ...]) -> Iterator[Setting]:
    """Every option of the given (title, dataclass) sections, in declaration order."""
    for title, cls in sections:
        yield from _section(title, cls)


@functools.cache
def _section(title: str, cls: type) -> tuple[Setting, ...]:
    """The options of one section (resolving a dataclass's annotations takes a millisecond: once)."""
    hints = typing.get_type_hints(cls)
    fields = [(f.name, f.metadata.get("option")) for f in dataclasses.fields(cls)]
    return tuple(Setting(title, name, opt, hints[name]) for name, opt in fields if opt is not None)


def flags(sections: tuple[tuple[str, type], ...]) -> dict[str, str]:
    """Each option's keyword -> its flag: how a command says a `ConfigError` (`ConfigError.said_with`)."""
    return {s.keyword: s.flag for s in settings(sections)}


@functools.cache
def _literal_settings(cls: type) -> list[tuple[Setting, tuple[Any, ...]]]:
    """The options of `cls` annotated with a `Literal`, with its values (None too where allowed)."""
    found = []
    for s in settings(((cls.__name__, cls),)):
        base = _base_type(s.annotation)
        if typing.get_origin(base) is Literal:
            none = (None,) if base is not s.annotation else ()  # `Literal[...] | None`
            found.append((s, (*typing.get_args(base), *none)))
    return found


def check_choices(config: Any) -> None:
    """Each `Literal` option of a config dataclass holds one of its values: what the CLI's choices
    check, checked for `create()` and `LLM(...)` too (ConfigError naming the keyword)."""
    for s, allowed in _literal_settings(config.__class__):
        value = getattr(config, s.field)
        if value not in allowed:
            named = ", ".join(str(a) for a in allowed if a is not None)
            raise ConfigError(f"unknown {s.keyword} {value!r}; choose one of {named}", option=s.keyword)


def at_least(config: Any, low: int, *fields: str) -> None:
    """Each named option field of a config dataclass (a field named as its keyword) is unset (None) or
    at least `low` (ConfigError naming it)."""
    for name in fields:
        value = getattr(config, name)
        if value is not None and value < low:
            raise ConfigError.bad(name, f"must be at least {low}, got {value}")


def _base_type(annotation: Any) -> Any:
    """`int | None` -> int; Literal and tuple annotations are returned as they are."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        assert len(args) == 1, f"an option has one type besides None, got {annotation}"
        return args[0]
    return annotation


def _argparse_kwargs(s: Setting) -> dict[str, Any]:
    base = _base_type(s.annotation)
    kw: dict[str, Any] = {"dest": s.dest, "default": s.default}
    shown = "" if s.default in (None, (), "") or s.option.derived else " [%(default)s]"
    kw["help"] = argparse.SUPPRESS if s.option.hidden else s.option.help.replace("%", "%%") + shown
    if s.option.metavar:
        kw["metavar"] = s.option.metavar
    if base is bool:
        kw["action"] = argparse.BooleanOptionalAction
        return kw
    if typing.get_origin(base) is Literal:
        kw["choices"] = list(typing.get_args(base))
        kw["type"] = type(kw["choices"][0])
    elif typing.get_origin(base) is tuple and s.option.repeat:
        kw.update(action="extend", nargs="+", default=list(s.default))
    elif typing.get_origin(base) is tuple:
        kw["nargs"] = "*"
    elif base in (int, float, str):
        kw["type"] = base
    else:  # structured values (JSON text on the command line), parsed by `create()`
        kw["type"] = str
    if s.option.choices is not None:
        kw["choices"] = list(s.option.choices)
    if "choices" not in kw and "metavar" not in kw:  # named after the flag, not the destination
        kw["metavar"] = s.flag.lstrip("-").replace("-", "_").upper()
    return kw


def add_arguments(parser: argparse.ArgumentParser, sections: tuple[tuple[str, type], ...]) -> None:
    """One argument group per section, one flag per option."""
    groups: dict[str, Any] = {}
    for s in settings(sections):
        if s.section not in groups:
            groups[s.section] = parser.add_argument_group(s.section)
        flags = [s.flag] + ([s.option.short] if s.option.short else [])
        groups[s.section].add_argument(*flags, **_argparse_kwargs(s))


def collect(args: argparse.Namespace, sections: tuple[tuple[str, type], ...]) -> dict[str, Any]:
    """The parsed options as `create()` keywords (lists from nargs flags become tuples)."""
    out = {}
    for s in settings(sections):
        value = getattr(args, s.dest)
        out[s.keyword] = tuple(value) if isinstance(value, list) else value
    return out


def defaults(sections: tuple[tuple[str, type], ...]) -> dict[str, Any]:
    """Every option's default by keyword (None for derived ones)."""
    return {s.keyword: s.default for s in settings(sections)}
