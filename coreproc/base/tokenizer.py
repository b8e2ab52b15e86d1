"""Loads a checkpoint's tokenizer and the ids that end generation, without importing transformers.

Runs where text comes in and goes out (the HTTP frontend, batch mode, the offline API), and once in
`ModelConfig.from_dir` (which records the EOS ids in the config: the core never loads a tokenizer).
`Tokenizer` wraps a `tokenizers.Tokenizer` (tokenizer.json) with the parts of transformers' fast
tokenizer Ember uses: encode/decode, the special tokens of tokenizer_config.json and
special_tokens_map.json, and `apply_chat_template` rendered in a sandboxed jinja2 environment as
transformers 5 renders it. Only the local folder is read (never a hub). EOS ids are the union of the
tokenizer's EOS token and generation_config.json's `eos_token_id` (an int or a list), as Hugging Face
`generate()` uses them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

# transformers' named special tokens, in its order (all_special_tokens lists them in this order)
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# a message's reasoning may come under any of these names; templates read the first
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# transformers' apply_chat_template options that change its output and that Ember does not implement
UNSUPPORTED_CHAT_OPTIONS = (
    "continue_final_message",
    "return_assistant_tokens_mask",
    "sanitize_control_tokens",
)
# transformers' clean_up_tokenization, in its order (used only if tokenizer_config.json asks, never for BPE)
CLEAN_UP: tuple[tuple[str, str], ...] = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"))
CLEAN_UP += ((" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
_COMPILED_TEMPLATES_KEPT = 16


@dataclasses.dataclass(frozen=True)
class Encoding:
    """What calling the tokenizer returns; reads like transformers' BatchEncoding (`.input_ids`)."""

    input_ids: list[int]

    def __getitem__(self, key: str) -> list[int]:
        if key == "attention_mask":
            return [1] * len(self.input_ids)
        if key != "input_ids":
            raise KeyError(key)
        return self.input_ids


