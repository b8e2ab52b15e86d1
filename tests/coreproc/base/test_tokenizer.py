"""coreproc/base/tokenizer.py against transformers' AutoTokenizer, the reference it must match.

Checks encode/decode, special tokens, EOS ids and chat templates on the bundled default model and a
tiny checkpoint of every architecture (qwen2 is rebuilt by transformers, the others are not), config
variants built in a temp folder, load errors, and that the tokenizer path never imports transformers.
Run: `pytest -q tests/coreproc/base/test_tokenizer.py`.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from coreproc.base.tokenizer import eos_token_ids, load_tokenizer
from coreproc.text.chat import render_chat
from tests.paths import REPO

pytestmark = pytest.mark.unit

ROOT = REPO
DEFAULT_MODEL = ROOT / "coreproc" / "assets" / "default_model"
FOLDERS = ("default", "llama", "qwen2", "qwen3", "mistral")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
TEXTS = [
    "",
    "hello world",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n\r\n  x",
    "    \n\n\n   ",
    "café naïve Ünïcödé — “quotes”",
    "e\u0301 (decomposed) vs \u00e9 (composed)",  # NFC normalization
    "日本語のテキスト、中文。한국어",
    "emoji 🤖🚀 and a family 👩‍👩‍👧",
    "def f(x):\n    return x ** 2  # comment\n\nclass A(B):\n\tpass\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|bos|><|endoftext|> mid<|im_end|>text<|bos|>",
    "<|im_ partial |> <|bos",
    "don't , . ? ! it 's they 're",
    "x" * 500,
]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "    return a + b"},
        {"role": "user", "content": "日本語 🙂 <|im_end|>?"},
    ],
    [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]}],
]
# exercises what transformers' environment adds: namespace, loop controls, tojson, generation blocks,
# dict(), special tokens and extra kwargs as variables, tools/documents, trim_blocks and lstrip_blocks
CUSTOM_TEMPLATE = """\
{%- set ns = namespace(count=0) -%}
{%- for m in messages -%}
    {%- if m.role == 'stop' %}{% break %}{% endif -%}
    {%- set ns.count = ns.count + 1 %}
    [{{ m.role }}|{{ m.content | tojson }}|{{ m.reasoning_content | default('-') }}|
    {{- m.thinking | default('-') }}]
    {{ 'name' in m }}
{% endfor %}
{{ ns.count }} {{ bos_token }}{{ eos_token }}{{ pad_token }}{{ unk_token }} {{ greeting | default('none') }}
{{ tools is none }} {{ documents is none }} {{ tools | tojson(indent=2) }}
{% generation %}gen{{ ns.count }}{% endgeneration %}
{{ dict(a=1, b='<&>é') | tojson(sort_keys=True) }} {{ 'é' | tojson(ensure_ascii=True) }}
{{ strftime_now('%Y') }}
    {% if add_generation_prompt %}
    ASSISTANT:
    {% endif %}
"""
RICH_MESSAGES = [
    {"role": "system", "content": '<b>é</b> & "quotes"'},
    {"role": "user", "content": "x", "name": None},
    {"role": "assistant", "content": "y", "reasoning": "because"},
    {"role": "stop", "content": "never shown"},
    {"role": "user", "content": "after stop"},
]


def _hf(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@pytest.fixture(scope="module", params=FOLDERS)
def folder(request: pytest.FixtureRequest, make_ckpt) -> Path:
    return DEFAULT_MODEL if request.param == "default" else make_ckpt(request.param)


@pytest.fixture(scope="module")
def pair(folder: Path):
    return load_tokenizer(str(folder)), _hf(folder)


def _clone(src: Path, dst: Path, config: dict | None = None, special_map: dict | None = None) -> Path:
    """A copy of a checkpoint's tokenizer files, config and special-token-map keys replaced (None deletes)."""
    dst.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, dst / name)
    for name, changes in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        data = json.loads((dst / name).read_text())
        data.update(changes or {})
        (dst / name).write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return dst


def _assert_same_tokenization(ours, hf, texts: list[str]) -> None:
    for text in texts:
        for add in (True, False):
            expected = hf(text, add_special_tokens=add).input_ids
            assert ours(text, add_special_tokens=add).input_ids == expected, (text, add)
            assert ours.encode(text, add_special_tokens=add) == expected
            for skip in (True, False):
                assert ours.decode(expected, skip_special_tokens=skip) == hf.decode(
                    expected, skip_special_tokens=skip
                )
    assert len(ours) == len(hf) and ours.vocab_size == hf.vocab_size
    assert ours.all_special_tokens == hf.all_special_tokens and ours.all_special_ids == hf.all_special_ids


