"""Hypothesis strategies for the wire fuzz tests: garbage, truncated and ill-shaped protocol frames.

Not a test module (imported by tests/e2e/test_fuzz_wire.py and tests/e2e/test_fuzz_links.py). A frame list is
what a peer sends after ZeroMQ's routing identity: normally [kind byte, msgpack body]. The strategies
mix pure noise, a real kind with noise, real messages cut short or with a byte flipped, msgpack of the
wrong shape, wrong frame counts, and `SubmitRequests` whose fields hold NaN, infinities, negative and
64-bit numbers and token ids outside the vocabulary. `Tally` counts the cases each socket took.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import msgspec
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from coreproc.base.protocol import (
    KIND_OF,
    STRUCTURED_KINDS,
    UTILITY_METHODS,
    AbortRequests,
    SubmitRequests,
    UtilityCall,
)

EXAMPLES = int(os.environ.get("EMBER_FUZZ_WIRE_EXAMPLES", "200"))  # per socket; CI's short profile
ALL_KINDS = sorted(set(KIND_OF.values()))
ENC = msgspec.msgpack.Encoder()
# no shrinking: after a crash every case fails, so the first failing case is the one to report
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
KIND_OF_SUBMIT, KIND_OF_ABORT, KIND_OF_CALL = (
    KIND_OF[SubmitRequests],
    KIND_OF[AbortRequests],
    KIND_OF[UtilityCall],
)

# every value msgpack can carry, nested a little
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
wild_int = st.one_of(st.integers(-3, 300), st.integers(-(2**63), 2**64 - 1))
wild_float = st.one_of(st.floats(), st.floats(-3, 3), st.sampled_from([float("nan"), float("inf"), -1.0]))


def sampling_params(vocab: int) -> st.SearchStrategy[dict[str, Any]]:
    """SamplingParams as a map, each field optional and mostly out of range."""
    ids = st.lists(st.one_of(st.integers(0, vocab - 1), wild_int), max_size=4)
    fields = {
        "n": wild_int,
        "temperature": wild_float,
        "top_p": wild_float,
        "top_k": wild_int,
        "min_p": wild_float,
        "seed": st.none() | wild_int,
        "presence_penalty": wild_float,
        "frequency_penalty": wild_float,
        "repetition_penalty": wild_float,
        "max_tokens": st.one_of(st.none(), st.integers(-2, 24), wild_int),
        "min_tokens": st.one_of(st.integers(-2, 24), wild_int),
        "stop": st.lists(st.text(max_size=4), max_size=3),
        "stop_token_ids": ids,
        "ignore_eos": st.booleans(),
        "logprobs": st.none() | wild_int,
        "prompt_logprobs": st.none() | wild_int,
        "logit_bias": st.none() | st.dictionaries(wild_int, wild_float, max_size=3),
        "allowed_token_ids": st.none() | ids,
        "bad_words_token_ids": st.lists(ids, max_size=3),
        "logits_processor_args": st.dictionaries(st.text(max_size=8), values, max_size=2),
        "structured": st.none()
        | st.fixed_dictionaries(
            {"kind": st.sampled_from([*STRUCTURED_KINDS, "bogus"])},
            optional={"spec": st.text(max_size=24), "after": ids},
        ),
    }
    # one wild field on sane ones reaches each field's own check; all of them at once, the first check
    one = st.sampled_from(sorted(fields)).flatmap(
        lambda name: fields[name].map(lambda v: {"temperature": 0.0, "max_tokens": 4, name: v})
    )
    return st.one_of(one, st.fixed_dictionaries({}, optional=fields))


def engine_request(vocab: int) -> st.SearchStrategy[dict[str, Any]]:
    prompt = st.one_of(
        st.lists(st.integers(0, vocab - 1), min_size=1, max_size=16), st.lists(wild_int, max_size=16)
    )
    mm_ref = st.tuples(st.text(max_size=8), wild_int, wild_int, st.none() | values)
    return st.fixed_dictionaries(
        {
            "request_id": st.text(max_size=6),
            "prompt_token_ids": prompt,
            "sampling_params": sampling_params(vocab),
        },
        optional={
            "eos_token_ids": st.lists(wild_int, max_size=3),
            "arrival_time": wild_float,
            "priority": wild_int,
            "cache_salt": st.none() | st.text(max_size=8),
            "lora": st.none() | st.tuples(st.text(max_size=6), st.text(max_size=6), st.text(max_size=6)),
            "mm_refs": st.lists(mm_ref, max_size=2),
        },
    )


def core_messages(vocab: int) -> st.SearchStrategy[list[bytes]]:
    """Well-framed client messages of the right kinds with wild fields."""
    submit = st.lists(engine_request(vocab), max_size=3).map(lambda rs: [KIND_OF_SUBMIT, ENC.encode([rs])])
    abort = st.lists(st.text(max_size=6) | values, max_size=3).map(lambda a: [KIND_OF_ABORT, ENC.encode([a])])
    method = st.sampled_from(UTILITY_METHODS) | st.text(max_size=12) | values
    args = st.dictionaries(st.sampled_from(["lora_name", "lora_path", "x"]), values, max_size=2) | values
    call = st.tuples(st.integers(-1, 2**20) | wild_int, method, args).map(
        lambda c: [KIND_OF_CALL, ENC.encode(list(c))]
    )
    return st.one_of(submit, abort, call)


@st.composite
def mangled(draw: st.DrawFn, samples: list[Any]) -> list[bytes]:
    """A real message cut short, or with one byte changed."""
    msg = draw(st.sampled_from(samples))
    kind, body = KIND_OF[type(msg)], ENC.encode(msg)
    if body and draw(st.booleans()):
        i = draw(st.integers(0, len(body) - 1))
        body = body[:i] + bytes([draw(st.integers(0, 255))]) + body[i + 1 :]
    else:
        body = body[: draw(st.integers(0, max(0, len(body) - 1)))]
    return [kind, body]


def garbage(samples: list[Any], wrong_kinds: bool = True) -> st.SearchStrategy[list[bytes]]:
    """Frames that are not a message of any socket's direction, or are one broken."""
    kinds = st.sampled_from([*ALL_KINDS, b"", b"\xff", b"ab"]) if wrong_kinds else st.sampled_from(ALL_KINDS)
    return st.one_of(
        st.lists(st.binary(max_size=48), min_size=1, max_size=5),  # noise, any frame count
        st.tuples(kinds, st.binary(max_size=96)).map(list),  # a kind, then noise
        st.tuples(kinds, values.map(ENC.encode)).map(list),  # msgpack of the wrong shape
        mangled(samples),
        st.tuples(kinds, values.map(ENC.encode), st.binary(max_size=8)).map(list),  # an extra frame
    )


class Tally:
    """Cases per socket, printed as one summary line each when the module ends."""

    counts: Counter[str] = Counter()

    @classmethod
    def add(cls, socket: str) -> None:
        cls.counts[socket] += 1

    @classmethod
    def summary(cls) -> list[str]:
        return [f"fuzz {name}: {n} cases, 0 crashes" for name, n in sorted(cls.counts.items())]
