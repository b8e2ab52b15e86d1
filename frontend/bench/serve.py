"""`ember bench serve`: load an OpenAI-compatible HTTP server and report serving latency and throughput.

Runs in the caller's process as an asyncio HTTP client (httpx, imported lazily); it starts no engine.
Sends streaming /v1/completions or /v1/chat/completions requests (random, shared-prefix or ShareGPT
prompts; Poisson arrivals; optional concurrency cap), times every SSE chunk, and prints one summary
line plus a table of TTFT, TPOT, ITL and end-to-end latency (mean, median, std, percentiles), request
and token throughput, goodput under SLOs and the prefix-cache hit rate (from Ember's /metrics counters,
when present). Metric math, table and plot live in `frontend/bench/serve_report.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from frontend.bench.images import parse_size, request_images
from frontend.bench.serve_report import (
    RequestRecord,
    compute_metrics,
    format_table,
    parse_counters,
    write_plot,
)

__all__ = ["BenchServeConfig", "RequestRecord", "add_arguments", "compute_metrics", "main", "run_benchmark"]

SLO_KEYS = ("ttft", "tpot", "e2el")
PREFIX_COUNTERS = ("ember_prefix_cache_queries", "ember_prefix_cache_hits")
IMAGE_COUNTERS = ("ember_encoder_cache_hits", "ember_encoder_cache_misses", "ember_mm_cache_hits")
BUSY_COUNTER = "ember_worker_busy_seconds"  # Ember's: worker time in steps
MIN_TOKEN_ID = 10  # random prompt ids start here, clear of the usual special tokens
# Chat prompts are text: this many-word pool gives roughly one to two tokens per word.
WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member law car"
).split()


class BenchServeError(Exception):
    """A failure before any load is sent (unreachable server, bad dataset); the CLI exits 2."""


def _slo(text: str) -> tuple[str, float]:
    key, sep, ms = text.partition(":")
    if not sep or key not in SLO_KEYS:
        raise argparse.ArgumentTypeError(f"goodput SLO {text!r} is not KEY:MS with KEY in {SLO_KEYS}")
    return key, float(ms)


def _percentiles(text: str) -> tuple[float, ...]:
    values = tuple(float(v) for v in text.split(",") if v.strip())
    if not values or any(not 0 < v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"percentiles {text!r} must be comma-separated values in (0, 100]")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `ember bench serve`."""
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--backend", choices=["openai", "openai-chat"], default="openai")
    p.add_argument("--model", default=None, help="model name (default: the first id of GET /v1/models)")
    p.add_argument(
        "--dataset",
        choices=["random", "sharegpt", "prefix", "random-mm"],
        default="random",
        help="random-mm: chat requests with random images (implies --backend openai-chat)",
    )
    p.add_argument("--mm-images-per-request", type=int, default=1, help="random-mm: images per request")
    p.add_argument("--mm-image-size", default="336x336", help="random-mm: WxH of each image")
    p.add_argument("--mm-unique-images", type=int, default=0, help="random-mm: draw images from a pool of N")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-style JSON file (for --dataset sharegpt)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (suffix tokens for prefix)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of every request")
    p.add_argument("--prefix-len", type=int, default=256, help="tokens of each shared prefix")
    p.add_argument("--num-prefixes", type=int, default=4, help="distinct shared prefixes, used round robin")
    p.add_argument(
        "--vocab-size", type=int, default=1000, help=f"random ids are drawn in [{MIN_TOKEN_ID}, V)"
    )
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None, help="write the result (with per-request arrays) here")
    p.add_argument("--plot", default=None, help="write latency CDFs and throughput over time to this PNG")
    p.add_argument("--goodput", nargs="+", type=_slo, default=(), metavar="KEY:MS", help="e.g. ttft:500")
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--percentiles", type=_percentiles, default=(50.0, 90.0, 99.0), help='e.g. "50,90,99"')
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument(
        "--metrics-settle", type=float, default=1.5, help="seconds /metrics must stay unchanged after the run"
    )


