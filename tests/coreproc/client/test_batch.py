"""`ember batch`: OpenAI batch files through one engine, on a tiny checkpoint.

Results must equal the offline API's, bad lines and bad requests must only fail themselves, and a run
killed mid-way must resume from its own output without losing or repeating a request. In-process runs
go through `frontend.cli.main`; the kill and stdin/stdout cases run `python -m coreproc batch`.
Run: `pytest -q tests/coreproc/client/test_batch.py` (about a minute on two cores).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from coreproc import LLM, SamplingParams
from coreproc.text.chat import render_chat
from frontend.cli import main
from tests.paths import REPO

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models step fastest on one thread (two cores are shared by several processes)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> str:
    return str(make_ckpt("llama"))


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, dtype="float32", show_progress=False)


def engine_flags(ckpt: str, *extra: str) -> list[str]:
    return ["--model", ckpt, "--dtype", "float32", "--no-progress", *extra]


def line(cid: str, url: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def completion(cid: str, **body) -> dict:
    return line(cid, "/v1/completions", body)


def chat(cid: str, **body) -> dict:
    return line(cid, "/v1/chat/completions", body)


def write_jsonl(path: Path, items: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in items))
    return path


def read_records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def by_id(records: list[dict]) -> dict[str, dict]:
    ids = [r["custom_id"] for r in records]
    assert len(ids) == len(set(ids)), "a custom_id appears more than once"
    return {r["custom_id"]: r for r in records}


def comparable(rec: dict) -> dict:
    """A record without its random ids and timestamps."""
    body = dict(rec["response"]["body"])
    body.pop("id", None)
    body.pop("created", None)
    return {"status": rec["response"]["status_code"], "body": body}


def test_results_match_the_offline_api(ckpt, llm, tmp_path, monkeypatch):
    from coreproc.core.engine import EngineCore

    seen_requests = []
    original = EngineCore.add_requests
    monkeypatch.setattr(
        EngineCore, "add_requests", lambda self, rs: (seen_requests.extend(rs), original(self, rs))
    )
    prompts = ["def fibonacci(n):", "import os\n", "for i in range(10):"]
    messages = [{"role": "user", "content": "hello there"}]
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "what is"}, {"type": "text", "text": "x"}]}
    ]
    items = [completion(f"g{i}", prompt=p, **GREEDY) for i, p in enumerate(prompts)]
    items += [
        completion("multi", prompt=prompts[:2], **GREEDY),
        completion("echo", prompt=prompts[0], echo=True, **GREEDY),
        chat("chat", model="anything", messages=messages, **GREEDY),
        chat("parts", messages=parts, logprobs=True, top_logprobs=3, **GREEDY),
        completion("n2", prompt=prompts[2], n=2, seed=5, temperature=0.9, max_tokens=10, logprobs=2),
        completion("extras", prompt="x = 1", max_tokens=3, priority=3, cache_salt="salt", seed=9),
    ]
    out = tmp_path / "out.jsonl"
    assert (
        main(
            ["batch", "-i", str(write_jsonl(tmp_path / "in.jsonl", items)), "-o", str(out)]
            + engine_flags(ckpt)
        )
        == 0
    )
    recs = by_id(read_records(out))
    assert set(recs) == {x["custom_id"] for x in items}
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in recs.values())
    assert all(r["id"].startswith("batch_req_") for r in recs.values())

    greedy = SamplingParams(temperature=0, max_tokens=12)
    ref = [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]
    for i in range(3):
        body = recs[f"g{i}"]["response"]["body"]
        assert body["object"] == "text_completion" and body["model"] == Path(ckpt).name
        assert body["choices"][0]["text"] == ref[i]
        n_prompt = len(llm.tokenizer(prompts[i]).input_ids)
        assert body["usage"]["prompt_tokens"] == n_prompt
        assert body["usage"]["total_tokens"] == n_prompt + body["usage"]["completion_tokens"]
    multi = recs["multi"]["response"]["body"]["choices"]
    assert [(c["index"], c["text"]) for c in multi] == [(0, ref[0]), (1, ref[1])]
    assert recs["echo"]["response"]["body"]["choices"][0]["text"] == prompts[0] + ref[0]

    for cid, msgs in (("chat", messages), ("parts", parts)):
        ids = render_chat(llm.tokenizer, msgs)
        (want,) = llm.generate([ids], greedy, use_tqdm=False)
        body = recs[cid]["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": want.outputs[0].text}
        assert body["usage"]["prompt_tokens"] == len(ids)
    content = recs["parts"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == recs["parts"]["response"]["body"]["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 3 for c in content)

    sampled = SamplingParams(n=2, seed=5, temperature=0.9, max_tokens=10, logprobs=2)
    (want,) = llm.generate([prompts[2]], sampled, use_tqdm=False)
    choices = recs["n2"]["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for c, o in zip(choices, want.outputs):
        assert c["text"] == o.text
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(o.token_ids) == len(lp["token_logprobs"]) == len(lp["text_offset"])
        assert lp["token_logprobs"] == pytest.approx([p[t].logprob for p, t in zip(o.logprobs, o.token_ids)])
        # top-2 plus the chosen token (fewer when two tokens decode to the same text, e.g. byte pieces)
        for tok, top in zip(lp["tokens"], lp["top_logprobs"]):
            assert 1 <= len(top) <= 3 and tok in top

    (extras,) = [r for r in seen_requests if r.priority == 3]
    assert extras.cache_salt == "salt" and extras.sampling_params.seed == 9


def test_bad_lines_and_bad_requests_fail_alone(ckpt, tmp_path):
    good = completion("ok1", prompt="hello", max_tokens=4)
    items = [
        good,
        "{not json",
        json.dumps([1, 2]),
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
        completion("ok1", prompt="again"),
        line("emb", "/v1/embeddings", {"input": "x"}),
        {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}},
        {"custom_id": "nobody", "method": "POST", "url": "/v1/completions"},
        completion("badtype", prompt="x", max_tokens="many"),
        completion("toolong", prompt="x", max_tokens=100000),
        completion("badtemp", prompt="x", temperature=-1),
        completion("badids", prompt=[1, 2, 10**6]),
        chat(
            "image",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
        ),
        chat("norole", messages=[{"content": "hi"}]),
        chat("ok2", messages=[{"role": "user", "content": "hi"}], max_tokens=4),
        "",
        completion("ok3", prompt=[5, 6, 7], max_tokens=4),
    ]
    out = tmp_path / "out.jsonl"
    assert (
        main(
            ["batch", "-i", str(write_jsonl(tmp_path / "in.jsonl", items)), "-o", str(out)]
            + engine_flags(ckpt)
        )
        == 0
    )
    recs = read_records(out)
    assert len(recs) == len(items) - 1  # the blank line is skipped
    line_errors = {r["error"]["message"].split(":")[0]: r for r in recs if r["response"] is None}
    expected = {
        "line 2": "invalid_json",
        "line 3": "invalid_line",
        "line 4": "missing_custom_id",
        "line 5": "duplicate_custom_id",
        "line 6": "invalid_url",
        "line 7": "invalid_method",
        "line 8": "missing_body",
    }
    assert {k: r["error"]["code"] for k, r in line_errors.items()} == expected
    assert line_errors["line 5"]["custom_id"] == "ok1" and line_errors["line 2"]["custom_id"] is None
    answered = {r["custom_id"]: r["response"] for r in recs if r["response"] is not None}
    params = {
        cid: resp["body"]["error"]["param"] for cid, resp in answered.items() if resp["status_code"] == 400
    }
    assert params == {
        "badtype": "max_tokens",
        "toolong": "max_tokens",
        "badtemp": "temperature",
        "badids": "prompt",
        "image": "messages[0].content",
        "norole": "messages[0].role",
    }
    for cid in params:
        err = answered[cid]["body"]["error"]
        assert err["type"] == "invalid_request_error" and "\n" not in err["message"]
    assert {cid for cid, r in answered.items() if r["status_code"] == 200} == {"ok1", "ok2", "ok3"}
    assert answered["ok1"]["body"]["usage"]["completion_tokens"] <= 4


def resume_items(count: int) -> list[dict]:
    """Greedy chats and seeded samples: both reproducible whatever the batch around them."""
    items = []
    for i in range(count):
        if i % 3 == 0:
            items.append(
                chat(
                    f"r{i}",
                    messages=[{"role": "user", "content": f"question {i}"}],
                    max_tokens=24,
                    temperature=0,
                )
            )
        else:
            items.append(completion(f"r{i}", prompt=f"def f{i}(x):", max_tokens=24, temperature=0.8, seed=i))
    return items


def test_resume_after_kill(ckpt, tmp_path):
    items = resume_items(120)
    inp = write_jsonl(tmp_path / "in.jsonl", items)
    out = tmp_path / "out.jsonl"
    flags = engine_flags(ckpt, "--max-num-seqs", "4")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "coreproc", "batch", "-i", str(inp), "-o", str(out), *flags]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 5:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    written = out.read_bytes()
    written = written[: written.rfind(b"\n") + 1]
    assert 5 <= written.count(b"\n") < len(items), "the run was not killed mid-way"
    with open(out, "ab") as f:  # as if killed in the middle of a write
        f.write(b'{"id": "batch_req_x", "custom_id": "r1')

    assert main(["batch", "-i", str(inp), "-o", str(out), *flags]) == 0
    assert out.read_bytes().startswith(written)  # nothing written before is lost or rewritten
    resumed = by_id(read_records(out))
    assert set(resumed) == {x["custom_id"] for x in items}

    clean = tmp_path / "clean.jsonl"
    assert main(["batch", "-i", str(inp), "-o", str(clean), *flags]) == 0
    reference = by_id(read_records(clean))
    assert {k: comparable(v) for k, v in resumed.items()} == {k: comparable(v) for k, v in reference.items()}


def test_engine_failure_keeps_results_and_says_how_to_resume(ckpt, tmp_path, monkeypatch, capsys):
    from coreproc.core.engine import EngineCore

    items = resume_items(12)
    inp = write_jsonl(tmp_path / "in.jsonl", items)
    out = tmp_path / "out.jsonl"
    flags = engine_flags(ckpt, "--max-num-seqs", "2", "--max-in-flight", "3")
    original, calls = EngineCore.step, []

    def failing_step(self):
        calls.append(1)
        if len(calls) > 60:
            raise RuntimeError("worker 0 died\nwith a traceback")
        return original(self)

    monkeypatch.setattr(EngineCore, "step", failing_step)
    assert main(["batch", "-i", str(inp), "-o", str(out), *flags]) == 1
    done = len(read_records(out))
    assert 0 < done < len(items)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"ember batch: error: worker 0 died; {len(items) - done} requests not finished; "
        "rerun with the same -o to resume"
    )
    monkeypatch.setattr(EngineCore, "step", original)
    assert main(["batch", "-i", str(inp), "-o", str(out), *flags]) == 0
    assert set(by_id(read_records(out))) == {x["custom_id"] for x in items}
    assert f"{len(items) - done} done, 0 errors, {done} already in the output" in capsys.readouterr().err


def test_stdin_to_stdout(ckpt):
    items = [
        completion("a", prompt="hi", max_tokens=3),
        "oops",
        chat("b", messages=[{"role": "user", "content": "yo"}], max_tokens=3),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "coreproc", "batch", "-i", "-", "-o", "-", *engine_flags(ckpt)],
        input="".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in items),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    recs = [json.loads(x) for x in proc.stdout.splitlines()]
    assert len(recs) == 3
    answered = {r["custom_id"]: r["response"]["status_code"] for r in recs if r["response"]}
    assert answered == {"a": 200, "b": 200}
    assert [r["error"]["code"] for r in recs if r["error"]] == ["invalid_json"]
    assert proc.stderr.strip().splitlines()[-1].startswith("ember batch: 2 done, 1 errors")


def test_queue_limits_hold_work_back_instead_of_failing_it(ckpt, llm, tmp_path):
    """With tight queue limits and one running request at a time, every line is still answered, in
    full, with the same greedy text as the offline API (held back, never refused) — except a line
    with more sequences than the queue can ever hold, which gets a 400 record at once."""
    prompts = [f"print({i})" for i in range(7)] + [["a", "b"], ["a", "b", "c"]]
    items = [completion(f"q{i}", prompt=p, **GREEDY) for i, p in enumerate(prompts)]
    src, out = write_jsonl(tmp_path / "in.jsonl", items), tmp_path / "out.jsonl"
    flags = ["--max-num-active-seqs", "1", "--max-num-queued-requests", "2", "--max-num-queued-tokens", "8"]
    assert main(["batch", "-i", str(src), "-o", str(out), *engine_flags(ckpt, *flags)]) == 0
    recs = by_id(read_records(out))
    assert set(recs) == {f"q{i}" for i in range(len(prompts))}
    ref = llm.generate(
        [p for p in prompts if isinstance(p, str)],
        SamplingParams(temperature=0, max_tokens=12),
        use_tqdm=False,
    )
    for i, expect in enumerate(ref):
        body = recs[f"q{i}"]["response"]["body"]
        assert body["choices"][0]["text"] == expect.outputs[0].text
    assert len(recs["q7"]["response"]["body"]["choices"]) == 2
    never = recs["q8"]["response"]
    assert never["status_code"] == 400 and "can never be admitted" in never["body"]["error"]["message"]


def test_offline_api_respects_queue_limits(ckpt, llm):
    prompts = [f"x = {i}" for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=5)
    with LLM(
        ckpt, dtype="float32", show_progress=False, max_num_queued_requests=1, max_num_active_seqs=2
    ) as tight:
        got = [o.outputs[0].text for o in tight.generate(prompts, greedy, use_tqdm=False)]
        assert tight.stats().num_blocks_in_use == 0
    assert got == [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]


def test_two_data_parallel_engines_give_the_same_records(ckpt, tmp_path):
    """`ember batch -dp 2`: the file's requests spread over two engines, each record as one engine's
    (greedy), nothing lost or duplicated."""
    items = [completion(f"c{i}", prompt=f"item {i}: def f(x):", **GREEDY) for i in range(12)]
    items.append(completion("n2", prompt="import os\n", n=2, max_tokens=6, temperature=0))
    src = write_jsonl(tmp_path / "in.jsonl", items)
    outs = {}
    for dp in ("1", "2"):
        out = tmp_path / f"out{dp}.jsonl"
        assert main(["batch", "-i", str(src), "-o", str(out)] + engine_flags(ckpt, "-dp", dp)) == 0
        outs[dp] = {cid: comparable(rec) for cid, rec in by_id(read_records(out)).items()}
    assert set(outs["2"]) == {x["custom_id"] for x in items}
    assert outs["2"] == outs["1"]
