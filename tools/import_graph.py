"""The import graph of Ember's packages, drawn from the code: `python -m tools.import_graph [--png PATH]`.

Runs on a developer's machine (a repository script, not installed). Reads every import of the four
packages with grimp (the graph `lint-imports` checks; imports made only for annotations count), folds
the modules into units (each layer, and coreproc's role folders), and places each unit one floor
below the lowest unit that imports it. Prints the floors top to bottom with each unit's arrows
(docs/ARCHITECTURE.md shows this very text; tests/tools/test_import_graph.py keeps them equal), and
with `--png` draws it (matplotlib).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

PACKAGES = ("frontend", "coreproc", "workers", "kernels")
COREPROC_ROLES = ("client", "text", "core", "startup", "base")


def unit_of(module: str) -> str:
    """The unit a module belongs to: its layer, or for coreproc its role folder."""
    parts = module.split(".")
    if parts[0] == "coreproc":
        # the package's own modules are its public face: `LLM`, `SamplingParams`, `python -m coreproc`
        return (
            f"coreproc.{parts[1]}" if len(parts) > 1 and parts[1] in COREPROC_ROLES else "coreproc (public)"
        )
    return parts[0]


def unit_graph() -> dict[str, set[str]]:
    """Unit -> the units it imports (itself excluded), from the installed code."""
    import grimp

    graph = grimp.build_graph(*PACKAGES, include_external_packages=False, exclude_type_checking_imports=False)
    edges: dict[str, set[str]] = defaultdict(set)
    for module in graph.modules:
        edges[unit_of(module)]
        for imported in graph.find_modules_directly_imported_by(module):
            if unit_of(imported) != unit_of(module):
                edges[unit_of(module)].add(unit_of(imported))
    return dict(edges)


def floors(edges: dict[str, set[str]]) -> list[list[str]]:
    """Units by floor, top first: a unit sits one floor below the lowest unit importing it (the
    longest chain of imports down to it). Raises ValueError on a cycle."""
    depth: dict[str, int] = {}
    visiting: set[str] = set()

    def down(unit: str) -> int:  # the longest chain from `unit` to a unit that imports nothing
        if unit in depth:
            return depth[unit]
        if unit in visiting:
            raise ValueError(f"import cycle through {unit}")
        visiting.add(unit)
        depth[unit] = 1 + max((down(u) for u in edges.get(unit, ())), default=-1)
        visiting.discard(unit)
        return depth[unit]

    for unit in edges:
        down(unit)
    height = max(depth.values())
    level: dict[str, int] = {}
    for unit in sorted(edges, key=lambda u: -depth[u]):  # importers first
        above = [level[u] for u in edges if unit in edges[u]]
        level[unit] = 0 if not above else max(above) + 1
    rows: list[list[str]] = [[] for _ in range(max(level.values()) + 1)]
    for unit, n in level.items():
        rows[n].append(unit)
    assert len(rows) <= height + 1
    return [sorted(row) for row in rows]


def draw_text(edges: dict[str, set[str]]) -> str:
    """The floors, top to bottom, each unit with the units it imports."""
    lines = []
    for n, row in enumerate(floors(edges)):
        if n:
            lines.append("   │")
        for unit in row:
            below = ", ".join(sorted(edges[unit])) or "(nothing of Ember)"
            lines.append(f"{unit:<18} -> {below}")
    return "\n".join(lines)


def draw_png(edges: dict[str, set[str]], path: Path) -> None:
    """The same floors as boxes with an arrow per import between units."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = floors(edges)
    at: dict[str, tuple[float, float]] = {}
    for n, row in enumerate(rows):
        for i, unit in enumerate(row):
            at[unit] = ((i + 1) / (len(row) + 1), 1 - n / max(1, len(rows) - 1))
    fig, ax = plt.subplots(figsize=(7, 1.3 * len(rows)))
    for unit, imported in edges.items():
        for other in imported:
            ax.annotate(
                "", at[other], at[unit], arrowprops={"arrowstyle": "->", "color": "0.55", "shrinkA": 14,
                                                     "shrinkB": 14},
            )  # fmt: skip
    for unit, (x, y) in at.items():
        ax.text(x, y, unit, ha="center", va="center", bbox={"boxstyle": "round", "fc": "white", "ec": "0.2"})
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.12, 1.12)
    ax.axis("off")
    ax.set_title("Ember's imports: each unit imports only units below it")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.import_graph", description=__doc__.split("\n")[0])
    parser.add_argument("--png", type=Path, help="also draw the graph into this PNG file")
    args = parser.parse_args(argv)
    edges = unit_graph()
    print(draw_text(edges))
    if args.png is not None:
        draw_png(edges, args.png)
        print(f"drawn: {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
