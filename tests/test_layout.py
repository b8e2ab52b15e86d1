"""The package layout: the role folders, the import contracts, the public paths, what is installed.

`lint-imports` (run in CI, contracts in pyproject.toml) checks the arrows: the layers point down and
the only way below `coreproc` is its shared base, `coreproc.base`. This checks that every coreproc
module sits in a role folder the contracts name, that the public import paths users write still
work, that the model and quantization names the config accepts are exactly those the workers build,
and that the wheel claims no generic top-level name. Run: `pytest -q tests/test_layout.py`.
"""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

import coreproc  # noqa: E402
from coreproc.base import model_config as config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ROLES = {"base", "core", "startup", "client", "text"}  # the folders of coreproc, each one role
PUBLIC_MODULES = {"coreproc.logits_processors"}  # re-exports at paths users import


def contract(name_start: str) -> dict:
    contracts = PYPROJECT["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["name"].startswith(name_start))


@pytest.mark.unit
def test_every_coreproc_module_is_in_a_role_folder() -> None:
    loose = {
        m.name
        for m in pkgutil.iter_modules(coreproc.__path__, "coreproc.")
        if not m.ispkg and m.name != "coreproc.__main__"
    }
    folders = {m.name for m in pkgutil.iter_modules(coreproc.__path__) if m.ispkg} - {"assets"}
    assert loose == PUBLIC_MODULES, "a new coreproc module goes into one of its role folders"
    assert folders == ROLES
    forbidden = set(contract("The shared base")["forbidden_modules"])
    assert {f"coreproc.{r}" for r in ROLES - {"base"}} <= forbidden, "the base must not import a role"


@pytest.mark.unit
def test_below_coreproc_only_the_base() -> None:
    rules = contract("Layers")["ignore_imports"]
    assert rules == ["workers.** -> coreproc.base.**", "kernels.** -> coreproc.base.**"]
    assert contract("The shared base")["source_modules"] == ["coreproc.base"]


@pytest.mark.unit
@pytest.mark.parametrize(
    "path, names",
    [
        ("coreproc", ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "InvalidParam"]),
        ("coreproc.client", ["EngineClient", "AsyncEngineClient", "EngineDeadError", "EngineRequestError"]),
        ("coreproc.logits_processors", ["LogitsProcessor", "ProcessorContext", "Row"]),
    ],
)
def test_public_import_paths_still_work(path: str, names: list[str]) -> None:
    module = importlib.import_module(path)
    for name in names:
        assert getattr(module, name).__name__ == name
        assert name in module.__all__


@pytest.mark.unit
def test_python_m_coreproc_batch_still_parses() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "coreproc", "batch", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--input" in out.stdout, out.stderr


@pytest.mark.unit
def test_config_names_match_the_worker_registries() -> None:
    from workers.models import resolve
    from workers.models.llama import LlamaForCausalLM
    from workers.quant import QUANT_METHODS

    for name in config.ARCHITECTURES:  # the one registry: every entry names a model class
        assert issubclass(resolve(name), LlamaForCausalLM), name
    assert set(config.QUANTIZATION_METHODS) == set(QUANT_METHODS)


@pytest.mark.unit
def test_the_wheel_installs_no_tools_package() -> None:
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not any(p.startswith("tools") for p in find)
    data = PYPROJECT["tool"]["setuptools"]["package-data"]
    assert "tools" not in data and any("default_model" in p for p in data["coreproc"])
    assert (config.default_model_dir() / "config.json").is_file()
    # the native CPU ops are compiled on first use from the installed sources, headers included
    csrc = ROOT / "kernels" / "csrc"
    patterns = data["kernels"]
    assert all(any(f.match(p) for p in patterns) for f in csrc.iterdir() if f.suffix in (".cpp", ".h"))
