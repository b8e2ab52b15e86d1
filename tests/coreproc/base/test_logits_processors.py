"""Logits processors: the built-ins' effects, validation at admission (scheduler, HTTP, batch), and a
third-party processor loaded by `--logits-processors module:Class` and by its entry point.

The third-party processor lives in tests/plugins (a module plus a dist-info folder declaring it in
the `ember.logits_processors` entry-point group).
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
import torch

from coreproc import LLM, SamplingParams
from coreproc.base.errors import InvalidParam
from coreproc.base.logits_processors import (
    ProcessorContext,
    Row,
    installed_specs,
    load_processors,
    processor_specs,
)
from coreproc.base.protocol import EngineRequest
from coreproc.core.scheduler import Scheduler
from frontend.cli import main
from tests.paths import PLUGINS
from tests.sched_util import make_config
from tests.server_util import start_server, stop_server
from tests.workers.test_sampling import batch, builtin_processors
from workers.sampler import Sampler

VOCAB = 50


def greedy_pick(rows: list[Row], logits: torch.Tensor) -> list[int]:
    n = len(rows)
    fields = dict(
        temperature=[0.0] * n,
        prompt_ids=[r.prompt_ids for r in rows],
        output_ids=[r.output_ids for r in rows],
    )
    out = Sampler(torch.device("cpu"), processors=builtin_processors(VOCAB))(
        logits, batch(n, rows=rows, **fields)
    )
    assert torch.allclose(
        out.sampled_logprob, torch.log_softmax(logits, -1).gather(1, out.sampled[:, None])[:, 0]
    )
    return out.sampled.tolist()


@pytest.mark.unit
def test_builtins_change_only_their_rows():
    logits = torch.zeros(5, VOCAB)
    logits[:, 3] = 5.0  # the favourite everywhere
    rows = [
        Row(0, SamplingParams(), [1], [], []),
        Row(1, SamplingParams(logit_bias={9: 10.0}), [1], [], []),
        Row(2, SamplingParams(allowed_token_ids=[20, 21]), [1], [], []),
        Row(3, SamplingParams(bad_words_token_ids=[[3], [7, 8]]), [1], [], []),
        Row(4, SamplingParams(logit_bias={3: -100.0}), [1], [], []),
    ]
    logits[2, 21] = 1.0
    logits[3, 8] = 4.0  # second best, allowed: [7, 8] is banned only after 7
    logits[4, 12] = 0.5
    assert greedy_pick(rows, logits.clone()) == [3, 9, 21, 8, 12]
    rows[3].output_ids.append(7)  # now 8 would complete a bad word
    assert greedy_pick(rows, logits.clone())[3] not in (3, 8)


@pytest.mark.unit
@pytest.mark.parametrize(
    "params, param",
    [
        (SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias"),
        (SamplingParams(logit_bias={3: 101.0}), "logit_bias"),
        (SamplingParams(allowed_token_ids=[]), "allowed_token_ids"),
        (SamplingParams(allowed_token_ids=[-1]), "allowed_token_ids"),
        (SamplingParams(bad_words=["x"]), "bad_words"),
        (SamplingParams(bad_words_token_ids=[[]]), "bad_words"),
        (SamplingParams(logits_processor_args={"nope": 1}), "logits_processor_args"),
    ],
)
def test_bad_arguments_are_refused_at_admission(params, param):
    sched = Scheduler(make_config(), num_kv_blocks=40)
    with pytest.raises(InvalidParam) as err:
        sched.add_request(EngineRequest(request_id="x", prompt_token_ids=[3, 4], sampling_params=params))
    assert err.value.param == param and not sched.requests


@pytest.mark.unit
def test_plugin_by_entry_point_and_by_flag(monkeypatch):
    assert not any("ember_test_plugin" in s for s in processor_specs())
    monkeypatch.syspath_prepend(str(PLUGINS))
    assert "ember_test_plugin:ForceToken" in processor_specs()  # found through its entry point
    procs = load_processors(processor_specs(("ember_test_plugin:ForceToken",)), ProcessorContext(VOCAB, 128))
    assert [p.name for p in procs].count("force_token") == 1
    cfg = make_config(logits_processors=installed_specs())  # what EngineConfig.create finds
    sched = Scheduler(cfg, num_kv_blocks=40)
    bad = SamplingParams(logits_processor_args={"force_token": {"token": VOCAB}})
    with pytest.raises(InvalidParam) as err:
        sched.add_request(EngineRequest(request_id="x", prompt_token_ids=[3], sampling_params=bad))
    assert err.value.param == "logits_processor_args.force_token" and "token must be in" in str(err.value)
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_processors(["no_such_module:Thing"], ProcessorContext(VOCAB, 128))


@pytest.fixture(scope="module")
def llama(make_ckpt) -> str:
    return str(make_ckpt("llama"))


@pytest.mark.model
def test_processors_in_the_engine(llama, monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    with LLM(
        llama, dtype="float32", show_progress=False, logits_processors=["ember_test_plugin:ForceToken"]
    ) as llm:
        prompt = [5, 6, 7, 8]
        force = SamplingParams(
            temperature=0.0, max_tokens=6, logits_processor_args={"force_token": {"token": 42, "after": 2}}
        )
        plain, forced = llm.generate([prompt, prompt], [SamplingParams(temperature=0.0, max_tokens=6), force])
        assert forced.outputs[0].token_ids[:2] == plain.outputs[0].token_ids[:2]
        assert forced.outputs[0].token_ids[2:] == [42] * 4
        allowed = SamplingParams(temperature=0.9, seed=1, max_tokens=12, allowed_token_ids=[10, 11, 12])
        assert set(llm.generate([prompt], allowed)[0].outputs[0].token_ids) <= {10, 11, 12}
        eos = llm.get_tokenizer().eos_token_id
        words = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, logit_bias={eos: 100.0})
        assert llm.generate([prompt], words)[0].outputs[0].token_ids != [eos] * 4  # min_tokens first
        first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0].token_ids
        pair = first[:2]  # ban the greedy continuation's first two tokens as one "word"
        banned = SamplingParams(temperature=0.0, max_tokens=16, bad_words_token_ids=[pair])
        got = llm.generate([prompt], banned)[0].outputs[0].token_ids
        tokens = prompt + got
        assert all(tokens[i : i + 2] != pair for i in range(len(prompt) - 1, len(tokens) - 1))
        assert got[0] == pair[0]  # the first token alone is fine
        # text bad words become the token sequences of the word as written and mid-sentence
        tok = llm.get_tokenizer()
        ids = llm.processor.bad_word_ids(["return"])
        assert tok.encode("return", add_special_tokens=False) in ids
        assert tok.encode(" return", add_special_tokens=False) in ids


@pytest.mark.e2e
def test_http_and_batch_validate_at_admission(llama, tmp_path):
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{PLUGINS}{os.pathsep}{env_path}"  # the core finds the plugin's entry point
    try:
        proc, url = start_server(llama)
    finally:
        os.environ["PYTHONPATH"] = env_path
    try:
        base = {"model": "llama", "prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0}
        for stream in (False, True):
            for extra, param in (
                ({"logit_bias": {"100000": 1}}, "logit_bias"),
                (
                    {"logits_processor_args": {"force_token": {"token": "x"}}},
                    "logits_processor_args.force_token",
                ),
                ({"logits_processor_args": {"unknown": {}}}, "logits_processor_args"),
            ):
                r = httpx.post(f"{url}/v1/completions", json={**base, **extra, "stream": stream}, timeout=60)
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == param
        forced = {**base, "logits_processor_args": {"force_token": {"token": 42}}}
        r = httpx.post(f"{url}/v1/completions", json=forced, timeout=60)
        assert r.status_code == 200
        expect = httpx.post(f"{url}/detokenize", json={"tokens": [42] * 5}).json()["prompt"]
        assert r.json()["choices"][0]["text"] == expect  # the plugin forced every token
    finally:
        stop_server(proc)
    lines = [
        {"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": base},
        {
            "custom_id": "bad",
            "method": "POST",
            "url": "/v1/completions",
            "body": {**base, "allowed_token_ids": [10**6]},
        },
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert (
        main(
            ["batch", "-i", str(src), "-o", str(out), "--model", llama, "--dtype", "float32", "--no-progress"]
        )
        == 0
    )
    recs = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    assert recs["ok"]["status_code"] == 200
    assert recs["bad"]["status_code"] == 400 and recs["bad"]["body"]["error"]["param"] == "allowed_token_ids"
