"""`ember serve` of each architecture beyond Llama's shape answers the real `openai` client.

A live server per architecture (the tiny checkpoints of tests/workers/test_architectures.py, and
Mixtral's of tests/workers/test_moe.py), chat
rendered with the checkpoint's own template: the streamed and the whole answer equal the offline
engine's greedy tokens for the same rendered prompt; for Mixtral /metrics shows the experts' imbalance.
Run: `pytest -q tests/e2e/test_architectures_served.py`.
"""

from __future__ import annotations

import openai
import pytest

from coreproc import LLM, SamplingParams
from tests.server_util import eventually, metric, start_server, stop_server
from tests.workers import test_architectures, test_moe

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]


SHAPES = {
    **{a: {**test_architectures.SHAPES, **f} for a, f in test_architectures.FAMILIES.items()},
    "mixtral": {**test_moe.SHAPES, **test_moe.FAMILIES["mixtral"]},  # a mixture of experts
}


@pytest.mark.parametrize("arch", sorted(SHAPES))
def test_chat_over_http_equals_the_offline_engine(make_ckpt, arch: str) -> None:
    path = str(make_ckpt(arch, **SHAPES[arch]))
    with LLM(path, dtype="float32", show_progress=False) as llm:
        ids = llm.get_tokenizer().apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
        expect = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    proc, url = start_server(path, name=arch)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        out = client.chat.completions.create(model=arch, messages=MESSAGES, max_tokens=12, temperature=0)
        assert out.choices[0].message.content == expect.outputs[0].text
        assert out.usage.prompt_tokens == len(ids)
        stream = client.chat.completions.create(
            model=arch, messages=MESSAGES, max_tokens=12, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == expect.outputs[0].text
        if arch == "mixtral":  # the experts' load reaches /metrics: max / mean tokens per expert >= 1
            imbalance = eventually(lambda: metric(url, "ember_moe_expert_imbalance"), lambda v: v >= 1.0)
            assert imbalance >= 1.0
            assert metric(url, "ember_moe_layer_expert_imbalance", 'layer="1"') >= 1.0
    finally:
        stop_server(proc)
