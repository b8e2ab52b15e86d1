"""Builds Ember's tokenizer from a GGUF file's metadata, as transformers builds it, without transformers.

Runs where `load_tokenizer` runs (the HTTP frontend, batch mode, the offline API, and `ModelConfig` for
the EOS ids) when the checkpoint is one GGUF file. A GGUF has no tokenizer.json: it keeps the
vocabulary, merges, token types and special ids as metadata under llama.cpp's key names (read by
`coreproc.base.gguf_file.GGUFFile`, valued as `gguf.GGUFReader`'s `contents()`). `gguf_tokenizer_parts`
assembles from them the `tokenizers` pipeline that transformers'
`AutoTokenizer.from_pretrained(folder, gguf_file=name)` assembles, so that ids and text equal
transformers'; `gguf_eos_token_ids` gives the ids that end generation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

# (backend, named special tokens, extra special tokens, chat template): Tokenizer's arguments
TokenizerParts = tuple[Backend, dict[str, str], list[str], "str | dict[str, str] | None"]
# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# transformers' named special tokens a GGUF states, with the key of each one's id, in transformers' order
NAMED_IDS = (
    ("bos_token", "tokenizer.ggml.bos_token_id"),
    ("eos_token", "tokenizer.ggml.eos_token_id"),
    ("unk_token", "tokenizer.ggml.unknown_token_id"),
    ("pad_token", "tokenizer.ggml.padding_token_id"),
)
# ids that also end a turn, after the EOS id (see gguf_eos_token_ids)
END_OF_TURN_IDS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# the special tokens transformers' tokenizer class for each model adds before it reads the file's own:
# a vocabulary without them gets them as new ids after its last one, as it does in transformers
CLASS_DEFAULT_TOKENS = {"gpt2": ("<|endoftext|>",), "llama": ("<s>", "</s>", "<unk>")}
# Gemma's sentencepiece files, which transformers rebuilds as GemmaTokenizer (see _gemma_backend)
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
GEMMA_DEFAULT_TOKENS = ("<unk>", "<bos>", "<eos>", "<pad>", "<mask>")
SPIECE_SPACE = "\u2581"

# How text is cut before BPE, by `tokenizer.ggml.pre`: the names transformers recognises. Any other name
# gets GPT-2's own byte-level split, as in transformers, even where llama.cpp cuts otherwise ('smollm':
# llama.cpp cuts digits one by one first, as SmolLM's own tokenizer.json does, and transformers does not).
SPLITS = {
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "tekken": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "gpt-4o": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
PRE_TOKENIZER_SPLIT = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"), "llama3"
    ),
    **dict.fromkeys(("jina-v5-nano", "dbrx", "smaug-bpe"), "llama3"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), "qwen2"),
    "qwen35": "qwen35",
    "tekken": "tekken",
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), "gpt-4o"),
}


def gguf_tokenizer_parts(metadata: Mapping[str, Any], source: str = "GGUF file") -> TokenizerParts:
    """What `coreproc.base.tokenizer.Tokenizer` is built from, as a GGUF's metadata describes it
    (ValueError naming `source` if it cannot be built); `tokenizer_from_gguf` builds it."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    tokens = list(tokens) if isinstance(tokens, Sequence) and not isinstance(tokens, str) else None
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"cannot build a tokenizer from {source}: it has no tokenizer.ggml.tokens")
    architecture = metadata.get("general.architecture")
    if kind not in CLASS_DEFAULT_TOKENS:
        raise ValueError(
            f"cannot build a tokenizer from {source}: tokenizer.ggml.model {kind!r} is not supported "
            f"(supported: {', '.join(sorted(CLASS_DEFAULT_TOKENS))})"
        )
    named = _named_tokens(metadata, tokens, source)
    types = metadata.get("tokenizer.ggml.token_type") or []
    defaults = CLASS_DEFAULT_TOKENS[kind]
    if kind == "gpt2":
        backend = _byte_level_backend(tokens, _merges(metadata, tokens, source, byte_level=True))
    elif architecture in GEMMA_ARCHITECTURES:
        backend, defaults = _gemma_backend(tokens), GEMMA_DEFAULT_TOKENS
        named["mask_token"] = "<mask>"  # GemmaTokenizer's, whatever the file says
    else:
        backend = _sentencepiece_backend(tokens, _merges(metadata, tokens, source, byte_level=False))
        if architecture == "phi3":  # the prefix space from a normalizer, as Phi-3's own tokenizer.json
            backend.normalizer = normalizers.Sequence(
                [normalizers.Prepend(SPIECE_SPACE), normalizers.Replace(" ", SPIECE_SPACE)]
            )
            backend.pre_tokenizer = None
    split = PRE_TOKENIZER_SPLIT.get(str(metadata.get("tokenizer.ggml.pre")))
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(SPLITS[split]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    _add_tokens(backend, tokens, types, named, defaults, byte_level=kind == "gpt2")
    # a sentencepiece file that does not say gets BOS: llama.cpp's default, which transformers follows
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _post_processor(backend, named, add_bos, add_eos)
    return backend, named, [], _chat_templates(metadata)


def gguf_eos_token_ids(metadata: Mapping[str, Any]) -> list[int]:
    """Ids that stop generation unless `ignore_eos` is set: the EOS id, then end-of-turn/-message ids.

    transformers' generation config from a GGUF holds only `tokenizer.ggml.eos_token_id` (the file has
    no generation_config.json). llama.cpp stops on every end-of-generation token, which includes the
    file's `eot_token_id` and `eom_token_id`: a file that names them says a turn ends there (Llama 3's
    `<|eot_id|>` and `<|eom_id|>`, which its generation_config.json lists beside EOS), so Ember stops on
    them too. llama.cpp's further guesses from token text (`<|im_end|>`, `<end_of_turn>`, ...) are not
    made: what a file does not state is not assumed.
    """
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", *END_OF_TURN_IDS):
        value = metadata.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0 and value not in ids:
            ids.append(value)
    return ids


# ---------------------------------------------------------------------- vocabulary and merges


def _byte_spelling() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes stand for themselves, the other
    bytes take the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling = {byte: chr(byte) for byte in printable}
    others = [byte for byte in range(256) if byte not in spelling]
    spelling.update({byte: chr(256 + n) for n, byte in enumerate(others)})
    return spelling


BYTE_SPELLING = _byte_spelling()
BYTE_ALPHABET = frozenset(BYTE_SPELLING.values())


def _respell(token: str) -> str:
    """A byte-level token as the vocabulary spells it: a token with a character outside the byte alphabet
    (llama.cpp writes some added tokens in plain text) is spelled byte by byte."""
    if BYTE_ALPHABET.issuperset(token):
        return token
    return "".join(BYTE_SPELLING[byte] for byte in token.encode("utf-8"))


def _merges(
    metadata: Mapping[str, Any], tokens: list[str], source: str, byte_level: bool
) -> list[tuple[str, str]]:
    """The file's merges, or (sentencepiece files store none) the merges its token scores imply."""
    merges = metadata.get("tokenizer.ggml.merges")
    if merges:
        return [merge.partition(" ")[::2] for merge in merges]
    scores = metadata.get("tokenizer.ggml.scores")
    if not scores:
        what = "tokenizer.ggml.merges" if byte_level else "tokenizer.ggml.merges or tokenizer.ggml.scores"
        raise ValueError(f"cannot build a tokenizer from {source}: it has no {what}")
    return _merges_from_scores({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores)))