@dataclass(frozen=True)
class BenchServeConfig:
    """Everything one benchmark run needs, built once from the CLI."""

    base_url: str
    backend: str = "openai"
    model: str | None = None
    dataset: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    prefix_len: int = 256
    num_prefixes: int = 4
    vocab_size: int = 1000
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    result_json: str | None = None
    plot: str | None = None
    goodput: tuple[tuple[str, float], ...] = ()
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    timeout: float = 600.0
    metrics_settle: float = 1.5
    mm_images_per_request: int = 1
    mm_image_size: str = "336x336"
    mm_unique_images: int = 0

    def __post_init__(self) -> None:
        if self.dataset == "random-mm":
            object.__setattr__(self, "backend", "openai-chat")
            try:
                parse_size(self.mm_image_size)
            except ValueError as e:
                raise BenchServeError(str(e)) from None
            if self.mm_images_per_request < 1 or self.mm_unique_images < 0:
                raise BenchServeError("--mm-images-per-request must be >= 1, --mm-unique-images >= 0")
        if self.num_prompts < 1 or self.output_len < 1:
            raise BenchServeError("--num-prompts and --output-len must be at least 1")
        if self.dataset == "sharegpt" and not self.dataset_path:
            raise BenchServeError("--dataset sharegpt needs --dataset-path")
        if self.dataset == "prefix" and (self.prefix_len < 1 or self.num_prefixes < 1):
            raise BenchServeError("--dataset prefix needs --prefix-len >= 1 and --num-prefixes >= 1")
        if self.vocab_size <= MIN_TOKEN_ID:
            raise BenchServeError(f"--vocab-size must exceed {MIN_TOKEN_ID}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchServeConfig:
        names = set(cls.__dataclass_fields__)
        values = {k: v for k, v in vars(args).items() if k in names}
        values["base_url"] = values["base_url"].rstrip("/").removesuffix("/v1")
        values["api_key"] = values.get("api_key") or os.environ.get("OPENAI_API_KEY")
        values["goodput"] = tuple(values.get("goodput") or ())
        return cls(**values)

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.backend == "openai-chat" else "/v1/completions"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class BenchRequest:
    """One prompt to send: text or token ids; `prompt_len` is exact for ids, None for text."""

    prompt: str | list[int]
    prompt_len: int | None
    images: tuple[str, ...] = ()  # data: URLs, sent as image parts before the text (chat only)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(MIN_TOKEN_ID, vocab) for _ in range(n)]


def _sharegpt(cfg: BenchServeConfig, rng: random.Random) -> list[BenchRequest]:
    try:
        with open(cfg.dataset_path) as f:
            entries = json.load(f)
    except (OSError, ValueError) as e:
        raise BenchServeError(f"cannot read ShareGPT file {cfg.dataset_path}: {e}") from None
    prompts = []
    for entry in entries if isinstance(entries, list) else []:
        turns = (entry.get("conversations") or entry.get("messages") or []) if isinstance(entry, dict) else []
        for turn in turns:
            if isinstance(turn, dict) and turn.get("from", turn.get("role")) in ("human", "user"):
                text = turn.get("value", turn.get("content"))
                if isinstance(text, str) and text:
                    prompts.append(text)
                break
    if not prompts:
        raise BenchServeError(f"no human turns in {cfg.dataset_path}")
    rng.shuffle(prompts)
    return [BenchRequest(prompts[i % len(prompts)], None) for i in range(cfg.num_prompts)]


def make_requests(cfg: BenchServeConfig) -> list[BenchRequest]:
    """The prompts of the run, deterministic in `cfg.seed`.

    Completions get token-id prompts (exact lengths); chat gets text of `input_len` random words, so
    its token counts are approximate (the reported input tokens come from the server's usage).
    """
    rng = random.Random(cfg.seed)
    if cfg.dataset == "sharegpt":
        return _sharegpt(cfg, rng)
    text = cfg.backend == "openai-chat"

    def make(n: int) -> str | list[int]:
        return _words(rng, n) if text else _ids(rng, n, cfg.vocab_size)

    prefixes = [make(cfg.prefix_len) for _ in range(cfg.num_prefixes)] if cfg.dataset == "prefix" else [""]
    images: list[tuple[str, ...]] = [()] * cfg.num_prompts
    if cfg.dataset == "random-mm":
        size = parse_size(cfg.mm_image_size)
        images = request_images(rng, cfg.num_prompts, cfg.mm_images_per_request, size, cfg.mm_unique_images)
    out = []
    for i in range(cfg.num_prompts):
        prefix, suffix = prefixes[i % len(prefixes)], make(cfg.input_len)
        if text:
            out.append(BenchRequest(f"{prefix} {suffix}".strip(), None, images[i]))
        else:
            out.append(BenchRequest(list(prefix) + suffix, len(prefix) + len(suffix)))
    return out


def _body(cfg: BenchServeConfig, model: str, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": cfg.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": cfg.ignore_eos,
    }
    if cfg.backend == "openai-chat":
        content: Any = req.prompt
        if req.images:
            parts = [{"type": "image_url", "image_url": {"url": url}} for url in req.images]
            content = [*parts, {"type": "text", "text": req.prompt}]
        body["messages"] = [{"role": "user", "content": content}]
        body["max_completion_tokens"] = body.pop("max_tokens")
    else:
        body["prompt"] = req.prompt
    return body


def _is_token_chunk(choices: list[dict]) -> bool:
    """A chunk carrying generated tokens (text may be empty); not the chat role announcement."""
    delta = choices[0].get("delta")
    return not (isinstance(delta, dict) and "role" in delta and not delta.get("content"))


async def send_request(
    client: Any, cfg: BenchServeConfig, model: str, req: BenchRequest, t0: float
) -> RequestRecord:
    """Send one streaming request and time its chunks; errors are recorded, never raised."""
    rec = RequestRecord(start=time.perf_counter() - t0, prompt_tokens=req.prompt_len or 0)
    start = last = time.perf_counter()
    chunks = 0
    try:
        body = _body(cfg, model, req)
        async with client.stream("POST", cfg.base_url + cfg.endpoint, json=body, headers=cfg.headers) as r:
            if r.status_code != 200:
                rec.error = _http_error(r.status_code, await r.aread())
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now, obj = time.perf_counter(), json.loads(data)
                    if err := obj.get("error"):
                        rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
                        break
                    if (choices := obj.get("choices")) and _is_token_chunk(choices):
                        if chunks == 0:
                            rec.ttft = now - start
                        else:
                            rec.itl.append(now - last)
                        chunks, last = chunks + 1, now
                    if usage := obj.get("usage"):
                        rec.output_tokens = int(usage.get("completion_tokens") or 0)
                        rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
        if not rec.error and chunks == 0:
            rec.error = "no tokens received"
    except Exception as e:  # any transport or parse failure fails this request only
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    rec.latency = time.perf_counter() - start
    rec.output_tokens = rec.output_tokens or chunks
    return rec


def _http_error(status: int, raw: bytes) -> str:
    text = raw.decode(errors="replace")
    try:
        text = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    return f"HTTP {status}: {str(text).strip()[:200]}"


async def _scrape(client: Any, cfg: BenchServeConfig) -> dict[str, float] | None:
    try:
        r = await client.get(cfg.base_url + "/metrics", headers=cfg.headers, timeout=10.0)
        found = (
            parse_counters(r.text, (*PREFIX_COUNTERS, BUSY_COUNTER, *IMAGE_COUNTERS))
            if r.status_code == 200
            else {}
        )
    except Exception:  # /metrics is optional
        return None
    return found if all(name in found for name in PREFIX_COUNTERS) else None


async def _settled_scrape(client: Any, cfg: BenchServeConfig) -> dict[str, float] | None:
    """Scrape until the counters stay unchanged for `metrics_settle` s (servers refresh periodically)."""
    last, since = await _scrape(client, cfg), time.monotonic()
    deadline = since + 5 * cfg.metrics_settle
    while time.monotonic() - since < cfg.metrics_settle and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        now = await _scrape(client, cfg)
        if now != last:
            last, since = now, time.monotonic()
    return last


async def _arrivals(n: int, rate: float, seed: int):
    """Yield 0..n-1 at Poisson arrival times (exponential gaps); all at once when rate is infinite."""
    rng = random.Random(seed + 1)
    for i in range(n):
        if i and math.isfinite(rate) and rate > 0:
            await asyncio.sleep(rng.expovariate(rate))
        yield i


async def _resolve_model(client: Any, cfg: BenchServeConfig) -> str:
    import httpx

    try:
        r = await client.get(cfg.base_url + "/v1/models", headers=cfg.headers, timeout=10.0)
    except httpx.HTTPError as e:
        raise BenchServeError(f"server at {cfg.base_url} is unreachable ({type(e).__name__})") from None
    if r.status_code != 200:
        raise BenchServeError(f"GET {cfg.base_url}/v1/models answered HTTP {r.status_code}")
    if cfg.model:
        return cfg.model
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchServeError(f"GET {cfg.base_url}/v1/models lists no model; pass --model") from None


async def run_benchmark(cfg: BenchServeConfig) -> dict[str, Any]:
    """Run the whole benchmark and return the result (summary metrics plus per-request arrays).

    Raises `BenchServeError` before any load is sent when the server is unreachable.
    """
    import httpx

    requests = make_requests(cfg)
    # idle connections expire before the server's keep-alive timeout (5 s): no reuse of a closing one
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout), limits=limits) as client:
        model = await _resolve_model(client, cfg)
        # settled: counters of earlier load may still be on their way to /metrics (refreshed every second)
        before = await _settled_scrape(client, cfg)
        gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        t0 = time.perf_counter()

        async def one(i: int) -> RequestRecord:
            if gate is None:
                return await send_request(client, cfg, model, requests[i], t0)
            async with gate:
                return await send_request(client, cfg, model, requests[i], t0)

        tasks = [
            asyncio.create_task(one(i)) async for i in _arrivals(len(requests), cfg.request_rate, cfg.seed)
        ]
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        after = await _settled_scrape(client, cfg) if before is not None else None
    result: dict[str, Any] = {
        "backend": cfg.backend,
        "model": model,
        "base_url": cfg.base_url,
        "dataset": cfg.dataset,
        "num_prompts": len(requests),
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        "max_concurrency": cfg.max_concurrency,
    }
    result |= compute_metrics(records, duration, cfg.percentiles, dict(cfg.goodput))
    queries = hits = rate = None
    if before is not None and after is not None:
        queries = after[PREFIX_COUNTERS[0]] - before[PREFIX_COUNTERS[0]]
        hits = after[PREFIX_COUNTERS[1]] - before[PREFIX_COUNTERS[1]]
        rate = hits / queries if queries > 0 else None
    result |= {"prefix_cache_queries": queries, "prefix_cache_hits": hits, "prefix_hit_rate": rate}
    busy = None
    if before is not None and after is not None and BUSY_COUNTER in before and BUSY_COUNTER in after:
        busy = (after[BUSY_COUNTER] - before[BUSY_COUNTER]) / duration if duration > 0 else None
    result["worker_busy_share"] = busy  # share of the run's wall time the worker spent in steps
    result["num_images"] = sum(len(r.images) for r in requests)
    for name in IMAGE_COUNTERS:  # how images were reused (Ember's counters, when scraped)
        have = before is not None and after is not None and name in before and name in after
        result[name.removeprefix("ember_")] = after[name] - before[name] if have else None  # type: ignore[index]
    result |= {
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "start_times": [r.start for r in records],
        "ttfts": [r.ttft if r.success else 0.0 for r in records],
        "itls": [r.itl if r.success else [] for r in records],
        "e2els": [r.latency if r.success else 0.0 for r in records],
        "errors": [r.error for r in records],
    }
    return result


def main(args: argparse.Namespace) -> int:
    """Run `ember bench serve`: 0 if any request succeeded, 1 if none did, 2 if it could not start."""
    try:
        cfg = BenchServeConfig.from_args(args)
        if cfg.plot:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise BenchServeError("--plot needs matplotlib (pip install matplotlib)") from None
        result = asyncio.run(run_benchmark(cfg))
    except BenchServeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(result, cfg.percentiles))
    if cfg.result_json:
        with open(cfg.result_json, "w") as f:
            json.dump(result | {"percentiles": list(cfg.percentiles)}, f)
    if cfg.plot:
        write_plot(result, cfg.plot)
    sys.stdout.flush()
    if result["completed"] == 0:
        first = " ".join(next((e for e in result["errors"] if e), "unknown error").split())
        print(f"error: all {result['failed']} requests failed; first: {first}", file=sys.stderr)
        return 1
    return 0