class Tokenizer:
    """transformers' fast tokenizer reduced to what Ember uses; build it with `load_tokenizer`."""

    def __init__(
        self,
        backend: Backend,
        special_tokens_map: dict[str, str],
        extra_special_tokens: list[str],
        chat_template: str | dict[str, str] | None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self.backend_tokenizer = backend
        self.special_tokens_map = special_tokens_map  # named tokens: the chat template sees them as variables
        self.all_special_tokens = list(dict.fromkeys([*special_tokens_map.values(), *extra_special_tokens]))
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._environment: Any = None
        self._compiled: dict[str, Any] = {}

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        return Encoding(self.encode(text, add_special_tokens))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        if not isinstance(ids, list):
            ids = ids.tolist() if hasattr(ids, "tolist") else ids  # tensors and arrays
            ids = [ids] if isinstance(ids, int) else list(ids)
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            for old, new in CLEAN_UP:
                text = text.replace(old, new)
        return text

    # ------------------------------------------------------------------ vocabulary and special tokens

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (as transformers counts it)."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        """A token's id; the unknown token's id for text that is no token, as transformers does."""
        if token is None:
            return None
        found = self.backend_tokenizer.token_to_id(token)
        unk = self.special_tokens_map.get("unk_token")
        return found if found is not None or unk is None else self.backend_tokenizer.token_to_id(unk)

    @property
    def all_special_ids(self) -> list[int | None]:
        return [self.token_id(t) for t in self.all_special_tokens]

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_id(self.special_tokens_map.get("pad_token"))

    # ------------------------------------------------------------------ chat templates

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str | list[int] | Encoding:
        """Render messages as transformers does; the ids hold no BOS/EOS beyond what the template writes."""
        for option in UNSUPPORTED_CHAT_OPTIONS:
            if kwargs.pop(option, False):
                raise ValueError(f"apply_chat_template: {option} is not supported by Ember's tokenizer")
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise ValueError("apply_chat_template: tools must be JSON schemas (dicts)")
        template = self._compile(self._pick_template(chat_template, tools))
        if not conversation:
            raise ValueError("apply_chat_template: the conversation is empty")
        text = template.render(
            messages=_template_messages(conversation),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **_plain({**self.special_tokens_map, **kwargs}),  # kwargs override special tokens
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return Encoding(ids) if return_dict else ids

    def _pick_template(self, chat_template: str | None, tools: list | None) -> str:
        """The argument (a template, or a template's name) or else the tokenizer's own template."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None:
                return own.get(chat_template, chat_template)
            name = "tool_use" if tools is not None and "tool_use" in own else "default"
            if name not in own:
                raise ValueError(f"the tokenizer has chat templates {sorted(own)} but no default: name one")
            return own[name]
        template = chat_template if chat_template is not None else own
        if not template:
            raise ValueError("the tokenizer has no chat template and none was passed (chat_template=...)")
        return template

    def _compile(self, template: str) -> Any:
        compiled = self._compiled.get(template)
        if compiled is None:
            if self._environment is None:
                self._environment = _chat_environment()
            if len(self._compiled) >= _COMPILED_TEMPLATES_KEPT:
                self._compiled.clear()
            compiled = self._compiled[template] = self._environment.from_string(template)
        return compiled


def _chat_environment() -> Any:
    """The jinja2 sandbox with the globals and filters that chat templates expect from transformers."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def refuse_private(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    class GenerationBlock(Extension):
        """`{% generation %}` marks assistant text for training masks; rendering keeps just the body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    class SafeNamespace(jinja2.utils.Namespace):
        """`namespace()` that refuses underscore names, so templates cannot reach Python internals."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            attrs = dict(*args[1:], **kwargs)
            for name in attrs:
                refuse_private(name)
            jinja2.utils.Namespace.__init__(args[0], attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            refuse_private(name)
            super().__setitem__(name, value)

    class SafeDict:
        """`dict(...)` and `dict.fromkeys(...)` without handing templates the dict type itself."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any) -> dict:
            return dict.fromkeys(*args)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        # unlike jinja2's own filter: no HTML escaping, non-ASCII kept, json.dumps' options
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, dict=SafeDict(), namespace=SafeNamespace)
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _template_messages(chat: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to templates: None values dropped, reasoning under every name."""
    out = []
    for message in chat:
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages must be dicts, got {type(message).__name__}")
        message = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in REASONING_KEYS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _plain(value: Any) -> Any:
    """JSON-like data only: the sandbox must never see the methods of arbitrary objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):
        if isinstance(value, base):  # subclasses (enums, ...) back to the base type
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return (list if isinstance(value, list) else tuple)(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


# ---------------------------------------------------------------------- loading


def _content(token: Any) -> str | None:
    """A token's text, whether stored as a string or an AddedToken dict; None if it is neither."""
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _added_token(token: Any, special: bool = True) -> AddedToken:
    """An AddedToken from a string or a tokenizer_config.json dict (its flags kept)."""
    flags = ("lstrip", "rstrip", "single_word", "normalized")
    kept = {k: v for k, v in token.items() if k in flags} if isinstance(token, Mapping) else {}
    return AddedToken(_content(token), special=special, **kept)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _read_config(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json with special_tokens_map.json merged in, as transformers merges them."""
    config = _read_json(folder / "tokenizer_config.json")
    if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    if "added_tokens_decoder" in config:  # written by transformers >= 4.34: the map is legacy, ignored
        return config
    for key, value in _read_json(folder / "special_tokens_map.json").items():
        if key == "additional_special_tokens" and "extra_special_tokens" not in config:
            config["extra_special_tokens"] = value
        elif key == "extra_special_tokens" and isinstance(value, list):
            known = list(config.get(key) or [])
            config[key] = known + [t for t in value if t not in known]
        elif key != "additional_special_tokens":
            config[key] = value
    return config


def _special_tokens(config: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """Named special tokens (standard ones first, then model-specific `*_token` keys) and the extra ones."""
    named = {key: config[key] for key in NAMED_TOKENS if _content(config.get(key))}
    named |= {k: v for k, v in config.items() if k.endswith("_token") and k not in named and _content(v)}
    extras = config.get("extra_special_tokens") or []
    if isinstance(extras, Mapping):  # a dict names model-specific tokens (e.g. image_token)
        return named | {k: v for k, v in extras.items() if _content(v)}, []
    return named, list(extras)


def _add_missing_tokens(backend: Backend, config: dict[str, Any], specials: list[Any]) -> None:
    """Add what transformers adds at load: tokens the config declares, special tokens not yet added."""
    present = {repr(t): t.content for t in backend.get_added_tokens_decoder().values()}
    declared = config.get("added_tokens_decoder", {})
    declared = [
        _added_token(declared[i], bool(declared[i].get("special"))) for i in sorted(declared, key=int)
    ]
    changed = [t for t in declared if repr(t) not in present]
    known = set(present.values()) | {t.content for t in declared}
    missing = {_content(t): _added_token(t) for t in specials if _content(t) not in known}
    if changed or missing:
        backend.add_tokens([*changed, *missing.values()])


def _chat_templates(folder: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja and additional_chat_templates/*.jinja win over tokenizer_config.json's entry."""
    templates = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for extra in sorted((folder / "additional_chat_templates").glob("*.jinja")):
        templates[extra.name.removesuffix(".jinja")] = extra.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    value = config.get("chat_template")
    return {t["name"]: t["template"] for t in value} if isinstance(value, list) else value


SHARED_TOKENIZERS = 4
_built: dict[tuple, Tokenizer] = {}  # this process's tokenizers by what they were built from, oldest first
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _sources(path: str) -> tuple | None:
    """What the tokenizer at `path` is built from, as (name, size, modification time) of each file (the
    weights aside); None when it cannot be read (loading then says why)."""
    try:
        target = Path(path).resolve()
        if target.is_file():
            st = target.stat()
            return (str(target), st.st_ino, st.st_size, st.st_mtime_ns)
        files = [f for f in target.rglob("*") if f.is_file() and f.suffix not in WEIGHT_SUFFIXES]
        return (str(target), *sorted((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    except OSError:
        return None


def load_tokenizer(path: str) -> Tokenizer:
    """The fast tokenizer stored in a local checkpoint folder, or described by a GGUF file's metadata
    (ValueError naming the folder or file if not). Shared within this process while its files stay the
    same (the four built last): building Qwen's 152k-token vocabulary takes half a second, and a
    folder's config (its EOS ids), the server and the preload zygote (for the servers it forks) ask."""
    key = _sources(path)
    if key is None:
        return _load(path)
    if key not in _built:
        while len(_built) >= SHARED_TOKENIZERS:
            _built.pop(next(iter(_built)))
        _built[key] = _load(path)
    return _built[key]


def tokenizer_built(path: str) -> bool:
    """Whether `load_tokenizer(path)` returns one already built in this process."""
    return _sources(path) in _built


def _load(path: str) -> Tokenizer:
    if path.endswith(".gguf"):
        from coreproc.base.gguf_file import open_gguf

        return tokenizer_from_gguf(open_gguf(path).metadata, path)
    folder = Path(path)
    if not (folder / "tokenizer.json").is_file():
        what = "no tokenizer.json (Ember needs a fast tokenizer)" if folder.is_dir() else "no such folder"
        raise ValueError(f"cannot load a tokenizer from {path}: {what}")
    try:
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        config = _read_config(folder)
        named, extras = _special_tokens(config)
        _add_missing_tokens(backend, config, [*named.values(), *extras])
        template = _chat_templates(folder, config)
    except Exception as e:  # tokenizers raises bare Exceptions; also bad JSON and unreadable files
        raise ValueError(f"cannot load a tokenizer from {path}: {' '.join(str(e).split())}") from None
    backend.no_truncation()  # transformers turns tokenizer.json's truncation and padding off on every call
    backend.no_padding()
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and (
        type(backend.model).__name__ != "BPE"  # transformers skips it for BPE, which it would corrupt
        or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"))
    )
    special_map = {key: text for key, token in named.items() if (text := _content(token)) is not None}
    extra_texts = [text for t in extras if (text := _content(t))]
    return Tokenizer(backend, special_map, extra_texts, template, clean_up)


def tokenizer_from_gguf(metadata: Mapping[str, Any], source: str = "GGUF file") -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes (`coreproc.base.gguf_tokenizer`), ValueError
    naming `source` if it cannot be built."""
    from coreproc.base.gguf_tokenizer import gguf_tokenizer_parts

    return Tokenizer(*gguf_tokenizer_parts(metadata, source))


def eos_token_ids(model_dir: str, tokenizer: Tokenizer) -> list[int]:
    """Ids that stop generation unless `ignore_eos` is set."""
    ids: list[int] = []
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ids.extend(value if isinstance(value, list) else [] if value is None else [value])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
