"""LoRA adapters through the core process, the SDK, the HTTP API and `ember batch`, against PEFT.

Real processes: an `ember-core` reached through `EngineClient` (load, generate with an adapter, unload
while a request runs with it), an `ember serve` driven by the real `openai` package (`model="a"` gives
PEFT's greedy token ids, `/v1/models` lists adapters with their `parent`, runtime load and unload,
the refusals as 400s, unloaded adapters as 404s) and a batch file whose lines name an adapter. Adapters
are made with `peft` (tests/workers/test_lora.py). Which routes exist without `--enable-lora-runtime-updates`,
and that the API key guards them, is checked on the app itself (no second server).
Run: `pytest -q tests/e2e/test_lora_server.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from coreproc import SamplingParams
from coreproc.base.config import EngineConfig
from coreproc.client.sdk import EngineClient, EngineRequestError
from coreproc.startup.launcher import CoreProcess
from coreproc.text.openai_protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, parse_body
from frontend.cli import main
from frontend.http.server import build_app
from frontend.http.settings import ServerConfig
from tests.frontend.test_openapi import request_schema, sample
from tests.server_util import start_server, stop_server, wait_idle
from tests.workers.test_lora import ATTENTION, EVERYTHING, MAX_NEW, make_adapter, peft_greedy

pytestmark = pytest.mark.e2e

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
TEXTS = ("def add(a, b):", "import numpy as np\n", "class Tree:")
LONG = 960  # tokens: a request that runs for a second or so (the tiny model's context is 1024)


@pytest.fixture(scope="module")
def base(make_ckpt) -> Path:
    return make_ckpt("llama")


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-adapters")
    return {
        "a": make_adapter(base, root / "a", 8, EVERYTHING, seed=11),
        "b": make_adapter(base, root / "b", 4, [*ATTENTION, "down_proj"], seed=12, rslora=True),
        "big": make_adapter(base, root / "big", 32, ATTENTION, seed=13),
        "emb": make_adapter(base, root / "emb", 4, ["q_proj", "embed_tokens"], seed=14),
    }


@pytest.fixture(scope="module")
def prompts(base: Path) -> list[list[int]]:
    from coreproc.base.tokenizer import load_tokenizer

    tok = load_tokenizer(str(base))
    return [tok(t).input_ids for t in TEXTS]


@pytest.fixture(scope="module")
def server(base: Path, adapters: dict[str, Path]):
    flags = ["--enable-lora", "--enable-lora-runtime-updates", "--max-cpu-loras", "4"]
    proc, url = start_server(str(base), *flags, "--lora-modules", f"a={adapters['a']}")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def completion_ids(client: openai.OpenAI, model: str, prompt: list[int], **kw) -> tuple[list[int], str]:
    """Greedy token ids (as `token_id:N` logprob names) and the response's model name."""
    out = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_NEW,
        temperature=0,
        logprobs=1,
        extra_body={"min_tokens": MAX_NEW, "return_tokens_as_token_ids": True, **kw},
    )
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens], out.model


def load(url: str, name: str, path: Path | str, **extra) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path), **extra}
    return httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)


