"""Structured outputs in the engine: xgrammar masks in the worker, on a tiny random checkpoint.

A random model writes garbage, so whatever it writes under a constraint shows the constraint: JSON
that validates, a regex that matches, one of the choices. Also: free rows in a mixed batch are
untouched (same tokens as alone), logprobs are the model's before masking, n > 1 with seeds,
speculative decoding gives the same tokens as without, a constraint that begins after a marker (the
reasoning's end), preemption, and a grammar xgrammar refuses fails only its own request.
Run: `pytest -q tests/workers/test_structured.py`.
"""

from __future__ import annotations

import json
import re

import pytest

from coreproc import LLM, SamplingParams
from coreproc.base.errors import InvalidParam
from coreproc.base.logits_processors import Row
from coreproc.base.protocol import StructuredSpec
from coreproc.base.tokenizer import load_tokenizer
from workers.structured import StructuredOutputs

pytestmark = pytest.mark.model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "kind", "tags"],
}
PROMPTS = ["Tell me about a pet:", "Here is some data", "x y z", "The answer is"]


def check_person(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "age", "kind", "tags"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert type(value["age"]) is int and 0 <= value["age"] <= 120
    assert value["kind"] in ("cat", "dog")
    assert len(value["tags"]) <= 3 and all(type(t) is bool for t in value["tags"])


def check_finished_person(out) -> None:
    """A finished output validates; one cut at max_tokens (a random model loves whitespace) is the
    start of an object."""
    if out.finish_reason == "stop":
        check_person(out.text)
    else:
        assert out.finish_reason == "length" and out.text.lstrip().startswith("{")


def json_spec(schema: dict) -> StructuredSpec:
    return StructuredSpec(kind="json", spec=json.dumps(schema))


@pytest.fixture(scope="module")
def llama(make_ckpt) -> str:
    return str(make_ckpt("llama"))


@pytest.fixture(scope="module")
def llm(llama: str):
    with LLM(llama, dtype="float32", show_progress=False, max_model_len=512) as engine:
        yield engine


def gen(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list:
    return [r.outputs[0] for r in llm.generate(prompts, params, use_tqdm=False)]


def test_each_kind_of_constraint_holds_in_one_mixed_batch(llm: LLM) -> None:
    specs = [
        json_spec(PERSON),
        StructuredSpec(kind="json_object"),
        StructuredSpec(kind="regex", spec=r"[a-f]{3}-\d{2,4}"),
        StructuredSpec(kind="choice", spec='["red", "green", "blue"]'),
        StructuredSpec(kind="grammar", spec='root ::= "(" num ("+" num)* ")"\nnum ::= [0-9] | [1-9] [0-9]'),
        None,
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(specs))]
    params = [SamplingParams(temperature=0, max_tokens=300, structured=s) for s in specs]
    outs = gen(llm, prompts, params)
    check_person(outs[0].text)
    # any object: a random model may write one string forever, so only a finished one must parse
    assert outs[1].text.startswith("{")
    if outs[1].finish_reason == "stop":
        assert isinstance(json.loads(outs[1].text), dict)
    assert re.fullmatch(r"[a-f]{3}-\d{2,4}", outs[2].text)
    assert outs[3].text in ("red", "green", "blue")
    assert re.fullmatch(r"\((\d+)(\+\d+)*\)", outs[4].text)
    for out in (outs[0], *outs[2:5]):  # the grammar completed: the request ended on EOS, not on max_tokens
        assert out.finish_reason == "stop"
    alone = gen(llm, [prompts[5]], [params[5]])[0]
    assert outs[5].token_ids == alone.token_ids  # a free row beside constrained ones is untouched


def test_sampled_constraint_holds_for_n_seeds_and_is_reproducible(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=150, structured=json_spec(PERSON))
    first = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs
    again = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs
    for a, b in zip(first, again):
        check_finished_person(a)
        assert a.token_ids == b.token_ids
    assert len({tuple(o.token_ids) for o in first}) > 1  # the seeds differ per sequence


def test_logprobs_are_the_models_before_masking(llm: LLM) -> None:
    """The chosen tokens' logprobs equal the prompt logprobs of the same text fed back as a prompt."""
    tok = llm.get_tokenizer()
    prompt = tok(PROMPTS[1]).input_ids
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, structured=json_spec(PERSON))
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    forced = llm.generate(
        [prompt + out.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    for i, (token, position) in enumerate(zip(out.token_ids, out.logprobs)):
        teacher = forced.prompt_logprobs[len(prompt) + i][token].logprob
        assert position[token].logprob == pytest.approx(teacher, abs=1e-4)
    # a random model rarely puts JSON first: masking moved the choice, not the reported numbers
    assert any(position[token].rank > 1 for token, position in zip(out.token_ids, out.logprobs))


def test_speculative_decoding_keeps_the_constraint_and_the_tokens(
    llama: str, steady_step_costs: None
) -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    prompts = [PROMPTS[0] + ' {"name": "a", "age": 1, "kind": "cat", "tags": [true]}' * 3, PROMPTS[2]]
    params = SamplingParams(temperature=0, max_tokens=200, structured=json_spec(PERSON))
    runs = []
    for speculative_config in (None, spec):
        with LLM(llama, dtype="float32", show_progress=False, speculative_config=speculative_config) as e:
            runs.append(gen(e, prompts, [params] * 2))
            stats = e.stats()
    for plain, fast in zip(*runs):
        check_finished_person(fast)
        assert fast.token_ids == plain.token_ids
    assert stats.spec_num_proposed > 0  # proposals were made (and checked against the grammar)


def test_preempted_constrained_requests_resume_within_the_grammar(llama: str) -> None:
    setup = {"num_kv_blocks": 10, "block_size": 8, "max_model_len": 80}
    with LLM(llama, dtype="float32", show_progress=False, **setup) as e:
        outs = gen(
            e, PROMPTS, [SamplingParams(temperature=0, max_tokens=60, structured=json_spec(PERSON))] * 4
        )
        assert e.stats().num_preemptions > 0
    for out in outs:
        check_finished_person(out)


def test_invalid_constraint_is_an_invalid_param_and_the_engine_goes_on(llm: LLM) -> None:
    bad = [
        StructuredSpec(kind="grammar", spec="root ::= undefined_rule"),
        StructuredSpec(kind="regex", spec="([a-z]"),
        json_spec({"type": "no-such-type"}),
    ]
    for spec in bad:
        with pytest.raises(InvalidParam, match=f"invalid {spec.kind} constraint"):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, structured=spec), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats().num_blocks_in_use == 0  # the refused requests' blocks were freed
    with pytest.raises(InvalidParam, match="not valid JSON"):
        SamplingParams(structured=StructuredSpec(kind="json", spec="{nope")).validate()
    with pytest.raises(InvalidParam, match="choice"):
        SamplingParams(structured=StructuredSpec(kind="choice", spec="[]")).validate()
    out = gen(llm, [PROMPTS[0]], [SamplingParams(temperature=0, max_tokens=5)])[0]
    assert len(out.token_ids) == 5


@pytest.mark.unit
def test_constraint_starts_after_the_marker_and_follows_rollbacks(llama: str) -> None:
    """The worker side alone: rows before the marker are free; after it masked; a shorter or
    different output (rejected proposals) rolls the matcher back."""
    import torch

    tok = load_tokenizer(llama)
    vocab = len(tok)
    marker = tok.encode("</think>", add_special_tokens=False)
    digits = StructuredSpec(kind="regex", spec="[0-9]{4}", after=marker)
    so = StructuredOutputs(llama, vocab, [tok.eos_token_id])
    params = SamplingParams(structured=digits)
    allowed = {t for t in range(vocab) if tok.decode([t]) and tok.decode([t]).isdigit()}

    def mask(output: list[int]) -> set[int]:
        logits = so.apply(torch.zeros(1, vocab), [Row(0, params, [1], output, [tok.eos_token_id], "r")])
        return set(torch.nonzero(logits[0] == 0).flatten().tolist())

    thinking = tok.encode("some thoughts", add_special_tokens=False)
    assert len(mask(thinking)) == vocab  # before the marker: untouched
    after = thinking + marker
    first = mask(after)
    assert first and first <= allowed  # after it: only digit tokens
    one = tok.encode("1", add_special_tokens=False)
    mask(after + one + one)
    assert mask(after + one) == mask(after + tok.encode("7", add_special_tokens=False))  # rolled back
    assert mask(after) == first
    assert len(mask(thinking)) == vocab  # the marker was a rejected proposal: free again
    assert mask(after + one) <= allowed  # and constrained once it is really there
    assert so.pop_failed() == {}


@pytest.mark.unit
def test_bounded_strings_hold_no_control_characters(llama: str) -> None:
    """JSON strings never carry raw control characters, with or without a min/maxLength."""
    import torch

    tok = load_tokenizer(llama)
    vocab = len(tok)
    so = StructuredOutputs(llama, vocab, [tok.eos_token_id])
    control = {t for t in range(vocab) if any(ord(c) < 32 for c in tok.decode([t]))}
    assert control  # the byte-level vocabulary has them
    for bound in ({}, {"maxLength": 8}, {"minLength": 2}):
        spec = json_spec(
            {"type": "object", "properties": {"s": {"type": "string", **bound}}, "required": ["s"]}
        )
        row = Row(
            0,
            SamplingParams(structured=spec),
            [1],
            tok.encode('{"s": "a', add_special_tokens=False),
            [],
            str(bound),
        )
        logits = so.apply(torch.zeros(1, vocab), [row])
        allowed = set(torch.nonzero(logits[0] == 0).flatten().tolist())
        assert allowed and not allowed & control, bound


def test_logits_processors_and_stop_strings_compose_with_a_constraint(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    choice = StructuredSpec(kind="choice", spec='["red", "green", "blue"]')
    banned = {t: -100.0 for t in range(len(tok)) if tok.decode([t]).lstrip()[:1] in ("r", "b")}
    outs = gen(
        llm,
        PROMPTS[:2],
        [SamplingParams(temperature=0, max_tokens=10, logit_bias=banned, structured=choice)] * 2,
    )
    assert [o.text for o in outs] == ["green", "green"]  # the grammar and the bias together leave one
    cut = SamplingParams(temperature=0, max_tokens=200, stop=['"age"'], structured=json_spec(PERSON))
    out = gen(llm, [PROMPTS[0]], [cut])[0]
    assert out.finish_reason == "stop" and '"age"' not in out.text and out.text.lstrip().startswith("{")


def test_tensor_parallel_ranks_mask_alike(llama: str, llm: LLM) -> None:
    params = [SamplingParams(temperature=0, max_tokens=200, structured=json_spec(PERSON))] * 2
    one = gen(llm, PROMPTS[:2], params)
    with LLM(llama, dtype="float32", show_progress=False, max_model_len=512, tensor_parallel_size=2) as tp:
        two = gen(tp, PROMPTS[:2], params)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
