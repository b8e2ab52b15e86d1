"""tools/kv_footprint.py on a tiny Gemma 3 (six sliding layers of window 8, one global): a long request
holds far less KV while it decodes when the windows give their blocks back, and exactly as much as
every layer's blocks when they are kept. Run: `pytest -q tests/tools/test_kv_footprint.py`."""

from __future__ import annotations

import re
import sys

import pytest

from tests.workers.test_architectures import FAMILIES, SHAPES
from tools import kv_footprint

pytestmark = pytest.mark.unit


def test_windows_hold_a_fraction_of_the_kv(make_ckpt, monkeypatch, capsys) -> None:
    path = make_ckpt("gemma3", **{**SHAPES, **FAMILIES["gemma3"]})
    argv = ["kv_footprint", str(path), "--tokens", "400", "--block-size", "4", "--budget", "64"]
    monkeypatch.setattr(sys, "argv", argv)
    kv_footprint.main()
    out = capsys.readouterr().out
    most, decoding = (
        float(x) for x in re.search(r"ratio: ([\d.]+) at most, ([\d.]+) decoding", out).groups()
    )
    # 1 global layer of 7 keeps all 101 blocks, 6 sliding ones at most 3: (101 + 18) / 707
    assert decoding == pytest.approx((101 + 6 * 3) / (7 * 101), abs=2e-3)
    assert decoding < most < 1.0
