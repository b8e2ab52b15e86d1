"""The OpenAI schema: request validation, the mapping to SamplingParams, response shapes, chat rendering.

Pure Python except the chat tests, which load a tiny checkpoint's tokenizer (no model).
Run: `pytest -q tests/coreproc/text/test_openai_protocol.py`.
"""

from __future__ import annotations

import math

import pytest

from coreproc.text.chat import TEXT_ONLY, render_chat
from coreproc.text.openai_protocol import (
    ChatCompletionRequest,
    RequestError,
    parse_chat_request,
    parse_completion_request,
    prompt_inputs,
    to_sampling_params,
)
from coreproc.text.openai_responses import (
    chat_choice,
    chat_chunk,
    chat_completion_response,
    chat_delta,
    completion_choices,
    completion_chunk,
    completion_response,
    usage_of,
)
from coreproc.text.outputs import CompletionOutput, Logprob, RequestOutput

pytestmark = pytest.mark.unit

USER = [{"role": "user", "content": "hello"}]


# ----------------------------------------------------------------------------- parsing


def test_completion_defaults_and_prompt_forms():
    req = parse_completion_request(b'{"model": "m", "prompt": "hi"}')
    assert (req.model, req.max_tokens, req.n, req.echo, req.logprobs) == ("m", 16, 1, False, None)
    assert prompt_inputs(req) == ["hi"]
    assert prompt_inputs(parse_completion_request({"prompt": ["a", "b"]})) == ["a", "b"]
    assert prompt_inputs(parse_completion_request({"prompt": [1, 2, 3]})) == [[1, 2, 3]]
    assert prompt_inputs(parse_completion_request({"prompt": [[1, 2], [3]]})) == [[1, 2], [3]]
    chat = parse_chat_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]})
    assert chat.max_tokens is None and chat.max_completion_tokens is None and chat.logprobs is False
    assert chat.messages[0].content[0].text == "x"  # content parts are kept


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"prompt": ', None),
        (b"[1, 2]", None),
        ({}, "prompt"),
        ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
        ({"prompt": "x", "n": True}, "n"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "stop": ["ok", 3]}, "stop[1]"),
        ({"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": [True, 2]}, "prompt"),
    ],
)
def test_bad_completion_bodies_name_the_field(body, param):
    with pytest.raises(RequestError) as info:
        parse_completion_request(body)
    assert info.value.param == param and info.value.status == 400
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0].type"),
        ({"messages": USER, "logprobs": 3}, "logprobs"),
        ({"messages": USER, "max_completion_tokens": 1.5}, "max_completion_tokens"),
    ],
)
def test_bad_chat_bodies_name_the_field(body, param):
    with pytest.raises(RequestError) as info:
        parse_chat_request(body)
    assert info.value.param == param


