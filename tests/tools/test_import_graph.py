"""`tools/import_graph.py`: the import graph drawn from the code has the frontend on top and the shared
base at the bottom, no cycle between units, and docs/ARCHITECTURE.md shows exactly what it draws."""

from __future__ import annotations

import pytest

from tests.paths import REPO
from tools.import_graph import draw_text, floors, unit_graph

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def edges() -> dict[str, set[str]]:
    return unit_graph()


def test_frontend_on_top_and_the_base_at_the_bottom(edges) -> None:
    rows = floors(edges)  # raises on a cycle between units
    assert rows[0] == ["frontend"]
    assert "coreproc.base" in rows[-1] and edges["coreproc.base"] == set()
    level = {unit: n for n, row in enumerate(rows) for unit in row}
    for unit, imported in edges.items():
        assert all(level[other] > level[unit] for other in imported), unit
    assert "frontend" not in set().union(*edges.values())


def test_the_core_process_and_the_base_keep_their_contracts(edges) -> None:
    assert not edges["coreproc.core"] & {"frontend", "coreproc.client", "coreproc.text"}
    for layer in ("workers", "kernels"):
        assert edges[layer] <= {"coreproc.base", "kernels"}, layer


def test_the_architecture_doc_shows_the_drawing(edges) -> None:
    doc = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    assert f"```\n{draw_text(edges)}\n```" in doc, "run `python -m tools.import_graph` and paste its output"


def test_a_cycle_is_refused() -> None:
    with pytest.raises(ValueError, match="cycle"):
        floors({"a": {"b"}, "b": {"a"}})