def unload(url: str, name: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


# ----------------------------------------------------------------------------- the SDK


def test_sdk_load_generate_unload_equal_peft(base, adapters, prompts):
    config = EngineConfig.create(str(base), dtype="float32", enable_lora=True, max_cpu_loras=4)
    with CoreProcess(config) as core, EngineClient(core.address) as client:
        assert client.info_cache.lora_enabled and client.info_cache.loras == {}
        loaded = client.load_lora("a", str(adapters["a"]))
        assert loaded == {"lora_name": "a", "lora_path": str(adapters["a"].resolve()), "rank": 8}
        assert client.info().loras == {"a": str(adapters["a"].resolve())}
        for p in prompts[:2]:
            with_a = [t for o in client.generate(p, GREEDY, lora="a") for t in o.new_token_ids]
            plain = [t for o in client.generate(p, GREEDY) for t in o.new_token_ids]
            assert with_a == peft_greedy(base, adapters["a"], p)
            assert plain == peft_greedy(base, None, p) != with_a
        with pytest.raises(EngineRequestError, match="no adapter_config.json"):
            client.load_lora("bad", str(adapters["a"].parent / "missing"))
        with pytest.raises(EngineRequestError, match="rank 32 exceeds --max-lora-rank 16"):
            client.load_lora("bad", str(adapters["big"]))
        with pytest.raises(EngineRequestError, match="^no LoRA adapter named 'nope' is loaded$"):
            client.unload_lora("nope")

        # unloading an adapter a request runs with: the request finishes with it; new ones are refused
        long = SamplingParams(temperature=0.0, max_tokens=LONG, min_tokens=MAX_NEW, ignore_eos=True)
        stream = client.generate(prompts[0], long, lora="a")
        first = next(stream)
        assert client.unload_lora("a") == {"lora_name": "a"}
        assert client.stats().num_running == 1, "the request still runs after its adapter was unloaded"
        outs = [first, *stream]
        tokens = [t for o in outs for t in o.new_token_ids]
        assert outs[-1].finish_reason == "length" and len(tokens) == LONG
        assert tokens[:MAX_NEW] == peft_greedy(base, adapters["a"], prompts[0])
        with pytest.raises(EngineRequestError, match="no LoRA adapter named 'a'") as refused:
            list(client.generate(prompts[0], GREEDY, lora="a"))
        assert refused.value.code == "invalid_request"
        assert client.info().loras == {} and client.stats().num_blocks_in_use == 0


# ----------------------------------------------------------------------------- the HTTP API


def test_http_adapter_equals_peft_and_responses_name_it(client, base, adapters, prompts):
    for p in prompts:
        with_a, model = completion_ids(client, "a", p)
        assert model == "a" and with_a == peft_greedy(base, adapters["a"], p)
        plain, model = completion_ids(client, "llama", p)
        assert model == "llama" and plain == peft_greedy(base, None, p) != with_a
    chunks = list(
        client.chat.completions.create(
            model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, stream=True
        )
    )
    assert {c.model for c in chunks} == {"a"}


def test_models_lists_adapters_with_their_parent(client, server, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["llama", "a"]
    assert cards["a"].parent == "llama" and cards["a"].root == str(adapters["a"].resolve())
    assert cards["llama"].parent is None
    paths = httpx.get(f"{server}/openapi.json").json()["paths"]
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(paths)


def test_runtime_load_use_reload_and_unload(client, server, base, adapters, prompts):
    answer = load(server, "b", adapters["b"])
    assert answer.status_code == 200, answer.text
    assert answer.json()["lora_path"] == str(adapters["b"].resolve()) and "'b'" in answer.json()["message"]
    tokens, model = completion_ids(client, "b", prompts[1])
    assert model == "b" and tokens == peft_greedy(base, adapters["b"], prompts[1])
    assert [m.id for m in client.models.list().data] == ["llama", "a", "b"]

    again = load(server, "b", adapters["a"])  # a name in use: only with load_inplace
    assert again.status_code == 400 and "load_inplace" in again.json()["error"]["message"]
    assert load(server, "b", adapters["a"], load_inplace=True).status_code == 200
    tokens, _ = completion_ids(client, "b", prompts[1])
    assert tokens == peft_greedy(base, adapters["a"], prompts[1])  # the new weights

    assert unload(server, "b").status_code == 200
    with pytest.raises(openai.NotFoundError, match="the model 'b' does not exist"):
        completion_ids(client, "b", prompts[1])
    assert [m.id for m in client.models.list().data] == ["llama", "a"]
    wait_idle(server)


def test_bad_adapters_and_names_are_400s(server, adapters, base):
    cases = {
        ("bad", str(adapters["a"].parent / "missing")): "no adapter_config.json",
        ("bad", str(adapters["big"])): "rank 32 exceeds --max-lora-rank 16",
        ("bad", str(adapters["emb"])): "embed_tokens",
        ("llama", str(adapters["b"])): "the served model's name",
    }
    for (name, path), message in cases.items():
        answer = load(server, name, path)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error"
    missing = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "x"}, timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    gone = unload(server, "never-loaded")
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "lora_name"
    assert "no LoRA adapter named 'never-loaded'" in gone.json()["error"]["message"]
    assert httpx.get(f"{server}/health").status_code == 200


def test_unloading_lets_running_streams_finish(client, server, adapters, prompts):
    assert load(server, "c", adapters["b"]).status_code == 200
    stream = client.completions.create(
        model="c",
        prompt=prompts[2],
        max_tokens=LONG,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [next(stream)]
    assert unload(server, "c").status_code == 200
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt=prompts[2], max_tokens=2)
    wait_idle(server)


@pytest.mark.unit
def test_lora_routes_only_with_the_flag_and_behind_the_api_key():
    """The real app's routes (no engine behind it: a route that exists answers 503 "starting")."""
    bodies = {
        "/v1/load_lora_adapter": {"lora_name": "x", "lora_path": "/nowhere"},
        "/v1/unload_lora_adapter": {"lora_name": "x"},
    }
    off = TestClient(build_app(["ipc:///nowhere"], "/models/llama", ServerConfig()))
    for route, body in bodies.items():
        answer = off.post(route, json=body)
        assert answer.status_code == 404 and answer.json()["error"]["message"] == f"no route {route}"
    assert "/v1/load_lora_adapter" not in off.get("/openapi.json").json()["paths"]
    cfg = ServerConfig(api_key="k", enable_lora_runtime_updates=True)
    on = TestClient(build_app(["ipc:///nowhere"], "/models/llama", cfg))
    for route, body in bodies.items():
        assert on.post(route, json=body).status_code == 401
        assert on.post(route, json=body, headers={"Authorization": "Bearer k"}).status_code == 503
    doc = on.get("/openapi.json").json()
    types = {
        "/v1/load_lora_adapter": LoadLoRAAdapterRequest,
        "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest,
    }
    for route, typ in types.items():
        assert doc["paths"][route]["post"]["security"] == [{"bearerAuth": []}]
        schema = request_schema(doc, route)  # the documented fields are the parser's fields
        parsed = parse_body(sample(doc, schema, all_fields=True), typ)
        assert set(parsed.__struct_fields__) == set(schema["properties"])


# ----------------------------------------------------------------------------- batch mode


def test_batch_lines_naming_an_adapter_run_with_it(base, adapters, prompts, tmp_path):
    def line(cid: str, model: str, prompt: list[int]) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_NEW, "min_tokens": MAX_NEW}
        body |= {"temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True}
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body})

    lines = [line(f"a{i}", "a", p) for i, p in enumerate(prompts)]
    lines += [line(f"base{i}", "anything", p) for i, p in enumerate(prompts)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    flags = ["--model", str(base), "--dtype", "float32", "--no-progress", "--enable-lora"]
    argv = ["batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out), *flags]
    assert main([*argv, "--lora-modules", f"a={adapters['a']}"]) == 0
    records = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    for i, p in enumerate(prompts):
        for cid, model, adapter in ((f"a{i}", "a", adapters["a"]), (f"base{i}", base.name, None)):
            body = records[cid]["body"]
            tokens = [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]
            assert body["model"] == model and tokens == peft_greedy(base, adapter, p), cid