# ----------------------------------------------------------------------------- every checkpoint


def test_encode_and_decode_match_transformers(pair):
    _assert_same_tokenization(*pair, TEXTS)


def test_decode_of_arbitrary_ids_matches_transformers(pair):
    ours, hf = pair
    rng = random.Random(0)
    specials = hf.all_special_ids
    for _ in range(300):
        ids = [
            rng.choice(specials) if rng.random() < 0.2 else rng.randrange(len(hf))
            for _ in range(rng.randint(1, 24))
        ]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
    assert ours.decode(5) == hf.decode(5) and ours.decode([]) == hf.decode([]) == ""


def test_special_token_attributes_match_transformers(pair, folder):
    ours, hf = pair
    for name in (
        "bos_token",
        "bos_token_id",
        "eos_token",
        "eos_token_id",
        "pad_token_id",
        "special_tokens_map",
    ):
        assert getattr(ours, name) == getattr(hf, name), name
    assert ours.chat_template == hf.chat_template
    for token in ("<|im_end|>", "not a token"):  # text that is no token maps to the unknown token's id
        assert ours.token_id(token) == hf.convert_tokens_to_ids(token)
    assert ours.backend_tokenizer.to_str() == Backend.from_file(str(folder / "tokenizer.json")).to_str()


def test_eos_token_ids(pair, folder):
    ours, hf = pair
    assert eos_token_ids(str(folder), ours) == eos_token_ids(str(folder), hf)
    assert eos_token_ids(str(folder), ours) == [
        0,
        3,
    ]  # generation_config.json lists <|endoftext|>, <|im_end|>


def test_chat_template_matches_transformers(pair):
    ours, hf = pair
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            text = hf.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False) == text
            ids = hf.apply_chat_template(messages, add_generation_prompt=prompt, return_dict=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt, return_dict=False) == ids
            assert ids == hf(text, add_special_tokens=False).input_ids  # tokenized without an extra BOS
            rendered = render_chat(ours, messages, add_generation_prompt=prompt)  # parts joined by newlines
            assert rendered == render_chat(hf, messages, add_generation_prompt=prompt)
            assert rendered == ids or not isinstance(messages[0]["content"], str)
    encoding = ours.apply_chat_template(CONVERSATIONS[0], return_dict=True)
    expected = hf.apply_chat_template(CONVERSATIONS[0], return_dict=True)
    assert (
        encoding["input_ids"] == expected["input_ids"]
        and encoding["attention_mask"] == expected["attention_mask"]
    )


# ----------------------------------------------------------------------------- chat template details


@pytest.fixture(scope="module")
def default_pair():
    return load_tokenizer(str(DEFAULT_MODEL)), _hf(DEFAULT_MODEL)


@pytest.mark.parametrize("prompt", [True, False])
def test_custom_template_renders_like_transformers(default_pair, prompt):
    ours, hf = default_pair
    tools = [{"type": "function", "function": {"name": "f", "description": "ünïcode <tag>"}}]
    for kwargs in ({}, {"tools": tools, "greeting": "hey", "documents": [{"title": "t", "text": "x"}]}):
        args = dict(chat_template=CUSTOM_TEMPLATE, add_generation_prompt=prompt, **kwargs)
        text = hf.apply_chat_template(RICH_MESSAGES, tokenize=False, **args)
        assert ours.apply_chat_template(RICH_MESSAGES, tokenize=False, **args) == text
        assert "gen3" in text and ("ASSISTANT:" in text) == prompt  # the loop broke at the "stop" role
        assert ours.apply_chat_template(RICH_MESSAGES, **args) == hf.apply_chat_template(
            RICH_MESSAGES, return_dict=False, **args
        )
    assert (
        RICH_MESSAGES[1]["name"] is None and "reasoning_content" not in RICH_MESSAGES[2]
    )  # inputs untouched


def test_kwargs_override_special_token_variables(default_pair):
    ours, hf = default_pair
    template = "{{ bos_token }}|{{ eos_token }}|{{ enable_thinking }}"
    args = dict(chat_template=template, tokenize=False, bos_token="B", enable_thinking=False)
    assert ours.apply_chat_template(CONVERSATIONS[0], **args) == hf.apply_chat_template(
        CONVERSATIONS[0], **args
    )
    assert ours.apply_chat_template(CONVERSATIONS[0], **args) == "B|<|endoftext|>|False"


