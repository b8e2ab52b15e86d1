"""The experts' load window (coreproc/core/expert_load.py): counts added per step, old steps dropped,
max / mean per layer and over the model. Run: `pytest -q tests/coreproc/core/test_expert_load.py`."""

from __future__ import annotations

import pytest

from coreproc.core.expert_load import ExpertLoad


def test_window_sums_the_last_steps_and_their_imbalance() -> None:
    load = ExpertLoad(window=2)
    assert load.load == {} and load.imbalance == 0.0
    load.add({})  # a model without experts sends nothing
    load.add({0: [4, 0, 0, 0], 3: [1, 1, 1, 1]})
    assert load.layer_imbalance() == {0: 4.0, 3: 1.0}
    assert load.imbalance == pytest.approx(2.5)
    load.add({0: [0, 4, 0, 0], 3: [2, 2, 2, 2]})
    assert load.load == {0: [4, 4, 0, 0], 3: [3, 3, 3, 3]}
    load.add({0: [0, 0, 4, 4], 3: [0, 0, 0, 8]})  # the first step leaves the window
    assert load.load == {0: [0, 4, 4, 4], 3: [2, 2, 2, 10]}
    assert load.layer_imbalance() == {0: pytest.approx(4 / 3), 3: pytest.approx(10 / 4)}
