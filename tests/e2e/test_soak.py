"""The soak tool's short profile in CI: a live `ember serve` under many concurrent clients.

`tools.soak` drives streaming, hung-up, n > 1, stop-string, shared-prefix and plain requests at once
against a server with a small queue limit: every request completes or is refused with 503, none fails,
and afterwards nothing is left (no KV block, no running or waiting request, nothing held by the core
or mapped to a client, no stream open in the frontend). The long run on the real SmolLM2 (500
clients, 20,000 requests, RSS curve) is by hand: see docs/RELIABILITY.md.
Run: pytest -q -m reliability tests/e2e/test_soak.py
"""

from __future__ import annotations

import argparse
import asyncio

import pytest

from tests.server_util import start_server, stop_server
from tools import soak

pytestmark = pytest.mark.reliability


def test_concurrent_mixed_load_completes_or_is_refused_and_leaves_nothing(make_ckpt, tmp_path) -> None:
    proc, url = start_server(str(make_ckpt("llama")), "--max-num-queued-requests", "48", name="soak")
    sampler = soak.RssSampler(proc.pid, 0.2)
    try:
        args = argparse.Namespace(
            seed=3, concurrency=96, requests=400, served_model_name="soak", max_tokens=16, timeout=120.0
        )
        sampler.start()
        outcomes, _ = asyncio.run(soak.drive(args, url, sampler))
        sampler.done.set()
        results = {o.result for o in outcomes}
        errors = [o for o in outcomes if o.result == "error"]
        assert not errors, errors[:3]
        assert results <= {"ok", "refused", "hung-up"}
        assert sum(o.result == "ok" for o in outcomes) >= 100
        assert {o.behaviour for o in outcomes if o.result == "ok"} >= set(soak.BEHAVIOURS) - {"disconnect"}
        # a disconnecting client hangs up after its second event, unless the stream ended in one (an early
        # EOS of the random model, or every token in one event when the frontend falls behind)
        quitters = [o for o in outcomes if o.behaviour == "disconnect" and o.result != "refused"]
        assert any(o.result == "hung-up" for o in quitters)
        assert all(o.result == "hung-up" or (o.result == "ok" and not o.itls) for o in quitters)
        assert soak.left_over(url) == {}
        # the RSS of the frontend, the core and its worker, sampled against requests finished, and plotted
        sampler.join(5)
        assert sampler.finished == 400 and sampler.finished_at == sorted(sampler.finished_at)
        names = set(sampler.samples[-1][1])
        assert {"ember serve (frontend)", "ember-core", "ember-worker-0"} <= {
            n.rsplit(" (", 1)[0] for n in names
        }
        soak.plot(sampler, str(tmp_path / "rss.png"), "CI profile")
        assert (tmp_path / "rss.png").read_bytes()[:4] == b"\x89PNG"
    finally:
        sampler.done.set()
        stop_server(proc)