def _merges_from_scores(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """Every way to cut a token into two tokens, best-scored first (ties: the longer left part, then the
    longer right part, then the order found), as transformers derives merges for sentencepiece files."""
    found: list[tuple[str, str, float]] = []
    for token, score in scores.items():
        cuts = [(token[:i], token[i:]) for i in range(1, len(token))]
        cuts = [(left, right) for left, right in cuts if left in vocab and right in vocab]
        cuts.sort(key=lambda cut: (vocab[cut[0]], vocab[cut[1]]))
        found.extend((left, right, score) for left, right in cuts)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _byte_level_backend(tokens: list[str], merges: list[tuple[str, str]]) -> Backend:
    """GPT-2's byte-level BPE (transformers' GPT2Tokenizer): its split, no normalizer, byte decoding."""
    if BYTE_ALPHABET.issuperset("".join(tokens)):  # the usual case, checked at once
        vocab = dict(zip(tokens, range(len(tokens))))
    else:
        vocab = {_respell(t): index for index, t in enumerate(tokens)}
    model = BPE(
        vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
    )
    backend = Backend(model)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(tokens: list[str], merges: list[tuple[str, str]]) -> Backend:
    """Sentencepiece-style BPE with byte fallback (transformers' LlamaTokenizer): spaces become `▁` and a
    `▁` goes before the text; bytes without a token of their own use the `<0xNN>` tokens."""
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Backend(BPE(vocab, merges, dropout=None, fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPIECE_SPACE, prepend_scheme="first", split=False
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace(SPIECE_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    return backend


def _gemma_backend(tokens: list[str]) -> Backend:
    """Gemma's sentencepiece BPE (transformers' GemmaTokenizer): spaces become `▁` by a normalizer, no
    prefix space, byte fallback. Its files spell a token of spaces with real spaces (renamed to `▁`s
    here, as the normalizer's output is looked up) and hold no merges: they come from the vocabulary,
    best first in the order the tokens are listed (Gemma's scores do not follow its merge order)."""
    respelled = [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(respelled)}
    merges = _merges_from_scores(vocab, {token: -index for index, token in enumerate(respelled)})
    model = BPE(vocab, merges, fuse_unk=True, unk_token="<unk>", dropout=None, byte_fallback=True)
    backend = Backend(model)
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    backend.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    return backend


# ---------------------------------------------------------------------- special tokens


def _named_tokens(metadata: Mapping[str, Any], tokens: list[str], source: str) -> dict[str, str]:
    """bos/eos/unk/pad tokens whose ids the file states (in transformers' order)."""
    named = {}
    for name, key in NAMED_IDS:
        token_id = metadata.get(key)
        if token_id is None:
            continue
        if not isinstance(token_id, int) or not 0 <= token_id < len(tokens):
            raise ValueError(f"cannot build a tokenizer from {source}: {key} {token_id!r} is not a token id")
        named[name] = tokens[token_id]
    return named


def _add_tokens(
    backend: Backend,
    tokens: list[str],
    types: Sequence[int],
    named: Mapping[str, str],
    class_defaults: Sequence[str],
    byte_level: bool,
) -> None:
    """Mark the tokens that are matched whole in text, in the order transformers adds them.

    1. The tokenizer class's own special tokens (new ids where the vocabulary lacks them).
    2. Control tokens (`<|im_start|>`) as special tokens, skipped in decoding on request. In a byte-level
       vocabulary a control token spelled outside the byte alphabet is a mislabel and is left alone.
    3. User-defined tokens (`<tool_call>`) as plain added tokens, kept in decoding.
    4. The named special tokens (bos, eos, unk, pad) not added yet, as special tokens.
    """
    backend.add_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(class_defaults)])
    kinds = list(zip(tokens, types))
    control = [
        t for t, kind in kinds if kind == CONTROL and not (byte_level and not BYTE_ALPHABET.issuperset(t))
    ]
    if control:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user_defined = [t for t, kind in kinds if kind == USER_DEFINED and backend.token_to_id(t) is not None]
    if user_defined:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = [t for t in dict.fromkeys(named.values()) if t not in added]
    if missing:
        backend.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing])


def _post_processor(backend: Backend, named: Mapping[str, str], add_bos: bool, add_eos: bool) -> Any:
    """What `add_special_tokens=True` adds around the text: BOS and EOS where the file asks for them."""
    bos = named.get("bos_token") if add_bos else None
    eos = named.get("eos_token") if add_eos else None
    head, tail = (f"{bos}:0 " if bos else ""), (f" {eos}:0" if eos else "")
    single = f"{head}$A:0{tail}"
    pair = f"{single}{f' {bos}:1' if bos else ''} $B:1{f' {eos}:1' if eos else ''}"
    specials = [(t, backend.token_to_id(t)) for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _chat_templates(metadata: Mapping[str, Any]) -> str | dict[str, str] | None:
    """`tokenizer.chat_template`, with the named `tokenizer.chat_template.<name>` ones beside it if any."""
    prefix = "tokenizer.chat_template."
    default = metadata.get("tokenizer.chat_template")
    default = default if isinstance(default, str) and default else None
    named = {
        k.removeprefix(prefix): v for k, v in metadata.items() if k.startswith(prefix) and isinstance(v, str)
    }
    if not named:
        return default
    return ({"default": default} if default else {}) | named
