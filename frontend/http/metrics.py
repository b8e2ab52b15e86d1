"""Prometheus metrics of the HTTP server, rendered at `GET /metrics`.

Runs in the frontend process. Request handlers report each request's life through a `RequestTimer`
(admitted -> tokens arrive -> finished) and refusals through `request_rejected`; a periodic poll of
the core's "stats" utility (a `SchedulerStats`) feeds `update_engine`. Nothing is sent anywhere:
Prometheus scrapes `render()`. Every `EngineMetrics` owns its `CollectorRegistry` (never the library's
global one) and labels every series with `model_name`; with several API server processes,
prometheus-client's multiprocess mode adds their series up (frontend.http.processes). Latencies use
`time.monotonic` unless a clock is injected.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from coreproc.base.protocol import FINISH_REASONS, FinishReason, SchedulerStats

Clock = Callable[[], float]

# Seconds. Wide enough for a GPU (sub-millisecond decode steps) and for the Triton interpreter on a
# CPU (seconds per step, minutes per request).
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 3600.0,
)  # fmt: skip

# `SchedulerStats` fields shown as gauges: field -> (metric name, help).
_ENGINE_GAUGES = {
    "num_running": ("ember_num_requests_running", "Requests the engine is running (in the current batch)."),
    "num_waiting": ("ember_num_requests_waiting", "Requests queued in the engine, waiting to be scheduled."),
    "kv_usage": ("ember_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use, 0 to 1."),
    "prefix_cache_hit_rate": (
        "ember_prefix_cache_hit_rate",
        "Share of looked-up prompt tokens found in the prefix cache since the engine started, 0 to 1.",
    ),
    "num_queued_tokens": ("ember_num_queued_prompt_tokens", "Prompt tokens of the requests waiting."),
    "num_requests": (
        "ember_num_requests_held",
        "Requests the engine core's scheduler holds (running, waiting or in flight); 0 when idle.",
    ),
    "num_client_requests": (
        "ember_num_client_requests",
        "Requests the engine core still maps to a client connection; 0 when idle.",
    ),
    "expert_imbalance": (
        "ember_moe_expert_imbalance",
        "Mixture of experts: max / mean tokens per expert over the last steps, mean over layers (1: even).",
    ),
    "spec_acceptance_rate": (
        "ember_spec_decode_acceptance_rate",
        "Speculative decoding: accepted / proposed tokens since the engine started.",
    ),
    "spec_mean_accepted_length": (
        "ember_spec_decode_mean_accepted_length",
        "Speculative decoding: tokens produced per verification step (1 + accepted proposals).",
    ),
}
# Cumulative `SchedulerStats` fields mirrored as counters (prometheus_client appends `_total`).
_ENGINE_COUNTERS = {
    "num_preemptions": ("ember_num_preemptions", "Requests preempted by the engine (KV cache full)."),
    "prefix_cache_queries": ("ember_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("ember_prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "mm_cache_hits": ("ember_mm_cache_hits", "Images sent by hash that the engine still held."),
    "mm_cache_misses": ("ember_mm_cache_misses", "Images sent by hash that the engine no longer held."),
    "encoder_cache_hits": ("ember_encoder_cache_hits", "Images whose vision-encoder output was reused."),
    "encoder_cache_misses": ("ember_encoder_cache_misses", "Images run through the vision encoder."),
    "spec_num_drafts": ("ember_spec_decode_num_drafts", "Speculative decoding: verification steps."),
    "spec_num_proposed": ("ember_spec_decode_num_draft_tokens", "Speculative decoding: proposed tokens."),
    "spec_num_accepted": ("ember_spec_decode_num_accepted_tokens", "Speculative decoding: accepted tokens."),
    "worker_busy_seconds": (
        "ember_worker_busy_seconds",
        "Seconds the worker spent executing steps (inputs, model forward, sampling); the rest of the "
        "wall time is scheduling, IPC, detokenization and HTTP.",
    ),
}


class EngineMetrics:
    """All of the server's metrics for one served model, in a registry of their own.

    Finished requests count in `ember_requests_total{finished_reason}` (stop, length, abort, error);
    requests refused before reaching the engine count separately in
    `ember_requests_rejected_total{status_code}`, so the first counter is always the engine's view.
    """

    def __init__(self, model_name: str, *, clock: Clock = time.monotonic, api_server: int = 0) -> None:
        self.model_name = model_name
        self.clock = clock
        # several API server processes (PROMETHEUS_MULTIPROC_DIR set): /metrics adds up their files
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self._requests = Counter(
            "ember_requests",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        for reason in FINISH_REASONS:  # export zeros so rates work before the first request
            self._requests.labels(model_name, reason)
        self._rejected = Counter(
            "ember_requests_rejected",
            "Requests refused before reaching the engine, by HTTP status code.",
            [*labels, "status_code"],
            registry=reg,
        )
        self.prompt_tokens = counter("ember_prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("ember_generation_tokens", "Generated tokens of finished requests.")
        self.ttft = histogram(
            "ember_time_to_first_token_seconds", "Seconds from admission to the first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "ember_inter_token_latency_seconds",
            "Seconds between generated tokens (a burst of n tokens counts n samples of gap / n).",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "ember_e2e_request_latency_seconds",
            "Seconds from admission to the end of a request.",
            E2E_BUCKETS,
        )
        self._spec_position = Gauge(
            "ember_spec_decode_acceptance_rate_per_position",
            "Speculative decoding: acceptance rate of the proposed token at each position.",
            [*labels, "engine", "position"],
            registry=reg,
            multiprocess_mode="mostrecent",
        )
        self._layer_imbalance = Gauge(
            "ember_moe_layer_expert_imbalance",
            "Mixture of experts: max / mean tokens per expert of each MoE layer over the last steps.",
            [*labels, "engine", "layer"],
            registry=reg,
            multiprocess_mode="mostrecent",
        )
        engine = [*labels, "engine"]  # the engine core's data-parallel rank
        self._gauges = {  # set by API server 0 only: its latest value is the core's
            key: Gauge(name, doc, engine, registry=reg, multiprocess_mode="mostrecent")
            for key, (name, doc) in _ENGINE_GAUGES.items()
        }
        self._mirrored = {
            key: Counter(name, doc, engine, registry=reg) for key, (name, doc) in _ENGINE_COUNTERS.items()
        }
        self._routed = Counter(
            "ember_engine_requests_routed",
            "Requests (sequences) the frontend sent to each engine core (data parallelism).",
            engine,
            registry=reg,
        )
        self._open = Gauge(
            "ember_frontend_open_requests",
            "Engine requests this frontend is streaming (all API server processes added up); 0 when idle.",
            labels,
            registry=reg,
            multiprocess_mode="livesum",
        ).labels(model_name)
        self._served = Counter(
            "ember_api_server_requests",
            "Requests admitted by each HTTP frontend process (--api-server-count).",
            [*labels, "api_server"],
            registry=reg,
        ).labels(model_name, str(api_server))
        for metric in (*self._gauges.values(), *self._mirrored.values(), self._routed):
            metric.labels(model_name, "0")  # exported at zero before the first stats arrive
        self._last_cumulative: dict[tuple[str, int], float] = {}

    def request_started(self) -> RequestTimer:
        """Call when a request is admitted; the timer starts now."""
        self._served.inc()
        return RequestTimer(self)

    def request_rejected(self, status_code: int) -> None:
        """A request refused (4xx/5xx) before it reached the engine."""
        self._rejected.labels(self.model_name, str(status_code)).inc()

    def _record_finished(
        self, finish_reason: FinishReason, prompt_tokens: int, generation_tokens: int
    ) -> None:
        self._requests.labels(self.model_name, finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)

    def update_engine(self, stats: SchedulerStats, engine: int = 0) -> None:
        """Mirror the "stats" utility result of engine core `engine` (its data-parallel rank).

        Cumulative engine counters are added by their increase since the last update. A value lower
        than the last one means the engine restarted from zero, so all of it is new.
        """
        rank = str(engine)
        for key, gauge in self._gauges.items():
            gauge.labels(self.model_name, rank).set(getattr(stats, key))
        positions = zip(stats.spec_accepted_per_position, stats.spec_proposed_per_position)
        for pos, (acc, prop) in enumerate(positions):
            self._spec_position.labels(self.model_name, rank, str(pos)).set(acc / prop if prop else 0.0)
        for layer, ratio in stats.expert_layer_imbalance.items():
            self._layer_imbalance.labels(self.model_name, rank, str(layer)).set(ratio)
        for key, counter in self._mirrored.items():
            value, last = float(getattr(stats, key)), self._last_cumulative.get((key, engine), 0.0)
            delta = value - last if value >= last else value
            if delta > 0:
                counter.labels(self.model_name, rank).inc(delta)
            self._last_cumulative[key, engine] = value

    def update_open(self, count: int) -> None:
        """How many engine requests this process is streaming now."""
        self._open.set(count)

    def update_routed(self, routed: list[int]) -> None:
        """Mirror the router's per-core count of requests sent (cumulative)."""
        for rank, value in enumerate(routed):
            series = self._routed.labels(self.model_name, str(rank))
            last = self._last_cumulative.get(("routed", rank), 0.0)
            if value > last:
                series.inc(value - last)
            self._last_cumulative["routed", rank] = value

    def render(self) -> tuple[bytes, str]:
        """The body and content type of a `GET /metrics` response (Prometheus text format)."""
        if not self.multiprocess:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """The timeline of one admitted request: first token, later tokens, end."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self._metrics = metrics
        self._clock = metrics.clock
        self.start = self._clock()
        self._last_token: float | None = None
        self.finished = False

    def tokens(self, n: int) -> None:
        """`n` new tokens arrived now: the first call records TTFT, later ones inter-token latency.

        A later call observes `gap / n` for each of the n tokens (a burst from a multi-token step,
        or several sequences of an n > 1 request, spreads the gap evenly). n <= 0 is ignored.
        """
        if n <= 0 or self.finished:
            return
        now = self._clock()
        if self._last_token is None:
            self._metrics.ttft.observe(now - self.start)
        else:
            per_token = (now - self._last_token) / n
            for _ in range(n):
                self._metrics.itl.observe(per_token)
        self._last_token = now

    def finish(self, finish_reason: FinishReason, prompt_tokens: int, generation_tokens: int) -> None:
        """Record end-to-end latency and the counters; later calls are ignored (safe in `finally`).

        `finish_reason` is one of stop, length, abort, error.
        """
        assert finish_reason in FINISH_REASONS, f"unknown finish reason {finish_reason!r}"
        if self.finished:
            return
        self.finished = True
        self._metrics.e2e.observe(self._clock() - self.start)
        self._metrics._record_finished(finish_reason, prompt_tokens, generation_tokens)