@pytest.mark.parametrize(
    "template, error",
    [
        ("{{ raise_exception('no system role') }}", jinja2.TemplateError),
        ("{% set ns = namespace(_x=1) %}", jinja2.exceptions.SecurityError),
        ("{% set ns = namespace(a=1) %}{% set ns._x = 2 %}", jinja2.exceptions.SecurityError),
        ("{{ messages.append(1) }}", jinja2.exceptions.SecurityError),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", jinja2.exceptions.SecurityError),
        ("{% for %}", jinja2.TemplateSyntaxError),
    ],
)
def test_template_errors_match_transformers(default_pair, template, error):
    for tokenizer in default_pair:
        with pytest.raises(error):
            tokenizer.apply_chat_template(CONVERSATIONS[0], chat_template=template, tokenize=False)


def test_chat_errors(default_pair):
    ours, hf = default_pair
    for tokenizer in (ours, hf):
        with pytest.raises(ValueError):
            tokenizer.apply_chat_template([], tokenize=False)
        with pytest.raises(TypeError):
            tokenizer.apply_chat_template(["not a message"], tokenize=False)
    with pytest.raises(ValueError, match="not supported"):
        ours.apply_chat_template(CONVERSATIONS[0], continue_final_message=True)
    with pytest.raises(ValueError, match="JSON schemas"):
        ours.apply_chat_template(CONVERSATIONS[0], tools=[len])


def test_no_template_is_a_value_error(tmp_path):
    folder = _clone(DEFAULT_MODEL, tmp_path / "tok", config={"chat_template": None})
    ours, hf = load_tokenizer(str(folder)), _hf(folder)
    assert ours.chat_template is None is hf.chat_template
    for tokenizer in (ours, hf):
        with pytest.raises(ValueError):
            tokenizer.apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(ValueError, match="no chat template") as info:
        ours.apply_chat_template(CONVERSATIONS[0])
    assert "\n" not in str(info.value)
    text = ours.apply_chat_template(
        CONVERSATIONS[0], chat_template="{{ messages[0].content }}", tokenize=False
    )
    assert text == "hi"


def test_template_files_and_named_templates(tmp_path):
    named = [{"name": "default", "template": "D{{ tools is none }}"}, {"name": "tool_use", "template": "T"}]
    listed = _clone(DEFAULT_MODEL, tmp_path / "listed", config={"chat_template": named})
    jinja = _clone(DEFAULT_MODEL, tmp_path / "jinja")
    (jinja / "chat_template.jinja").write_text("J{{ messages | length }}")
    (jinja / "additional_chat_templates").mkdir()
    (jinja / "additional_chat_templates" / "extra.jinja").write_text("X")
    no_default = _clone(DEFAULT_MODEL, tmp_path / "nodefault", config={"chat_template": named[1:]})
    cases = [(listed, {}), (listed, {"tools": [{"name": "f"}]}), (listed, {"chat_template": "tool_use"})]
    cases += [(jinja, {}), (jinja, {"chat_template": "extra"}), (jinja, {"chat_template": "inline {{ 1 }}"})]
    for folder, kwargs in cases:
        ours, hf = load_tokenizer(str(folder)), _hf(folder)
        assert ours.chat_template == hf.chat_template
        expected = hf.apply_chat_template(CONVERSATIONS[0], tokenize=False, **kwargs)
        assert ours.apply_chat_template(CONVERSATIONS[0], tokenize=False, **kwargs) == expected, kwargs
    for tokenizer in (load_tokenizer(str(no_default)), _hf(no_default)):
        with pytest.raises(ValueError):
            tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=False)


# ----------------------------------------------------------------------------- config variants


def _vocab_token(folder: Path, token_id: int) -> str:
    return Backend.from_file(str(folder / "tokenizer.json")).id_to_token(token_id)