def test_error_body_is_openai_shaped():
    err = RequestError("bad n", "n")
    assert err.error_body() == {
        "error": {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": None}
    }


# ----------------------------------------------------------------------------- sampling params


def test_sampling_params_mapping():
    req = parse_completion_request(
        {
            "prompt": "x",
            "max_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "n": 3,
            "seed": 11,
            "stop": "END",
            "stop_token_ids": [5],
            "presence_penalty": 0.1,
            "frequency_penalty": 0.2,
            "repetition_penalty": 1.1,
            "logprobs": 2,
            "ignore_eos": True,
            "min_tokens": 2,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
    )
    sp = to_sampling_params(req, prompt_len=4, max_model_len=64)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (7, 0.5, 0.9, 40, 0.05)
    assert (sp.n, sp.seed, sp.stop, sp.stop_token_ids) == (3, 11, ["END"], [5])
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.1, 0.2, 1.1)
    assert (sp.logprobs, sp.prompt_logprobs, sp.ignore_eos, sp.min_tokens) == (2, None, True, 2)
    assert (sp.skip_special_tokens, sp.include_stop_str_in_output) == (False, True)
    echo = to_sampling_params(parse_completion_request({"prompt": "x", "echo": True, "logprobs": 1}), 4, 64)
    assert echo.prompt_logprobs == 1
    chat = parse_chat_request({"messages": USER, "logprobs": True, "top_logprobs": 3, "stop": ["a", "b"]})
    sp = to_sampling_params(chat, 4, 64)
    assert (sp.logprobs, sp.prompt_logprobs, sp.stop, sp.temperature, sp.n) == (3, None, ["a", "b"], 1.0, 1)
    assert to_sampling_params(parse_chat_request({"messages": USER, "logprobs": True}), 4, 64).logprobs == 0
    assert to_sampling_params(parse_chat_request({"messages": USER}), 4, 64).logprobs is None


def test_max_tokens_defaults_up_to_the_context():
    chat = parse_chat_request({"messages": USER})
    assert to_sampling_params(chat, prompt_len=10, max_model_len=64).max_tokens == 54
    assert to_sampling_params(parse_completion_request({"prompt": "x"}), 10, 64).max_tokens == 16
    unset = parse_completion_request({"prompt": "x", "max_tokens": None})
    assert to_sampling_params(unset, 10, 64).max_tokens == 54
    both = parse_chat_request({"messages": USER, "max_tokens": 5, "max_completion_tokens": 9})
    assert to_sampling_params(both, 10, 64).max_tokens == 9
    assert (
        to_sampling_params(parse_chat_request({"messages": USER, "max_tokens": 54}), 10, 64).max_tokens == 54
    )


@pytest.mark.parametrize(
    "body, prompt_len, param",
    [
        ({"prompt": "x", "max_tokens": 55}, 10, "max_tokens"),
        ({"messages": USER, "max_tokens": 55}, 10, "max_tokens"),
        ({"messages": USER, "max_completion_tokens": 55}, 10, "max_completion_tokens"),
        ({"prompt": "x"}, 64, "prompt"),
        ({"messages": USER}, 70, "messages"),
    ],
)
def test_context_overflow_is_a_request_error(body, prompt_len, param):
    req = parse_chat_request(body) if "messages" in body else parse_completion_request(body)
    with pytest.raises(RequestError) as info:
        to_sampling_params(req, prompt_len, 64)
    assert info.value.param == param
    assert "maximum context length is 64 tokens" in str(info.value)


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"prompt": "x", "temperature": -1.0}, "temperature", "non-negative"),
        ({"prompt": "x", "top_p": 0.0}, "top_p", "top_p"),
        ({"prompt": "x", "n": 0}, "n", "at least 1"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "[0, 20]"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "at least 1"),
        ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens", "min_tokens must not exceed"),
        ({"prompt": "x", "stop": [""]}, "stop", "non-empty"),
        ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens"),
        ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
        ({"messages": USER, "top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    ],
)
def test_invalid_values_become_request_errors(body, param, words):
    req = parse_chat_request(body) if "messages" in body else parse_completion_request(body)
    with pytest.raises(RequestError) as info:
        to_sampling_params(req, 4, 64)
    assert info.value.param == param and words in str(info.value)


# ----------------------------------------------------------------------------- responses


def _result() -> RequestOutput:
    """A prompt [1, 7] and two sequences; sequence 0 has logprobs (chosen token first, then top-2)."""
    lps0 = [
        {5: Logprob(-0.5, 1, "Hel"), 6: Logprob(-1.5, 2, "Yo")},
        {8: Logprob(-2.0, 3, "lo"), 9: Logprob(-0.1, 1, "!"), 10: Logprob(-1.0, 2, "?")},
        {11: Logprob(-math.inf, 9, "x"), 12: Logprob(-0.2, 1, "y"), 13: Logprob(-0.3, 2, "z")},
    ]
    return RequestOutput(
        request_id="r",
        prompt="Hi",
        prompt_token_ids=[1, 7],
        outputs=[
            CompletionOutput(0, "Hello", [5, 8, 11], logprobs=lps0, finish_reason="length"),
            CompletionOutput(1, "Yo", [6], logprobs=[{6: Logprob(-1.5, 2, "Yo")}], finish_reason="stop"),
        ],
        prompt_logprobs=[None, {7: Logprob(-3.0, 4, "Hi"), 2: Logprob(-1.0, 1, "Ho")}],
        finished=True,
    )


def test_completion_response_shape_and_logprobs():
    result = _result()
    choices = completion_choices(result, logprobs=2, first_index=2)
    body = completion_response("cmpl-1", "m", 123, choices, usage_of([result]))
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "text_completion"
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 4,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    c0, c1 = body["choices"]
    assert (c0["index"], c0["text"], c0["finish_reason"]) == (2, "Hello", "length")
    assert (c1["index"], c1["finish_reason"]) == (3, "stop")
    lp = c0["logprobs"]
    assert lp["tokens"] == ["Hel", "lo", "x"]
    assert lp["token_logprobs"] == [-0.5, -2.0, -9999.0]  # -inf is clamped: JSON has no infinity
    assert lp["text_offset"] == [0, 3, 5]
    # top_logprobs: the N most likely plus the chosen token, most likely first
    assert list(lp["top_logprobs"][1].items()) == [("!", -0.1), ("?", -1.0), ("lo", -2.0)]
    assert completion_choices(result)[0]["logprobs"] is None


def test_echo_prepends_the_prompt():
    result = _result()
    (c0, _) = completion_choices(result, echo=True, logprobs=1, decode=lambda t: "<s>" if t == 1 else "?")
    assert c0["text"] == "HiHello"
    lp = c0["logprobs"]
    assert lp["tokens"][:3] == ["<s>", "Hi", "Hel"]
    assert lp["token_logprobs"][:2] == [None, -3.0] and lp["top_logprobs"][0] is None
    assert lp["text_offset"][:4] == [0, 3, 5, 8]
    assert completion_choices(result, echo=True)[1]["text"] == "HiYo"


def test_chat_response_shape_and_logprobs():
    result = _result()
    choices = [chat_choice(o, top_logprobs=2) for o in result.outputs]
    body = chat_completion_response("chatcmpl-1", "m", 5, choices, usage_of([result]))
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-1"
    c0 = body["choices"][0]
    assert c0["message"] == {"role": "assistant", "content": "Hello"}
    assert c0["finish_reason"] == "length" and c0["index"] == 0
    content = c0["logprobs"]["content"]
    assert len(content) == 3
    assert content[0] == {
        "token": "Hel",
        "logprob": -0.5,
        "bytes": list(b"Hel"),
        "top_logprobs": [
            {"token": "Hel", "logprob": -0.5, "bytes": list(b"Hel")},
            {"token": "Yo", "logprob": -1.5, "bytes": list(b"Yo")},
        ],
    }
    # the chosen token (rank 3) is not among the top 2
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["!", "?"]
    assert content[2]["logprob"] == -9999.0
    assert chat_choice(result.outputs[0])["logprobs"] is None
    assert chat_choice(result.outputs[0], top_logprobs=0)["logprobs"]["content"][0]["top_logprobs"] == []


def test_stream_chunks():
    first = chat_chunk("c", "m", 1, [chat_delta(0, role="assistant", content="")])
    assert first["object"] == "chat.completion.chunk" and "usage" not in first
    assert first["choices"][0] == {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    last = chat_chunk("c", "m", 1, [], usage={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3})
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 3
    assert chat_delta(1, finish_reason="stop")["delta"] == {}
    text = completion_chunk("x", "m", 1, [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}])
    assert text["object"] == "text_completion" and "usage" not in text


# ----------------------------------------------------------------------------- chat rendering


@pytest.fixture(scope="module")
def tokenizer(make_ckpt):
    from coreproc.base.tokenizer import load_tokenizer

    return load_tokenizer(str(make_ckpt("llama")))


def test_render_chat_string_and_parts(tokenizer):
    ids = render_chat(tokenizer, [{"role": "system", "content": "be brief"}] + USER)
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}] + USER, tokenize=False, add_generation_prompt=True
    )
    assert ids == tokenizer(text, add_special_tokens=False).input_ids
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id  # no doubled BOS
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "hello"}]},
    ]
    assert render_chat(tokenizer, parts) == ids
    req = parse_chat_request({"messages": parts})
    assert render_chat(tokenizer, req.messages) == ids  # structs render like dicts
    with_prompt = render_chat(tokenizer, USER)
    no_prompt = render_chat(tokenizer, USER, add_generation_prompt=False)
    assert with_prompt[: len(no_prompt)] == no_prompt and len(no_prompt) < len(with_prompt) - 1


def test_render_chat_errors(tokenizer):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(RequestError, match=TEXT_ONLY):
        render_chat(tokenizer, image)
    with pytest.raises(RequestError, match="chat template failed: no system role"):
        render_chat(tokenizer, USER, chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(RequestError, match="chat template failed"):
        render_chat(tokenizer, USER, chat_template="{% for %}")
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        with pytest.raises(RequestError, match="no chat template"):
            render_chat(tokenizer, USER)
    finally:
        tokenizer.chat_template = template


def test_chat_request_parts_survive_for_later_modalities():
    req = parse_chat_request(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}
    )
    assert isinstance(req, ChatCompletionRequest)
    assert req.messages[0].content[0].image_url == {"url": "u"}
