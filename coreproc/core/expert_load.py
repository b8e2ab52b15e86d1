"""Tokens per expert of each mixture-of-experts layer over a window of steps, and their imbalance.

Runs in the scheduler process (coreproc). Each step's `RunnerOutput.expert_load` (per MoE layer the
tokens each expert took in that step, counted by the workers' MoE layers) is added; the counts of
steps older than the window fall out. `load` is what the engine reports (and an expert-parallel load
balancer reads); `imbalance` is max / mean tokens per expert, 1.0 for a perfectly even router, per
layer and for the model (the mean over its layers), 0.0 before any token.
"""

from __future__ import annotations

from collections import deque

WINDOW_STEPS = 1000  # steps the counts cover


class ExpertLoad:
    def __init__(self, window: int = WINDOW_STEPS) -> None:
        self.window = window
        self.steps: deque[dict[int, list[int]]] = deque()
        self.totals: dict[int, list[int]] = {}

    def add(self, step: dict[int, list[int]]) -> None:
        """One step's counts (layer index -> tokens per expert); nothing for a model without experts."""
        if not step:
            return
        self.steps.append(step)
        self._apply(step, 1)
        if len(self.steps) > self.window:
            self._apply(self.steps.popleft(), -1)

    def _apply(self, step: dict[int, list[int]], sign: int) -> None:
        for layer, counts in step.items():
            total = self.totals.setdefault(layer, [0] * len(counts))
            for e, n in enumerate(counts):
                total[e] += sign * n

    @property
    def load(self) -> dict[int, list[int]]:
        """Tokens per expert of each MoE layer over the window."""
        return {layer: list(counts) for layer, counts in sorted(self.totals.items())}

    def layer_imbalance(self) -> dict[int, float]:
        """max / mean tokens per expert of each layer (0.0 where no token came)."""
        return layer_imbalance(self.totals)

    @property
    def imbalance(self) -> float:
        """The mean over layers of their max / mean tokens per expert."""
        return mean_imbalance(self.totals)


def layer_imbalance(load: dict[int, list[int]]) -> dict[int, float]:
    """max / mean tokens per expert of each layer of `load` (0.0 where no token came)."""
    out = {}
    for layer, counts in sorted(load.items()):
        mean = sum(counts) / len(counts)
        out[layer] = max(counts) / mean if mean else 0.0
    return out


def mean_imbalance(load: dict[int, list[int]]) -> float:
    """The mean over the layers of `load` of their max / mean tokens per expert (0.0: no layer)."""
    layers = layer_imbalance(load)
    return sum(layers.values()) / len(layers) if layers else 0.0


def merge_loads(loads: list[dict[int, list[int]]]) -> dict[int, list[int]]:
    """Several engines' loads as one: each layer's counts summed expert by expert."""
    out: dict[int, list[int]] = {}
    for load in loads:
        for layer, counts in load.items():
            total = out.setdefault(layer, [0] * len(counts))
            for e, n in enumerate(counts):
                total[e] += n
    return out
