"""Shared pytest fixtures: tiny checkpoints built once per session, and the Hugging Face reference.

Run everything with `pytest -q`; tiers are markers (`-m unit`, `-m model`, `-m e2e`, `-m gpu`).
Without CUDA, Triton kernels run under the interpreter (TRITON_INTERPRET=1, set before any kernel
module is imported). Checkpoints are made locally with `frontend.make_model` (no hub, no downloads).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hashlib  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _snapshot_runtime_dirs(tmp_path_factory: pytest.TempPathFactory):
    """Snapshots made under pytest's (long) temporary paths keep their runtime directory in /tmp, where
    restores need it; remove those directories when the session ends."""
    yield
    import shutil

    from frontend.snapshot.commands import Layout

    for manifest in tmp_path_factory.getbasetemp().glob("**/manifest.json"):
        base = Layout(manifest.parent).runtime_base
        if base.parent == Path("/tmp"):
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def make_ckpt(ckpt_root: Path):
    """Build (once per session) a checkpoint for given make-model arguments; returns its folder."""
    from frontend.make_model import build_checkpoint

    built: dict[tuple, Path] = {}

    def make(arch: str, size: str = "tiny", **kwargs) -> Path:
        key = (arch, size, json.dumps(kwargs, sort_keys=True))
        if key not in built:
            digest = hashlib.sha256(key[2].encode()).hexdigest()[:10]
            built[key] = build_checkpoint(ckpt_root / f"{arch}-{size}-{digest}", arch, size, **kwargs)
        return built[key]

    return make


@pytest.fixture(scope="session", params=ARCHS)
def tiny_ckpt(request: pytest.FixtureRequest, make_ckpt) -> Path:
    """One tiny float32 checkpoint per supported architecture."""
    return make_ckpt(request.param)


# A CPU-like cost model for speculation plans: a decode step reads the weights once (a fixed part)
# plus a little per token; so does a draft forward, at a third of the target's price.
STEADY_STEP_S, STEADY_TOKEN_S = 0.02, 0.0005
STEADY_DRAFT_S, STEADY_DRAFT_TOKEN_S = 0.006, 0.0002


@pytest.fixture
def steady_step_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculation plans from fixed step costs instead of the steps' measured seconds: the adaptive
    proposal lengths (coreproc/core/ngram.py) then depend on the tokens alone, so acceptance counters
    are the same on every CPU and under any load. Reaches engines whose scheduler runs in the test's
    process (`LLM`); a served engine's counters are made deterministic with `"adaptive": false`."""
    from coreproc.core.ngram import StepCost

    record, record_draft = StepCost.record, StepCost.record_draft

    def steady(self: StepCost, tokens: int, seconds: float) -> None:
        record(self, tokens, STEADY_STEP_S + STEADY_TOKEN_S * tokens)

    def steady_draft(self: StepCost, forwards: list[tuple[int, float]]) -> None:
        record_draft(self, [(t, STEADY_DRAFT_S + STEADY_DRAFT_TOKEN_S * t) for t, _ in forwards])

    monkeypatch.setattr(StepCost, "record", steady)
    monkeypatch.setattr(StepCost, "record_draft", steady_draft)


@pytest.fixture(scope="module")
def native_kernels():
    """For a module about the native CPU ops: skipped where they cannot be built, and run on them even
    in a suite run with EMBER_CPU_KERNELS=torch (the fallback another CPU takes), which the module's
    own references may still ask for test by test; the variable is restored afterwards."""
    from kernels.native import load_native

    reason = load_native()
    if reason is not None:
        pytest.skip(f"native CPU ops unavailable: {reason}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EMBER_CPU_KERNELS", "native")
        yield
