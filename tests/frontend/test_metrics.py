"""The server's Prometheus metrics: names, histogram buckets under a fake clock, counters and gauges.

Pure Python (prometheus-client only); the rendered text is parsed back with the library's own parser.
Run: `pytest -q tests/frontend/test_metrics.py`.
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coreproc.base.protocol import SchedulerStats
from frontend.http.metrics import _ENGINE_COUNTERS, _ENGINE_GAUGES, EngineMetrics

pytestmark = pytest.mark.unit

METRIC_NAMES = (
    "ember_requests_total",
    "ember_requests_rejected_total",
    "ember_prompt_tokens_total",
    "ember_generation_tokens_total",
    "ember_time_to_first_token_seconds",
    "ember_inter_token_latency_seconds",
    "ember_e2e_request_latency_seconds",
    "ember_num_requests_running",
    "ember_num_requests_waiting",
    "ember_kv_cache_usage_ratio",
    "ember_num_preemptions_total",
    "ember_prefix_cache_queries_total",
    "ember_prefix_cache_hits_total",
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


E0 = (("engine", "0"),)  # the labels of engine core 0's series (besides model_name)


def samples(metrics: EngineMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the rendered text: (name, sorted labels without model_name) -> value."""
    body, _ = metrics.render()
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            assert s.labels["model_name"] == metrics.model_name, s
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def bucket(metrics: EngineMetrics, name: str, le: str) -> float:
    """The cumulative count of histogram `name` at upper bound `le` (as rendered, e.g. "0.005")."""
    return samples(metrics)[(f"{name}_bucket", (("le", le),))]


def count(metrics: EngineMetrics, name: str) -> float:
    return samples(metrics)[(f"{name}_count", ())]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def metrics(clock: FakeClock) -> EngineMetrics:
    return EngineMetrics("tiny-llama", clock=clock)


def test_render_names_every_metric_with_its_model_label(metrics: EngineMetrics) -> None:
    metrics.request_rejected(400)  # labelled series only render once they have a child
    body, content_type = metrics.render()
    text = body.decode()
    assert content_type.startswith("text/plain")
    rendered = {name for name, _ in samples(metrics)}  # every sample carries model_name="tiny-llama"
    for name in METRIC_NAMES:
        assert f"# HELP {name.removesuffix('_total')}" in text, name
        assert name in rendered or f"{name}_count" in rendered, name


def test_ttft_itl_and_e2e_land_in_the_right_buckets(metrics: EngineMetrics, clock: FakeClock) -> None:
    timer = metrics.request_started()
    clock.advance(0.003)  # TTFT 3 ms: above 0.0025, within 0.005
    timer.tokens(1)
    clock.advance(0.030)  # one token after 30 ms
    timer.tokens(1)
    clock.advance(0.012)  # three tokens in 12 ms: 4 ms each
    timer.tokens(3)
    clock.advance(2.0)
    timer.finish("stop", prompt_tokens=7, generation_tokens=5)  # e2e 2.045 s

    ttft = "ember_time_to_first_token_seconds"
    assert count(metrics, ttft) == 1
    assert bucket(metrics, ttft, "0.0025") == 0 and bucket(metrics, ttft, "0.005") == 1
    assert samples(metrics)[(f"{ttft}_sum", ())] == pytest.approx(0.003)

    itl = "ember_inter_token_latency_seconds"
    assert count(metrics, itl) == 4  # 1 + 3 tokens after the first
    assert bucket(metrics, itl, "0.0025") == 0
    assert bucket(metrics, itl, "0.005") == 3  # the burst of three, 4 ms each
    assert bucket(metrics, itl, "0.025") == 3 and bucket(metrics, itl, "0.03") == 4
    assert samples(metrics)[(f"{itl}_sum", ())] == pytest.approx(0.042)

    e2e = "ember_e2e_request_latency_seconds"
    assert count(metrics, e2e) == 1
    assert bucket(metrics, e2e, "1.0") == 0 and bucket(metrics, e2e, "2.5") == 1
    assert samples(metrics)[(f"{e2e}_sum", ())] == pytest.approx(2.045)


def test_tokens_zero_and_calls_after_finish_are_ignored(metrics: EngineMetrics, clock: FakeClock) -> None:
    timer = metrics.request_started()
    clock.advance(1.0)
    timer.tokens(0)
    assert count(metrics, "ember_time_to_first_token_seconds") == 0
    timer.finish("abort", 3, 0)
    timer.tokens(2)
    timer.finish("stop", 3, 0)  # a second finish (e.g. from a `finally`) changes nothing
    s = samples(metrics)
    assert count(metrics, "ember_time_to_first_token_seconds") == 0
    assert count(metrics, "ember_e2e_request_latency_seconds") == 1
    assert s[("ember_requests_total", (("finished_reason", "abort"),))] == 1
    assert s[("ember_requests_total", (("finished_reason", "stop"),))] == 0
    assert s[("ember_prompt_tokens_total", ())] == 3


def test_counters_add_up(metrics: EngineMetrics) -> None:
    finished = [("stop", 10, 4), ("stop", 5, 6), ("length", 20, 16), ("abort", 8, 1), ("error", 2, 0)]
    for reason, prompt, generated in finished:
        metrics.request_started().finish(reason, prompt, generated)
    for code in (400, 400, 413, 503):
        metrics.request_rejected(code)
    s = samples(metrics)
    by_reason = {
        r: s[("ember_requests_total", (("finished_reason", r),))]
        for r in ("stop", "length", "abort", "error")
    }
    assert by_reason == {"stop": 2, "length": 1, "abort": 1, "error": 1}
    rejected = {c: s[("ember_requests_rejected_total", (("status_code", c),))] for c in ("400", "413", "503")}
    assert rejected == {"400": 2, "413": 1, "503": 1}
    assert s[("ember_prompt_tokens_total", ())] == 45
    assert s[("ember_generation_tokens_total", ())] == 27
    assert count(metrics, "ember_e2e_request_latency_seconds") == 5


