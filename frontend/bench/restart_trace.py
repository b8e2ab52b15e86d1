"""The start-up breakdown of `ember bench restart --trace`: where each second to a first token goes.

Runs in the user's shell. A timed start runs with $EMBER_STARTUP_TRACE naming a fresh file, so every
process of it (the frontend, the engine cores, the workers, a snapshot restore's controller) appends
its phases there (coreproc.base.trace); the benchmark adds its own marks as the "client" (launch,
/health answered, first token back). `table` prints the phases against the launch, one row each, by
start; `plot` draws them as a timeline, one lane per process and one panel per kind of start.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coreproc.base import trace

CLIENT = "client"


def _fresh_file() -> Path:
    fd, name = tempfile.mkstemp(prefix="ember-trace-", suffix=".jsonl")
    os.close(fd)
    return Path(name)


@dataclass
class StartTrace:
    """One timed start's trace file and the client's marks (wall-clock seconds)."""

    path: Path = field(default_factory=_fresh_file)
    launch: float = 0.0  # when the benchmark launched the start

    def env(self) -> dict[str, str]:
        """The environment of the traced command: ours plus the trace file."""
        return {**os.environ, trace.ENV: str(self.path)}

    def mark(self, phase: str, start: float, end: float) -> None:
        trace.record(phase, start, end, process=CLIENT, to=self.path)

    def lines(self) -> list[dict[str, Any]]:
        return trace.read(self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def table(kind: str, start: StartTrace) -> str:
    """The phases of one start, seconds after its launch, ordered by start."""
    lines = start.lines()
    total = max((r["end"] for r in lines), default=start.launch) - start.launch
    out = [f"breakdown of the {kind} start: {total:.2f} s from launch to a first token (s after launch)"]
    out.append(f"  {'process':<24}{'phase':<44}{'from':>7}{'to':>7}{'takes':>7}")
    for r in lines:
        begin, end = r["start"] - start.launch, r["end"] - start.launch
        out.append(f"  {r['process']:<24}{r['phase']:<44}{begin:>7.2f}{end:>7.2f}{end - begin:>7.2f}")
    return "\n".join(out)


def _depth(i: int, lines: list[dict[str, Any]]) -> int:
    """How many phases of the same process, listed before phase `i` (by start), were still under way
    when it began: phases nest, and a thread's run beside the main one's."""
    r = lines[i]
    return sum(o["process"] == r["process"] and r["start"] < o["end"] for o in lines[:i])


def plot(starts: dict[str, StartTrace], path: str) -> None:
    """A timeline per kind of start: one lane per process, a bar per phase, labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(starts), 1, figsize=(12, 2.2 + 1.6 * len(starts) * 2), squeeze=False)
    for ax, (kind, start) in zip(axes[:, 0], starts.items()):
        lines = start.lines()
        lanes = list(dict.fromkeys(r["process"] for r in lines))
        for i, r in enumerate(lines):
            depth = _depth(i, lines)  # begun while another of its process ran: a thinner bar on top
            y = lanes.index(r["process"]) + 0.18 * depth
            begin, width = r["start"] - start.launch, max(r["end"] - r["start"], 0.002)
            ax.barh(y, width, left=begin, height=0.6 / (1 + depth), edgecolor="black", linewidth=0.4)
            if width > 0.04:
                ax.text(begin + width / 2, y, r["phase"], ha="center", va="center", fontsize=6)
        ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("seconds after launch")
        ax.set_title(f"{kind} start", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
