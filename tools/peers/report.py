"""compare_peers' results and report: one `PeerResult` per peer, the table and its header lines.

Used by tools/compare_peers.py (the orchestrator). Columns: output tokens/s of the batch workload, of
one request alone (end to end) and of its decode steps, prompt processing tokens/s of one long
prompt, start-to-ready and start-to-first-token seconds, Ember's ratios to each peer, and the status
(why a peer has no figures).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass
class PeerResult:
    """One row of the table. ``status`` is "ok" or why there are no figures."""

    peer: str
    status: str
    version: str = ""
    batch_tps: float | None = None
    single_tps: float | None = None
    ready_s: float | None = None
    detail: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def decode_tps(self) -> float | None:
        return self.detail.get("single_decode_tps")

    @property
    def prefill_tps(self) -> float | None:
        return self.detail.get("prefill_tps")

    @property
    def first_token_s(self) -> float | None:
        """Process start to the first output token of the first request."""
        first = self.detail.get("first_token_after_ready_s")
        return None if first is None or self.ready_s is None else self.ready_s + first


def ratio(ember: float | None, peer: float | None) -> float | None:
    return ember / peer if ember and peer else None


def ratios(ember: PeerResult | None, r: PeerResult) -> dict[str, float | None]:
    """Ember's figure over the peer's for each throughput column (None where either is missing)."""
    if ember is None:
        return {"batch": None, "single": None, "decode": None, "prefill": None}
    return {
        "batch": ratio(ember.batch_tps, r.batch_tps),
        "single": ratio(ember.single_tps, r.single_tps),
        "decode": ratio(ember.decode_tps, r.decode_tps),
        "prefill": ratio(ember.prefill_tps, r.prefill_tps),
    }


def render_table(results: list[PeerResult], n: int, prefill_len: int) -> list[str]:
    """Rows of the table, columns padded; numbers right-aligned, '-' where there is no figure."""
    ember = next((r for r in results if r.peer == "ember" and r.ok), None)
    head = ["peer", "version", f"batch-{n} tok/s", "batch-1 tok/s", "b1 decode tok/s"]
    head += [f"prefill-{prefill_len} tok/s", "ready s", "first token s"]
    head += [f"ember/peer b{n}", "b1 decode", "prefill", "status"]

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    rows = [head]
    for r in results:
        q = ratios(ember, r)
        rows.append(
            [
                r.peer,
                r.version or "-",
                num(r.batch_tps, ".1f"),
                num(r.single_tps, ".1f"),
                num(r.decode_tps, ".1f"),
                num(r.prefill_tps, ".1f"),
                num(r.ready_s, ".1f"),
                num(r.first_token_s, ".1f"),
                num(q["batch"], ".2f"),
                num(q["decode"], ".2f"),
                num(q["prefill"], ".2f"),
                r.status[:160],
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    left = {0, 1, len(head) - 1}
    lines = []
    for k, row in enumerate(rows):
        cells = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def gpu_note(machine: dict, args: argparse.Namespace) -> str:
    """ ", GPU NAME (Ember and transformers on cuda)" for a run on a GPU, else ""."""
    device = getattr(args, "device", "cpu")
    return "" if device == "cpu" else f", GPU {machine.get('gpu')} (Ember and transformers on {device})"


def header_lines(machine: dict, model: dict, args: argparse.Namespace) -> list[str]:
    weights = f", weights {args.gguf}" if getattr(args, "gguf", None) else ""
    return [
        f"machine: {machine['cpu']}, {machine['cores']} cores ({machine['usable_cores']} usable), "
        f"{machine['memory_gib']} GiB RAM, {machine['os']}, Python {machine['python']}, "
        f"ISA {' '.join(machine['isa']) or '?'}, load average {machine['load_average']} at the start"
        + (gpu_note(machine, args)),
        f"model: {model['path']} ({model['architecture']}, {model['params'] / 1e6:.1f}M params, "
        f"{model['dtype']}){weights}",
        f"workload: greedy, ignore EOS, {args.num_prompts} prompts x {args.input_len} in / "
        f"{args.output_len} out (batch-{args.num_prompts}), 1 prompt alone (batch-1) and one "
        f"{args.prefill_len}-token prompt (prefill), {args.threads} threads, prompt seed {args.seed}",
    ]