def test_unknown_finish_reason_is_refused(metrics: EngineMetrics) -> None:
    with pytest.raises(AssertionError, match="finish reason"):
        metrics.request_started().finish("timeout", 1, 1)


def test_gauges_follow_update_engine(metrics: EngineMetrics) -> None:
    metrics.update_engine(SchedulerStats(num_running=3, num_waiting=5, kv_usage=0.25, num_steps=9))
    s = samples(metrics)
    assert s[("ember_num_requests_running", E0)] == 3
    assert s[("ember_num_requests_waiting", E0)] == 5
    assert s[("ember_kv_cache_usage_ratio", E0)] == 0.25
    metrics.update_engine(SchedulerStats(num_running=0, num_waiting=1, kv_usage=0.0))
    s = samples(metrics)
    assert s[("ember_num_requests_running", E0)] == 0
    assert s[("ember_num_requests_waiting", E0)] == 1
    assert s[("ember_kv_cache_usage_ratio", E0)] == 0.0
    metrics.update_engine(SchedulerStats(num_waiting=4))  # fields not given are an idle engine's
    assert samples(metrics)[("ember_num_requests_waiting", E0)] == 4
    assert samples(metrics)[("ember_num_requests_running", E0)] == 0


def test_expert_imbalance_gauges(metrics: EngineMetrics) -> None:
    stats = SchedulerStats(expert_imbalance=1.5, expert_layer_imbalance={0: 1.25, 1: 1.75})
    metrics.update_engine(stats)
    s = samples(metrics)
    assert s[("ember_moe_expert_imbalance", E0)] == 1.5
    assert s[("ember_moe_layer_expert_imbalance", (*E0, ("layer", "1")))] == 1.75


def test_mirrored_stats_are_scheduler_stats_fields() -> None:
    assert set(_ENGINE_GAUGES) | set(_ENGINE_COUNTERS) <= set(SchedulerStats.__struct_fields__)


def test_cumulative_engine_counters_are_mirrored(metrics: EngineMetrics) -> None:
    names = {
        "num_preemptions": "ember_num_preemptions_total",
        "prefix_cache_queries": "ember_prefix_cache_queries_total",
        "prefix_cache_hits": "ember_prefix_cache_hits_total",
    }

    def mirrored() -> dict[str, float]:
        s = samples(metrics)
        return {key: s[(name, E0)] for key, name in names.items()}

    metrics.update_engine(SchedulerStats(num_preemptions=2, prefix_cache_queries=100, prefix_cache_hits=40))
    assert mirrored() == {"num_preemptions": 2, "prefix_cache_queries": 100, "prefix_cache_hits": 40}
    metrics.update_engine(SchedulerStats(num_preemptions=2, prefix_cache_queries=164, prefix_cache_hits=72))
    assert mirrored() == {"num_preemptions": 2, "prefix_cache_queries": 164, "prefix_cache_hits": 72}
    # The engine restarted: its counters start again from zero; the exported ones keep growing.
    metrics.update_engine(SchedulerStats(num_preemptions=1, prefix_cache_queries=10, prefix_cache_hits=0))
    assert mirrored() == {"num_preemptions": 3, "prefix_cache_queries": 174, "prefix_cache_hits": 72}
    metrics.update_engine(SchedulerStats(num_preemptions=4, prefix_cache_queries=30, prefix_cache_hits=8))
    assert mirrored() == {"num_preemptions": 6, "prefix_cache_queries": 194, "prefix_cache_hits": 80}


def test_engine_series_are_labelled_by_data_parallel_rank(metrics: EngineMetrics) -> None:
    metrics.update_engine(SchedulerStats(num_running=3, prefix_cache_hits=5), 0)
    metrics.update_engine(SchedulerStats(num_running=7, prefix_cache_hits=2), 1)
    metrics.update_engine(SchedulerStats(num_running=1, prefix_cache_hits=9), 1)
    s = samples(metrics)
    assert s[("ember_num_requests_running", E0)] == 3
    assert s[("ember_num_requests_running", (("engine", "1"),))] == 1
    assert s[("ember_prefix_cache_hits_total", E0)] == 5
    assert s[("ember_prefix_cache_hits_total", (("engine", "1"),))] == 9  # each rank's own increase


def test_instances_do_not_share_state(clock: FakeClock) -> None:
    a = EngineMetrics("model-a", clock=clock)
    b = EngineMetrics("model-b", clock=clock)  # same metric names: would raise on a shared registry
    timer = a.request_started()
    clock.advance(0.5)
    timer.tokens(1)
    timer.finish("stop", 4, 1)
    a.request_rejected(401)
    a.update_engine(SchedulerStats(num_running=2, num_preemptions=5))

    sb = samples(b)
    assert sb[("ember_requests_total", (("finished_reason", "stop"),))] == 0
    assert sb[("ember_prompt_tokens_total", ())] == 0
    assert sb[("ember_num_requests_running", E0)] == 0
    assert sb[("ember_num_preemptions_total", E0)] == 0
    assert count(b, "ember_time_to_first_token_seconds") == 0
    assert not any(name == "ember_requests_rejected_total" for name, _ in sb)
    assert b"model-a" not in b.render()[0]
    assert samples(a)[("ember_requests_total", (("finished_reason", "stop"),))] == 1
