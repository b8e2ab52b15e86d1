"""The package layout: layers, the shared base, and what the distribution installs.

`lint-imports` (run in CI, contracts in pyproject.toml) checks the arrows; this checks that the
contracts cover the tree: every coreproc module is either in the shared base or forbidden to it, the
model and quantization names the config accepts are exactly those the workers build, and the wheel
claims no generic top-level name. Run: `pytest -q tests/test_layout.py`.
"""

from __future__ import annotations

import pkgutil
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

import coreproc  # noqa: E402
from coreproc import model_config as config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def contract(name_start: str) -> dict:
    contracts = PYPROJECT["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["name"].startswith(name_start))


@pytest.mark.unit
def test_every_coreproc_module_is_base_or_forbidden_to_the_base() -> None:
    base = contract("The shared base")
    classified = set(base["source_modules"]) | set(base["forbidden_modules"])
    modules = {
        m.name
        for m in pkgutil.walk_packages(coreproc.__path__, "coreproc.")
        if not m.ispkg and m.name != "coreproc.__main__"
    }
    assert modules - classified == set(), "name each new coreproc module in pyproject's base contract"
    assert classified & modules == classified - {"frontend", "workers", "kernels"}, "stale names"


@pytest.mark.unit
def test_the_base_may_be_imported_by_the_lower_layers() -> None:
    """Every module the lower layers import from coreproc is in the shared base."""
    base = set(contract("The shared base")["source_modules"])
    allowed = {rule.split(" -> ")[1] for rule in contract("Layers")["ignore_imports"]}
    assert allowed <= base


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
