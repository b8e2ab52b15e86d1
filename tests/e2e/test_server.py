"""The OpenAI-compatible HTTP server, driven by the real `openai` package (and raw HTTP where needed).

Each server is a real `ember serve` process (with its ember-core and worker) on a tiny checkpoint.
Greedy output must equal the offline `LLM`; every documented error must raise the matching `openai`
exception; disconnects and engine death must free or fail work, never hang.
Run: `pytest -q tests/e2e/test_server.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest

from coreproc import LLM, SamplingParams
from tests.e2e.test_multiproc import gone
from tests.hf_ref import PROMPT_TEXTS
from tests.server_util import metric, start_server, stop_server, wait_idle

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def llama(make_ckpt) -> str:
    return str(make_ckpt("llama"))


@pytest.fixture(scope="module")
def server(llama):
    proc, url = start_server(llama, "--max-num-seqs", "64", "--max-request-bytes", "20000")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(llama):
    with LLM(llama, dtype="float32", show_progress=False) as llm:
        yield llm


def test_completions_equal_offline_greedy(client, offline):
    ref = offline.generate(PROMPT_TEXTS[:4], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    for prompt, expect in zip(PROMPT_TEXTS[:4], ref):
        out = client.completions.create(model="llama", prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == expect.outputs[0].text
        assert out.usage.prompt_tokens == len(expect.prompt_token_ids)
        assert out.usage.completion_tokens == len(expect.outputs[0].token_ids)
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
        streamed = client.completions.create(
            model="llama",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(streamed)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expect.outputs[0].text
        assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_chat_streaming_and_not(client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    ids = offline.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    expect = offline.generate([ids], SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)[0]
    out = client.chat.completions.create(
        model="llama", messages=messages, max_completion_tokens=10, temperature=0
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expect.outputs[0].text
    assert out.usage.prompt_tokens == len(ids)
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}]},
    ]
    stream = client.chat.completions.create(
        model="llama",
        messages=parts,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) > 0
    assert chunks[-1].usage.completion_tokens == 10


def test_logprobs_n_and_stop(client, offline):
    out = client.completions.create(
        model="llama", prompt=PROMPT_TEXTS[1], max_tokens=6, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6 and all(len(t) >= 3 for t in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)
    chat = client.chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(chat.choices[0].logprobs.content) == 5
    assert all(len(e.top_logprobs) == 2 for e in chat.choices[0].logprobs.content)
    many = client.completions.create(
        model="llama",
        prompt=PROMPT_TEXTS[0],
        max_tokens=8,
        n=3,
        seed=11,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert len({c.text for c in many.choices}) > 1
    assert many.usage.completion_tokens == 3 * 8
    base = client.completions.create(model="llama", prompt=PROMPT_TEXTS[3], max_tokens=30, temperature=0)
    stop = base.choices[0].text[8:11]
    cut = client.completions.create(
        model="llama", prompt=PROMPT_TEXTS[3], max_tokens=30, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == base.choices[0].text[: base.choices[0].text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    batch = client.completions.create(model="llama", prompt=PROMPT_TEXTS[:2], max_tokens=4, temperature=0)
    assert sorted(c.index for c in batch.choices) == [0, 1]
    # streamed, 2 prompts x n=2: prompt k's sequence i is choice k * n + i
    texts: dict[int, str] = {}
    for chunk in client.completions.create(
        model="llama", prompt=PROMPT_TEXTS[:2], n=2, max_tokens=4, temperature=0, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    by_prompt = {c.index: c.text for c in batch.choices}
    assert texts == {0: by_prompt[0], 1: by_prompt[0], 2: by_prompt[1], 3: by_prompt[1]}
    ids = client.completions.create(model="llama", prompt=[[1, 40, 41], [1, 50]], max_tokens=4, temperature=0)
    assert sorted(c.index for c in ids.choices) == [0, 1] and ids.usage.prompt_tokens == 5


def test_errors_raise_the_matching_openai_exceptions(client, server):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="llama", prompt="x", max_tokens=5000)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="llama", prompt="x", max_tokens=2, top_p=5.0)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="llama", prompt="x", extra_body={"max_tokens": "many"})
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="llama", prompt="x" * 30000, max_tokens=2)
    assert e.value.status_code == 413
    raw = httpx.post(
        f"{server}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert raw.status_code == 400
    body = raw.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    for resp, status in (
        (httpx.get(f"{server}/v1/nothing"), 404),
        (httpx.get(f"{server}/v1/completions"), 405),
    ):
        assert resp.status_code == status and set(resp.json()["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }


def test_tokenize_detokenize_models_version_openapi(server, offline):
    tok = httpx.post(f"{server}/tokenize", json={"prompt": "def f(x):"}).json()
    assert tok["tokens"] == offline.get_tokenizer()("def f(x):").input_ids and tok["count"] == len(
        tok["tokens"]
    )
    assert (
        httpx.post(f"{server}/detokenize", json={"tokens": tok["tokens"][1:]}).json()["prompt"] == "def f(x):"
    )
    assert httpx.get(f"{server}/v1/models").json()["data"][0]["id"] == "llama"
    assert httpx.get(f"{server}/version").json()["version"]
    spec = httpx.get(f"{server}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/health"} <= set(spec["paths"])
    assert httpx.get(f"{server}/health").status_code == 200


def test_64_concurrent_streams_complete_and_free_blocks(server, offline):
    aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(i: int) -> tuple[str, int]:
        stream = await aclient.completions.create(
            model="llama",
            prompt=PROMPT_TEXTS[i % len(PROMPT_TEXTS)],
            max_tokens=16,
            temperature=0,
            stream=True,
        )
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run() -> list:
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    ref = offline.generate(PROMPT_TEXTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    for i, (text, reason) in enumerate(results):
        assert reason in ("length", "stop")
        assert text == ref[i % len(PROMPT_TEXTS)].outputs[0].text
    wait_idle(server)
    assert metric(server, "ember_requests_total") >= 64
    assert metric(server, "ember_generation_tokens_total") >= 64 * 16
    assert metric(server, "ember_time_to_first_token_seconds_count") >= 64


def test_disconnect_aborts_the_request(server):
    aborted = metric(server, "ember_requests_total", 'finished_reason="abort"')
    completed = metric(server, "ember_requests_total", 'finished_reason="length"')
    body = {"model": "llama", "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        first = next(line for line in resp.iter_lines() if line.startswith("data: {"))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
    # the connection is closed mid-stream: the request is aborted (not run to its 1000 tokens)
    wait_idle(server, timeout=10)
    assert metric(server, "ember_requests_total", 'finished_reason="abort"') == aborted + 1
    assert metric(server, "ember_requests_total", 'finished_reason="length"') == completed


def test_api_key_cors_queue_limit_and_chat_template(llama, tmp_path, offline):
    template = tmp_path / "template.jinja"
    template.write_text(
        "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}=>{% endif %}"
    )
    proc, url = start_server(
        llama,
        "--chat-template",
        str(template),
        "--api-key",
        "s3cret",
        "--allowed-origins",
        "https://example.org",
        "--max-num-seqs",
        "1",
        "--max-num-queued-requests",
        "1",
    )
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200  # probes stay open
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert good.models.list().data[0].id == "llama"
        msgs = [{"role": "user", "content": "hi"}]
        rendered = httpx.post(f"{url}/tokenize", json={"messages": msgs}).json()["tokens"]
        assert rendered == offline.get_tokenizer()("<<hi>>=>", add_special_tokens=False).input_ids
        bare = httpx.post(f"{url}/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
        assert bare["tokens"] == offline.get_tokenizer()("<<hi>>", add_special_tokens=False).input_ids
        pre = httpx.options(
            f"{url}/v1/completions",
            headers={"Origin": "https://example.org", "Access-Control-Request-Method": "POST"},
        )
        assert pre.headers.get("access-control-allow-origin") == "https://example.org"
        long = {"model": "llama", "prompt": "x", "max_tokens": 800, "ignore_eos": True, "stream": True}
        headers = {"Authorization": "Bearer s3cret"}
        _, worker_pid = engine_pids(proc)
        os.kill(worker_pid, signal.SIGSTOP)  # nothing progresses: whatever is submitted stays queued
        try:
            with httpx.Client(timeout=60) as http:
                with (
                    http.stream("POST", f"{url}/v1/completions", json=long, headers=headers) as running,
                    http.stream("POST", f"{url}/v1/completions", json=long, headers=headers) as queued,
                ):
                    assert running.status_code == queued.status_code == 200
                    with pytest.raises(openai.InternalServerError) as e:  # the queue holds one
                        good.completions.create(model="llama", prompt="y", max_tokens=2)
                    assert e.value.status_code == 503 and "queue is full" in e.value.message
                    refused = http.post(f"{url}/v1/completions", json=long, headers=headers)
                    assert refused.status_code == 503  # a stream is refused before it starts
                    assert refused.json()["error"]["type"] == "service_unavailable"
                    assert metric(url, "ember_requests_rejected_total", 'status_code="503"') == 2
        finally:
            os.kill(worker_pid, signal.SIGCONT)
    finally:
        stop_server(proc)


def test_stalled_engine_is_unhealthy_and_dead_engine_fails_streams(llama):
    proc, url = start_server(llama, "--stall-timeout", "2", "--stall-action", "report")
    try:
        core_pid, worker_pid = engine_pids(proc)
        body = {"model": "llama", "prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()  # keep the iterator: dropping it would close the connection
            assert next(line for line in lines if line.startswith("data: {"))
            # a worker that stops making progress while work is queued: unhealthy, with the reason
            os.kill(worker_pid, signal.SIGSTOP)
            try:
                health = _wait_health(url, 503, timeout=15)
                assert "has not completed a step" in health.json()["reason"]
            finally:
                os.kill(worker_pid, signal.SIGCONT)
            assert _wait_health(url, 200, timeout=15).json()["status"] == "ok"
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            # the engine dies mid-stream: the stream ends with an error event, never hangs
            os.kill(core_pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert any('"error"' in line for line in rest), rest[-3:]
        assert rest[-1] == "data: [DONE]"
        # with its only core gone, `ember serve` exits 1 for a supervisor to restart it
        assert proc.wait(20) == 1
    finally:
        stop_server(proc)


def test_a_stall_ends_the_streams_and_stops_the_engine(llama):
    """--stall-action fail (the default): a worker stopped with SIGSTOP is a stall; once the watchdog
    sees it, the streams end with an error event, the server says why as it exits 1, and no process
    is left."""
    proc, url = start_server(llama, "--stall-timeout", "2")
    core_pid, worker_pid = engine_pids(proc)
    try:
        body = {"model": "llama", "prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            os.kill(worker_pid, signal.SIGSTOP)
            stopped = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
            took = time.monotonic() - stopped
        assert any('"error"' in line and "stalled" in line for line in rest), rest[-3:]
        print(f"worker stopped: the stream ended with an error after {took:.2f} s (stall timeout 2 s)")
        # the watchdog fires at the timeout and the error follows at once (about 2.1 s here); without
        # it the stream would hang to the client's 60 s timeout. The bound leaves a loaded host room.
        assert took < 2.0 + 8.0, "the error reaches the client within seconds of the stall timeout"
        # `ember serve` says why and exits 1 at once, for a supervisor to restart it
        assert proc.wait(20) == 1
        assert proc.stdout is not None
        said = proc.stdout.read()
        assert "every engine core is gone" in said and "stalled" in said, said[-500:]
        assert gone([core_pid, worker_pid], timeout=20), "the core and its stopped worker must be gone"
    finally:
        if os.path.exists(f"/proc/{worker_pid}"):
            os.kill(worker_pid, signal.SIGCONT)
        stop_server(proc)


def _wait_health(url: str, status: int, timeout: float) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while (resp := httpx.get(f"{url}/health")).status_code != status and time.monotonic() < deadline:
        time.sleep(0.1)
    assert resp.status_code == status, resp.text
    return resp


def engine_pids(server: subprocess.Popen) -> tuple[int, int]:
    """(ember-core pid, ember-worker-0 pid) under an `ember serve` process."""

    def child(parent: int, name: str) -> int:
        return next(
            int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == parent and name in _cmd(p)
        )

    core = child(server.pid, "ember-core")
    return core, child(core, "ember-worker-0")


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def _cmd(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""
