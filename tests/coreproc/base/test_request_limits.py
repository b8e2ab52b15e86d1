"""Bounds on what one request may ask for, on every way in: HTTP, batch mode and the ZMQ SDK.

Unit tests check each bound of `RequestLimits` as the OpenAI parser and the scheduler see it (a 400 /
`InvalidParam` naming the field and the limit, the value at the limit still accepted); end-to-end
tests send the requests that used to take the server down (n = 100000; 50000 prompts) to a real
`ember serve` and get a 400 at once with the frontend's memory unchanged, refuse requests that can
never fit the queue, cut off a streaming client that stops reading, and check the same bounds in
batch mode and through `ember core`'s socket. Run: `pytest -q tests/coreproc/base/test_request_limits.py`.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from coreproc.base.config import ConfigError, EngineConfig, engine_options
from coreproc.base.errors import InvalidParam
from coreproc.base.limits import RequestLimits
from coreproc.base.protocol import EngineRequest, SamplingParams
from coreproc.client.sdk import EngineClient, EngineRequestError
from coreproc.core.scheduler import Scheduler
from coreproc.startup.launcher import CoreProcess
from coreproc.text.openai_protocol import RequestError, parse_chat_request, parse_completion_request
from frontend.cli import build_parser, main
from tests.server_util import metric, start_server, stop_server, wait_idle

SMALL = RequestLimits(
    max_n=4,
    max_prompts_per_request=3,
    max_seqs_per_request=6,
    max_stop_strings=2,
    max_stop_token_ids=3,
    max_word_chars=5,
    max_bad_words=2,
    max_logit_bias=2,
    max_allowed_token_ids=3,
    max_logits_processor_args_bytes=40,
    max_json_depth=3,
    max_messages=3,
    max_content_parts=2,
)

# (body fields at the limit, the same one past it, the param named, the limit in the message)
COMPLETION_BOUNDS = [
    ({"n": 4}, {"n": 5}, "n", "4"),
    ({"prompt": ["a", "b", "c"]}, {"prompt": ["a", "b", "c", "d"]}, "prompt", "3"),
    ({"prompt": ["a", "b"], "n": 3}, {"prompt": ["a", "b", "c"], "n": 3}, "n", "6"),
    ({"stop": ["a", "b"]}, {"stop": ["a", "b", "c"]}, "stop", "2"),
    ({"stop": "abcde"}, {"stop": "abcdef"}, "stop", "5"),
    ({"stop_token_ids": [1, 2, 3]}, {"stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids", "3"),
    ({"logit_bias": {"1": 1, "2": 1}}, {"logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias", "2"),
    ({"bad_words": ["x", "y"]}, {"bad_words": ["x", "y", "z"]}, "bad_words", "2"),
    ({"bad_words": "abcde"}, {"bad_words": "abcdef"}, "bad_words", "5"),
    ({"allowed_token_ids": [1, 2, 3]}, {"allowed_token_ids": [1, 2, 3, 4]}, "allowed_token_ids", "3"),
    (
        {"logits_processor_args": {"p": "x" * 20}},
        {"logits_processor_args": {"p": "x" * 40}},
        "logits_processor_args",
        "40",
    ),
    (
        {"logits_processor_args": {"p": [[1]]}},
        {"logits_processor_args": {"p": [[[1]]]}},
        "logits_processor_args",
        "3",
    ),
]


@pytest.mark.unit
@pytest.mark.parametrize("ok,bad,param,limit", COMPLETION_BOUNDS)
def test_each_completion_bound_is_a_400_naming_field_and_limit(ok, bad, param, limit):
    parse_completion_request({"prompt": "hi", **ok}, SMALL)  # at the limit: accepted
    with pytest.raises(RequestError) as err:
        parse_completion_request({"prompt": "hi", **bad}, SMALL)
    assert err.value.status == 400 and err.value.param == param
    assert f"at most {limit}" in str(err.value) or f"limit of {limit}" in str(err.value)


@pytest.mark.unit
def test_chat_bounds_messages_parts_and_nesting():
    user = {"role": "user", "content": "hi"}
    parse_chat_request({"messages": [user] * 3}, SMALL)
    with pytest.raises(RequestError, match="at most 3") as err:
        parse_chat_request({"messages": [user] * 4}, SMALL)
    assert err.value.param == "messages"
    part = {"type": "text", "text": "x"}
    parse_chat_request({"messages": [{"role": "user", "content": [part, part]}]}, SMALL)
    with pytest.raises(RequestError, match="3 content parts; this server takes at most 2"):
        parse_chat_request({"messages": [{"role": "user", "content": [part] * 3}]}, SMALL)
    deep = {"type": "image_url", "image_url": {"url": {"a": {"b": {"c": 1}}}}}
    with pytest.raises(RequestError, match="nests deeper"):
        parse_chat_request({"messages": [{"role": "user", "content": [deep]}]}, SMALL)
    with pytest.raises(RequestError, match="at most 4"):
        parse_chat_request({"messages": [user], "n": 5}, SMALL)


@pytest.mark.unit
def test_malformed_bodies_are_400s_not_crashes():
    with pytest.raises(RequestError, match="nests too deeply"):  # msgspec's own recursion limit
        parse_completion_request(b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    with pytest.raises(RequestError, match="64 bits"):  # would not survive the trip to the core
        parse_completion_request({"prompt": "a", "logits_processor_args": {"p": 2**70}})
    with pytest.raises(RequestError, match="best_of"):
        parse_completion_request({"prompt": "a", "best_of": 3})
    parse_completion_request({"prompt": "a", "best_of": 2, "n": 2})
    with pytest.raises(RequestError, match="at most 128"):  # the defaults without a server
        parse_completion_request({"prompt": "a", "n": 100000})
    with pytest.raises(RequestError, match="at most 256"):
        parse_completion_request({"prompt": ["a"] * 50000})


@pytest.mark.unit
def test_flags_reach_the_config_and_defaults_follow_the_engine(make_ckpt):
    ckpt = str(make_ckpt("llama"))
    args = build_parser("serve").parse_args(["serve", ckpt, "--max-n", "7", "--max-num-seqs", "48"])
    config = EngineConfig.create(**engine_options(args))
    assert config.limits.max_n == 7 and config.limits.max_prompts_per_request == 256
    assert config.limits.max_seqs_per_request == 48, "defaults to --max-num-seqs"
    assert config.limits.max_allowed_token_ids == config.model.vocab_size
    with pytest.raises(ConfigError, match="max_n must be a positive integer"):
        EngineConfig.create(ckpt, request_limits={"max_n": 0})
    with pytest.raises(ConfigError, match="unknown request limit 'max_tokens'"):
        EngineConfig.create(ckpt, request_limits={"max_tokens": 3})
    with pytest.raises(ConfigError, match="unknown scheduling_policy 'lifo'"):  # was never checked
        EngineConfig.create(ckpt, scheduling_policy="lifo")


def engine_request(rid: str, **params) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=[3, 4, 5], sampling_params=SamplingParams(**params))


@pytest.mark.unit
def test_the_core_checks_every_request_whatever_its_path(make_ckpt):
    config = EngineConfig.create(str(make_ckpt("llama")), dtype="float32", request_limits=SMALL)
    sched = Scheduler(config, num_kv_blocks=64)
    with pytest.raises(InvalidParam, match="at most 2") as err:
        sched.add_request(engine_request("a", stop=["x", "y", "z"]))
    assert err.value.param == "stop"
    with pytest.raises(InvalidParam, match="n = 1"):
        sched.add_request(engine_request("a", n=2))
    with pytest.raises(InvalidParam, match="at most 6 in one request"):
        sched.add_requests([engine_request(f"s{i}") for i in range(7)])
    with pytest.raises(InvalidParam, match="bad_words"):
        sched.add_request(engine_request("a", bad_words_token_ids=[[1], [2], [3]]))
    assert not sched.requests, "nothing refused was queued"
    sched.add_requests([engine_request(f"s{i}") for i in range(6)])
    assert len(sched.requests) == 6


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def llama(make_ckpt) -> str:
    return str(make_ckpt("llama"))


@pytest.fixture(scope="module")
def server(llama):
    proc, url = start_server(
        llama,
        *("--max-num-seqs", "64", "--max-model-len", "512", "--max-num-queued-requests", "80"),
        *("--max-stream-buffer-tokens", "2048", "--stream-send-timeout", "2"),
    )
    yield proc, url
    stop_server(proc)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.e2e
def test_the_requests_that_took_the_server_down_are_400s_at_once(server):
    proc, url = server
    with httpx.Client(base_url=url, timeout=10) as http:
        http.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 2})
        before = rss_kib(proc.pid)
        for body, param in (
            ({"prompt": "a", "n": 100000, "max_tokens": 1}, "n"),
            ({"prompt": ["a"] * 50000, "max_tokens": 1}, "prompt"),
        ):
            start = time.monotonic()
            r = http.post("/v1/completions", json=body)
            # refused before anything is built for the sequences: a fraction of a second here (the
            # bound leaves a loaded host room; building 100,000 sequences took the server down)
            assert time.monotonic() - start < 5.0
            assert r.status_code == 400 and r.json()["error"]["param"] == param
        assert rss_kib(proc.pid) < before + 20 * 1024, "the frontend's memory must not grow"
        # more bounds over HTTP, each naming its field
        cases = [
            ({"prompt": ["a"] * 16, "n": 5}, "n"),  # 80 sequences > --max-num-seqs 64
            ({"prompt": "a", "stop": ["s"] * 33}, "stop"),
            ({"prompt": "a", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
            ({"prompt": "a", "logit_bias": {str(2**40): 1}}, "logit_bias"),
        ]
        for body, param in cases:
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        chat = {"messages": [{"role": "user", "content": "x"}] * 2049}
        for route in ("/v1/chat/completions", "/tokenize"):
            r = http.post(route, json=chat)
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", route
        assert http.get("/health").status_code == 200


@pytest.mark.e2e
def test_a_request_that_can_never_fit_the_queue_is_a_400_and_nothing_is_admitted(llama):
    proc, url = start_server(llama, "--max-num-queued-requests", "4")
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "n": 5, "max_tokens": 2}, timeout=10)
        assert r.status_code == 400 and "can never be admitted" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "n": 4, "max_tokens": 2}, timeout=10)
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
        wait_idle(url)
    finally:
        stop_server(proc)


@pytest.mark.e2e
def test_a_streaming_client_that_stops_reading_is_cut_off(server):
    """A client that never reads its stream: the request is aborted once its unread output passes
    --max-stream-buffer-tokens (its KV blocks freed), and the connection is closed after
    --stream-send-timeout, while other clients are served."""
    _, url = server
    aborted = metric(url, "ember_requests_total", 'finished_reason="abort"')
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = json.dumps(
        {"prompt": "a", "n": 64, "max_tokens": 500, "ignore_eos": True, "stream": True, "logprobs": 5}
    ).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 60
    while metric(url, "ember_requests_total", 'finished_reason="abort"') == aborted:
        assert time.monotonic() < deadline, "the unread stream was never cut off"
        time.sleep(0.2)
    wait_idle(url)  # its KV blocks are free although the client has read nothing
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "b", "max_tokens": 3}, timeout=10)
    assert ok.status_code == 200
    sock.settimeout(30)
    received = 0
    while chunk := sock.recv(1 << 16):  # the server closes the connection
        received += len(chunk)
    print(f"unread stream: {received} bytes reached the client")
    assert received < 64 * 500 * 300, "the server stopped sending long before the request's end"
    sock.close()


@pytest.mark.e2e
def test_batch_lines_get_the_same_bounds(llama, tmp_path):
    lines = [
        {"custom_id": "ok", "url": "/v1/completions", "body": {"prompt": "a", "max_tokens": 2}},
        {"custom_id": "n", "url": "/v1/completions", "body": {"prompt": "a", "n": 100000}},
        {"custom_id": "many", "url": "/v1/completions", "body": {"prompt": ["a"] * 300}},
        {"custom_id": "stop", "url": "/v1/completions", "body": {"prompt": "a", "stop": ["s"] * 3}},
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"method": "POST", **line}) + "\n" for line in lines))
    flags = ["--model", llama, "--dtype", "float32", "--max-stop-strings", "2"]
    assert main(["batch", "-i", str(src), "-o", str(out), *flags]) == 0
    recs = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    assert recs["ok"]["status_code"] == 200
    for cid, param in (("n", "n"), ("many", "prompt"), ("stop", "stop")):
        assert recs[cid]["status_code"] == 400 and recs[cid]["body"]["error"]["param"] == param


@pytest.mark.e2e
def test_the_sdk_socket_has_the_same_bounds(llama):
    config = EngineConfig.create(llama, dtype="float32", request_limits={"max_stop_strings": 2})
    with CoreProcess(config) as core, EngineClient(core.address) as client:
        assert client.info_cache.limits["max_stop_strings"] == 2
        assert client.info_cache.limits["max_seqs_per_request"] == 256
        with pytest.raises(EngineRequestError, match="at most 2") as err:
            list(client.generate([3, 4], SamplingParams(stop=["a", "b", "c"])))
        assert err.value.code == "invalid_request" and err.value.param == "stop"
        too_many = [engine_request(f"r{i}", max_tokens=2) for i in range(257)]
        with pytest.raises(EngineRequestError, match="at most 256 in one request"):
            list(client.generate_many(too_many))
        outs = list(client.generate_many(too_many[:3]))
        assert {o.request_id for o in outs if o.finished} == {"r0", "r1", "r2"}
        stats = client.stats()
        assert stats.num_running == stats.num_waiting == stats.num_blocks_in_use == 0
