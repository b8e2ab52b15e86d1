"""One PNG per model from `tools/compare_peers.py --result-json` files: tok/s by engine and workload.

Usage: `python -m tools.plot_peers RUN.json [RUN.json ...] --out PLOT.png [--title TITLE]`. Each file is
one run of compare_peers (say the Q4_K_M file's and the Q8_0 file's); every peer with figures becomes a
bar labelled with its name and the run's weights (the GGUF file's quantization, or the folder's dtype),
in three panels: batch-N output tok/s, batch-1 output tok/s (end to end: every peer reports it) and
prefill tok/s (n/a where a peer does not report it), each bar with its value.
matplotlib (the `bench` extra) draws it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

PANELS = (
    ("batch_tps", "batch-{n} output tok/s"),
    ("single_tps", "batch-1 output tok/s (end to end)"),
    ("prefill", "prefill-{p} tok/s"),
)
NAMES = {"llamacpp": "llama.cpp", "vllm": "vLLM-CPU"}


def weights_label(run: dict[str, Any]) -> str:
    """Q4_K_M for `...Instruct.Q4_K_M.gguf`; the dtype for a folder."""
    gguf = run["workload"].get("gguf")
    if not gguf:
        return run["workload"]["dtype"]
    match = re.search(r"\.((?:[QF]\d\w*)|(?:BF16|F16|F32))\.gguf$", Path(gguf).name, re.IGNORECASE)
    return match.group(1) if match else Path(gguf).stem


def bars(runs: list[dict[str, Any]]) -> list[tuple[str, dict[str, float | None]]]:
    """(label, figures by panel key) for every peer with figures, run by run. The torch peers run the
    dequantized folder whatever the GGUF file, so each appears once (from the first run that has it)."""
    out, seen = [], set()
    for run in runs:
        label = weights_label(run)
        for peer in run["peers"]:
            if peer["status"] != "ok":
                continue
            on_gguf = peer["peer"] in ("ember", "llamacpp") and run["workload"].get("gguf")
            name = f"{NAMES.get(peer['peer'], peer['peer'])} {label if on_gguf else run['workload']['dtype']}"
            if name in seen:
                continue
            seen.add(name)
            detail = peer["detail"]
            out.append(
                (
                    name,
                    {
                        "batch_tps": peer["batch_tps"],
                        "single_tps": peer["single_tps"],
                        "prefill": detail.get("prefill_tps"),
                    },
                )
            )
    return out


def write_plot(runs: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = bars(runs)
    if not rows:
        raise ValueError("no peer has figures in these runs")
    n, p = runs[0]["workload"]["num_prompts"], runs[0]["workload"]["prefill_len"]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 0.45 * len(rows) + 1.6))
    colors = plt.get_cmap("tab10").colors
    for ax, (key, head) in zip(axes, PANELS):
        values = [figs[key] for _, figs in rows]
        ys = range(len(rows))
        ax.barh(list(ys), [v or 0.0 for v in values], color=[colors[i % len(colors)] for i in ys])
        ax.set_yticks(list(ys), [name for name, _ in rows] if ax is axes[0] else [""] * len(rows))
        ax.invert_yaxis()
        ax.set_title(head.format(n=n, p=p))
        for y, v in zip(ys, values):  # a peer that does not report the figure: n/a, no bar
            ax.text(v or 0.0, y, f" {v:.1f}" if v else " n/a", va="center", fontsize=8)
        ax.set_xlim(0, max(v or 0.0 for v in values) * 1.25 or 1.0)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="compare_peers --result-json files")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--title", default=None, help="default: the model folder's name")
    args = p.parse_args(argv)
    try:
        runs = [json.loads(Path(f).read_text()) for f in args.runs]
        title = args.title or Path(runs[0]["model"]["path"]).parent.name
        write_plot(runs, args.out, title)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