def test_config_variants_match_transformers(tmp_path):
    plain = _vocab_token(DEFAULT_MODEL, 400)  # a base-vocabulary token that is not an added token
    extras = ["<|im_start|>", "<|im_end|>", "<tool_call>"]
    im_start = {
        "content": "<|im_start|>",
        "lstrip": True,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }
    im_start |= {"single_word": False}
    variants = {
        "new_special": ({"additional_special_tokens": extras}, {"additional_special_tokens": extras}),
        "vocab_special": ({"mask_token": plain, "image_token": "<|im_start|>"}, None),
        "dict_tokens": (
            {"eos_token": {"content": "<|im_end|>", "__type": "AddedToken"}},
            {"eos_token": None},
        ),
        "map_wins": ({"bos_token": "<|bos|>"}, {"bos_token": "<|im_start|>"}),
        "decoder_wins": ({"added_tokens_decoder": {"2": im_start}}, {"eos_token": "<|im_end|>"}),
        "clean_up": ({"clean_up_tokenization_spaces": True}, None),
        "split_special": ({"split_special_tokens": True}, None),
        "no_pad": ({"pad_token": None}, {"pad_token": None}),
    }
    for name, (config, special_map) in variants.items():
        folder = _clone(DEFAULT_MODEL, tmp_path / name, config, special_map)
        ours, hf = load_tokenizer(str(folder)), _hf(folder)
        texts = [*TEXTS[-5:], f"a{plain}b <tool_call> x <|im_start|> y", " <|im_start|>  z"]
        _assert_same_tokenization(ours, hf, texts)
        for attr in ("bos_token", "bos_token_id", "eos_token_id", "pad_token_id", "special_tokens_map"):
            assert getattr(ours, attr) == getattr(hf, attr), (name, attr)
        assert eos_token_ids(str(folder), ours) == eos_token_ids(str(folder), hf)
        messages = CONVERSATIONS[1]
        expected = hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        assert ours.apply_chat_template(messages, add_generation_prompt=True) == expected, name


def test_tokenizer_json_truncation_and_padding_are_ignored_like_transformers(tmp_path):
    folder = _clone(DEFAULT_MODEL, tmp_path / "tok")
    backend = Backend.from_file(str(folder / "tokenizer.json"))
    backend.enable_truncation(max_length=8)
    backend.enable_padding(length=64, pad_id=0, pad_token="<|endoftext|>")
    backend.save(str(folder / "tokenizer.json"))
    ours, hf = load_tokenizer(str(folder)), _hf(folder)
    _assert_same_tokenization(ours, hf, TEXTS)
    assert len(ours(TEXTS[-1]).input_ids) > 64


def test_clean_up_tokenization_spaces_applies_to_wordpiece(tmp_path):
    vocab = {w: i for i, w in enumerate(["[UNK]", "[SEP]", "hello", ",", "world", ".", "it", "'", "s", "?"])}
    backend = Backend(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    folder = tmp_path / "wordpiece"
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    for clean in (True, False):
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "sep_token": "[SEP]"}
        (folder / "tokenizer_config.json").write_text(
            json.dumps(config | {"clean_up_tokenization_spaces": clean})
        )
        ours, hf = load_tokenizer(str(folder)), _hf(folder)
        text = "hello, world. it's?"
        ids = hf(text).input_ids
        assert ours(text).input_ids == ids and ours.decode(ids) == hf.decode(ids)
        assert (ours.decode(ids) == text) is clean
        assert ours.all_special_ids == hf.all_special_ids and ours.special_tokens_map == hf.special_tokens_map


def test_eos_token_ids_from_int_list_or_missing_generation_config(tmp_path):
    folder = _clone(DEFAULT_MODEL, tmp_path / "tok")
    tokenizer = load_tokenizer(str(folder))
    for value, expected in ((3, [3, 0]), ([3, 2], [3, 2, 0]), ([0], [0]), (None, [0])):
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
        assert eos_token_ids(str(folder), tokenizer) == expected
    (folder / "generation_config.json").unlink()
    assert eos_token_ids(str(folder), tokenizer) == [0]


# ----------------------------------------------------------------------------- load errors and imports


def test_load_errors_name_the_folder_in_one_line(tmp_path):
    bad_json = _clone(DEFAULT_MODEL, tmp_path / "bad_json")
    (bad_json / "tokenizer.json").write_text("{ not json")
    bad_config = _clone(DEFAULT_MODEL, tmp_path / "bad_config")
    (bad_config / "tokenizer_config.json").write_text("[1, 2")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {tmp_path / "missing": "no such folder", empty: "no tokenizer.json", bad_json: "", bad_config: ""}
    for folder, reason in cases.items():
        with pytest.raises(ValueError, match="cannot load a tokenizer from") as info:
            load_tokenizer(str(folder))
        message = str(info.value)
        assert str(folder) in message and reason in message and "\n" not in message


def test_tokenizer_path_never_imports_transformers():
    script = (
        "import sys, time\n"
        "t = time.perf_counter()\n"
        "from coreproc.base.tokenizer import eos_token_ids, load_tokenizer\n"
        "from coreproc.text.chat import render_chat\n"
        "from coreproc.text.detokenizer import IncrementalDetokenizer\n"
        f"tok = load_tokenizer({str(DEFAULT_MODEL)!r})\n"
        f"eos_token_ids({str(DEFAULT_MODEL)!r}, tok)\n"
        "ids = render_chat(tok, [{'role': 'user', 'content': 'hi'}])\n"
        "tok.decode(tok('def f(x):').input_ids)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
