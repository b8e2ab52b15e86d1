"""Every message that crosses a process boundary in Ember, as msgspec Structs, and its vocabulary.

Shared by the frontend, the scheduler process (coreproc) and the workers. In-process engines pass these
objects directly; multiprocess engines encode them with msgspec (msgpack), never pickle. Per-step
messages are `array_like`, `omit_defaults` and `gc=False` so encoding stays cheap on the hot path.
Directions: frontend -> core (`SubmitRequests`, `AbortRequests`, `UtilityCall`), core -> frontend
(`OutputBatch`, `UtilityResult` with an `EngineInfo` or `SchedulerStats`, `EngineDead`), core -> workers
(`SchedulerOutput`, `Shutdown`), workers -> core (`WorkerReady`, `RunnerOutput`, `WorkerFailed`). On a
socket every message is two frames: a one-byte kind (`KIND_OF`) and the msgpack body; each socket
decodes only its direction. Codes (finish reasons, refusals, utility methods) are `Literal`s below.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, get_args

import msgspec

from coreproc.base.errors import InvalidParam as InvalidParam  # kept here too: the SDK's import path
from coreproc.base.errors import QueueFull as QueueFull
from coreproc.base.kv_layout import KVLayout

# ----------------------------------------------------------------------------- codes

# why a sequence ended: a stop condition (EOS, stop token or string), max_tokens / max_model_len,
# aborted (its client left or fell silent, shutdown's grace period ended), or failed (refused,
# unschedulable, engine dead)
FinishReason = Literal["stop", "length", "abort", "error"]
FINISH_REASONS: tuple[FinishReason, ...] = get_args(FinishReason)
# why the core refused a submission (`EngineOutput.error_code`): HTTP 400, 503 (queue full), 503
# "mm_cache_miss": a multimodal item sent by hash only that the core no longer holds (retry with its data)
RefusalCode = Literal["invalid_request", "overloaded", "unavailable", "mm_cache_miss"]
# `EngineRequestError.code`: a refusal, or the SDK aborted a reader that fell too far behind
ErrorCode = Literal[RefusalCode, "slow_consumer"]
# what the core's utility dispatcher answers; "ping" with call id 0 is the SDK's heartbeat (no reply);
# "load_lora" takes args {"lora_name", "lora_path"}, "unload_lora" {"lora_name"}
UtilityMethod = Literal["info", "stats", "reset_prefix_cache", "ping", "load_lora", "unload_lora"]
UTILITY_METHODS: tuple[UtilityMethod, ...] = get_args(UtilityMethod)
CacheRequestKind = Literal["state", "ping"]  # give me the weights / are you ready?
CacheStatus = Literal["ok", "mismatch", "error", "ready"]  # "ready" answers a "ping"


# what a structured-output constraint is written in (see workers/structured.py)
StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
STRUCTURED_KINDS: tuple[StructuredKind, ...] = get_args(StructuredKind)


class StructuredSpec(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """A constraint on a request's output, compiled and enforced by the workers (xgrammar).

    `spec` is the JSON schema text ("json"), a regex, a JSON list of strings ("choice"), an EBNF
    (GBNF) grammar, or an xgrammar structural tag as JSON; empty for "json_object". The constraint
    covers the output after the first occurrence of `after` (the reasoning's end marker), or all of
    it when `after` is empty."""

    kind: StructuredKind
    spec: str = ""
    after: list[int] = []

    def validate(self) -> None:
        """What the scheduler checks without xgrammar; the workers' compiler is the final judge."""
        if self.kind in ("json", "choice", "structural_tag"):
            try:
                value = msgspec.json.decode(self.spec)
            except msgspec.DecodeError:
                raise InvalidParam(
                    f"the {self.kind} constraint is not valid JSON", "structured_outputs"
                ) from None
            if self.kind == "choice" and not (
                isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)
            ):
                raise InvalidParam(
                    "choice must be a non-empty list of non-empty strings", "structured_outputs"
                )
            if self.kind != "choice" and not isinstance(value, (dict, bool)):
                raise InvalidParam(f"the {self.kind} constraint must be a JSON object", "structured_outputs")
        elif self.kind in ("regex", "grammar") and not self.spec.strip():
            raise InvalidParam(f"the {self.kind} constraint is empty", "structured_outputs")


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to sample one request. Defaults follow vLLM: temperature 1.0, max_tokens 16."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # logits processors (see coreproc/base/logits_processors.py): built-ins read these typed fields,
    # third-party processors their entry of `logits_processor_args` (keyed by processor name)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = []  # text; the frontend fills bad_words_token_ids with its tokenizer
    bad_words_token_ids: list[list[int]] = []
    logits_processor_args: dict[str, Any] = {}
    structured: StructuredSpec | None = None  # constrained decoding (JSON schema, regex, grammar, ...)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self, max_logprobs: int = 20) -> None:
        """Raise InvalidParam naming the first bad field."""
        checks = [
            (self.n >= 1, "n", "n must be at least 1"),
            (self.temperature >= 0.0, "temperature", "temperature must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 0, "top_k", "top_k must be -1 (disabled) or >= 0"),
            (0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                "frequency_penalty",
                "frequency_penalty must be in [-2, 2]",
            ),
            (self.repetition_penalty > 0.0, "repetition_penalty", "repetition_penalty must be positive"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "max_tokens must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be non-negative"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                "min_tokens must not exceed max_tokens",
            ),
            (all(s for s in self.stop), "stop", "stop strings must be non-empty"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "stop_token_ids must be >= 0"),
            (
                self.logprobs is None or 0 <= self.logprobs <= max_logprobs,
                "logprobs",
                f"logprobs must be in [0, {max_logprobs}]",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= max_logprobs,
                "prompt_logprobs",
                f"prompt_logprobs must be in [0, {max_logprobs}]",
            ),
            (self.seed is None or 0 <= self.seed < 2**63, "seed", "seed must be in [0, 2**63)"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidParam(message, param)
        if self.structured is not None:
            self.structured.validate()


# ----------------------------------------------------------------------------- frontend -> core


class LoRARef(msgspec.Struct, array_like=True, frozen=True):
    """A LoRA adapter a request runs with: its name and its identity (the digest of its weights). The
    core fills `path` (where the workers read it) from its own registry: a client's is never used."""

    name: str
    identity: str
    path: str = ""


class PixelData(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """An image's processed pixel values as raw bytes: no pickle, one msgpack `bin` on the wire."""

    dtype: str  # a numpy dtype name: "float32" or "float16"
    shape: list[int]  # [channels, height, width]
    data: bytes  # C order

    @property
    def nbytes(self) -> int:
        return len(self.data)


class MultiModalRef(msgspec.Struct, array_like=True, frozen=True):
    """One multimodal item in a prompt: its content hash, the token span its placeholders occupy, and
    its pixels. `data` None means "the core holds it under this hash" (sent before); a request that
    carries data always replaces what the core held under the hash."""

    content_hash: str
    offset: int
    length: int
    data: PixelData | None = None


class EngineRequest(msgspec.Struct, omit_defaults=True, kw_only=True, gc=False):
    """One request as the core sees it: token ids already rendered by the frontend."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    lora: LoRARef | None = None
    mm_refs: list[MultiModalRef] = []


def make_request(
    prompt_token_ids: list[int],
    params: SamplingParams | None = None,
    *,
    request_id: str | None = None,
    priority: int = 0,
    cache_salt: str | None = None,
    eos_token_ids: list[int] | None = None,
    mm_refs: list[MultiModalRef] | None = None,
    lora: str | None = None,
) -> EngineRequest:
    """One sequence's `EngineRequest`: a fresh id unless given, arrival now (what the clients submit;
    see coreproc.client.async_client `AsyncEngineClient.generate` for the arguments)."""
    return EngineRequest(
        request_id=request_id or uuid.uuid4().hex,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=params or SamplingParams(),
        eos_token_ids=eos_token_ids or [],
        arrival_time=time.time(),
        priority=priority,
        cache_salt=cache_salt,
        lora=None if lora is None else LoRARef(lora, ""),
        mm_refs=mm_refs or [],
    )


class SubmitRequests(msgspec.Struct, array_like=True, gc=False):
    """The sequences of one API request (its prompts x n): admitted together or refused together, so
    a request is never half-admitted. The SDK's single requests travel as a unit of one."""

    requests: list[EngineRequest]


# ----------------------------------------------------------------------------- core -> workers


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request scheduled for the first time (or again after preemption): sent in full once."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # its block table per KV group (coreproc/base/kv_layout.py)
    num_computed_tokens: int
    output_token_ids: list[int] = []
    eos_token_ids: list[int] = []
    mm_items: list[MultiModalRef] = []  # images, their pixels always included (resolved by the core)
    lora: LoRARef | None = None  # its adapter, `path` filled by the core


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the workers already hold: only the blocks added this step (and, with pipeline stages,
    the tokens sampled since it last ran, which only the last stage saw)."""

    req_id: str
    new_block_ids: list[list[int]]  # per KV group
    num_computed_tokens: int
    new_token_ids: list[int] = []


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step: which requests run and how many tokens each computes.

    `finished_req_ids` lists requests the workers must forget before running this step (finished,
    aborted or preempted since the previous step).
    """

    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[str] = []
    # proposed tokens to verify, per request; they are the last len(...) of its scheduled tokens
    spec_token_ids: dict[str, list[int]] = {}
    # draft model: tokens to propose after this step where fewer than num_speculative_tokens (0: none)
    draft_lengths: dict[str, int] = {}


# ----------------------------------------------------------------------------- workers -> core


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs at one position: the chosen token first, then the top-N alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # rank of the chosen token in the full distribution (1 = most likely)


class RunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced, per scheduled request (same order as `req_ids`).

    `sampled_token_ids[i]` is empty for a partial prefill chunk. `logprobs[i]` holds one entry per
    sampled token (the chosen token's raw logprob always, plus the top-N when requested).
    """

    req_ids: list[str] = []
    sampled_token_ids: list[list[int]] = []
    logprobs: list[list[TokenLogprobs]] = []
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
    spec_token_ids: dict[str, list[int]] = {}  # draft-model proposals for the next step
    failed: dict[str, str] = {}  # requests this step could not serve (a grammar xgrammar refused): why
    execute_seconds: float = 0.0  # the worker's time on this step (inputs, forward, sampling)
    structured_seconds: float = 0.0  # of which: grammar matchers and the token mask
    forward_seconds: float = 0.0  # of which: the target's forward and logits (verification included)
    sample_seconds: float = 0.0  # of which: sampling and keeping the accepted proposals
    draft_seconds: float = 0.0  # of which: the draft model's forwards (catch-up and proposals)
    draft_forwards: list[tuple[int, float]] = []  # the draft's forwards: (tokens, seconds) each
    encoder_hits: int = 0  # images whose vision-encoder output this step took from the encoder cache
    encoder_misses: int = 0  # ... and those it encoded
    expert_load: dict[int, list[int]] = {}  # MoE layers (by index): tokens per expert this step


class WorkerReady(msgspec.Struct, kw_only=True):
    """Sent once by each worker after loading: values learned at run time travel here."""

    rank: int
    num_kv_blocks: int
    kv_bytes_per_block: int
    weight_bytes: int
    load_seconds: float
    device: str
    weight_bytes_by_dtype: dict[str, int] = {}
    quantize_seconds: float = 0.0
    weight_source: str = "disk"  # or "ipc_cache"
    cache_fallback_reason: str = ""  # why the cache was not used, when it was asked for
    kv_layout: KVLayout | None = None  # the model's KV groups (None: one group of every layer)
    expert_bytes: int = 0  # the routed experts' share of weight_bytes (a step reads only the chosen ones)
    expert_share: float = 0.0  # experts chosen per token / experts (top-k / E; 0: no mixture of experts)


# ----------------------------------------------------------------------------- core -> frontend


class EngineOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New tokens for one request since the previous output, and why it finished (if it did)."""

    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[TokenLogprobs] = []
    new_prompt_logprobs: list[TokenLogprobs | None] = []
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    error_code: RefusalCode | None = None  # set when refused; None for a failure while running
    error_param: str | None = None  # the request field an "invalid_request" is about

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class AbortRequests(msgspec.Struct, array_like=True, gc=False):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, array_like=True, omit_defaults=True):
    """A typed RPC to the core (`UtilityMethod`); call id 0 asks for no reply."""

    call_id: int
    method: UtilityMethod
    args: dict[str, Any] = {}


class OutputBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    outputs: list[EngineOutput]
    timestamp: float = 0.0


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineDead(msgspec.Struct, array_like=True):
    """The core cannot go on (a worker died, a fatal error); every open request has failed."""

    reason: str


class EngineInfo(msgspec.Struct, kw_only=True):
    """What a client learns from the "info" call."""

    model: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    tensor_parallel_size: int
    version: str
    eos_token_ids: list[int] = []
    quantization: str | None = None
    weight_bytes_by_dtype: dict[str, int] = {}  # rank 0's weights
    load_seconds: float = 0.0
    quantize_seconds: float = 0.0
    weight_source: str = "disk"
    limits: dict[str, int] = {}  # the core's `RequestLimits`, resolved (see coreproc/base/limits.py)
    image_token_id: int | None = None  # the model takes images: their placeholder token
    mm_cache_bytes: int = 0  # what the core keeps of sent images (clients mirror it to send hashes)
    lora_enabled: bool = False  # the engine serves LoRA adapters (--enable-lora)
    loras: dict[str, str] = {}  # the adapters loaded when this answer was made: name -> folder
    pipeline_parallel_size: int = 1
    data_parallel_rank: int = 0  # this core's place among data-parallel engines
    data_parallel_size: int = 1
    dp_routing: str = "least-loaded"  # how clients should route among them (--dp-routing)
    max_num_seqs: int = 0  # requests one step may run


class SchedulerStats(msgspec.Struct, kw_only=True):
    """The "stats" call's answer (and `LLM.stats()`); defaults are an idle engine. Counters count since
    the engine started; the `spec_*` fields stay at zero without speculative decoding."""

    num_running: int = 0  # requests in the running batch
    num_waiting: int = 0  # requests queued (new or preempted)
    num_queued_tokens: int = 0  # prompt tokens of the waiting requests
    kv_usage: float = 0.0  # share of KV blocks in use, 0 to 1
    num_kv_blocks: int = 0  # blocks in the KV cache (from the workers)
    num_blocks_in_use: int = 0  # held by running requests
    num_steps: int = 0  # engine steps run
    worker_busy_seconds: float = 0.0  # the workers' time in steps (summed `RunnerOutput.execute_seconds`)
    structured_seconds: float = 0.0  # of which: structured outputs' matchers and masks
    forward_seconds: float = 0.0  # of which: target forwards and logits (speculative verification included)
    sample_seconds: float = 0.0  # of which: sampling
    draft_seconds: float = 0.0  # of which: draft-model forwards
    schedule_seconds: float = 0.0  # the scheduler's own time: building steps and taking in their results
    num_preemptions: int = 0  # running requests preempted because blocks ran out
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # ... and found there
    prefix_cache_hit_rate: float = 0.0  # hits / queries
    mm_cache_hits: int = 0  # images sent by hash that the core still held
    mm_cache_misses: int = 0  # ... that it no longer held (their requests were sent again with pixels)
    encoder_cache_hits: int = 0  # images whose vision-encoder output a worker reused
    encoder_cache_misses: int = 0  # images a worker encoded
    spec_num_drafts: int = 0  # verification steps that carried proposals
    spec_num_proposed: int = 0  # proposed tokens
    spec_num_accepted: int = 0  # proposed tokens kept
    spec_acceptance_rate: float = 0.0  # accepted / proposed
    spec_mean_accepted_length: float = 0.0  # tokens per verification step (1 + accepted proposals)
    spec_accepted_per_position: list[int] = []  # accepted tokens by position in the proposal
    spec_proposed_per_position: list[int] = []  # proposed tokens by position in the proposal
    num_requests: int = 0  # requests the scheduler holds (running, waiting, or in flight)
    num_client_requests: int = 0  # requests the core process still maps to a client
    has_work: bool = False  # requests queued, running or in flight
    max_steps_in_flight: int = 0  # most steps submitted at once (pipeline stages: up to the stage count)
    seconds_since_step: float = 0.0  # since the last step finished
    stalled: str | None = None  # the watchdog's verdict (`--stall-timeout`): why the engine is stuck
    expert_load: dict[int, list[int]] = {}  # MoE layers (by index): tokens per expert over the last steps
    expert_imbalance: float = 0.0  # their max / mean tokens per expert, averaged over layers (0: no MoE)
    expert_layer_imbalance: dict[int, float] = {}  # ... per layer


class CoreReady(msgspec.Struct, kw_only=True):
    """Sent once by a core process to its launcher: where clients connect, or why it failed."""

    address: str = ""
    error: str | None = None
    user_error: bool = False  # the error is one a user can fix (an EmberError): one line, exit 2


class StepRequest(msgspec.Struct, array_like=True, gc=False):
    """One step for the workers, numbered so replies can be matched."""

    step_id: int
    scheduler_output: SchedulerOutput


class StepResult(msgspec.Struct, array_like=True, gc=False):
    step_id: int
    rank: int
    output: RunnerOutput


class WorkerHello(msgspec.Struct, kw_only=True):
    """Sent once by each rank of another node (`ember worker --headless`) as soon as it connects, before
    it loads: the core learns which connection is which rank, and checks the node's engine flags."""

    rank: int
    node_rank: int
    config: bytes  # the node's EngineConfig as JSON (compared with the head's, paths aside)


class WorkerFailed(msgspec.Struct, array_like=True):
    rank: int
    error: str
    user_error: bool = False  # an EmberError (e.g. the checkpoint does not fit the model)


class Shutdown(msgspec.Struct, array_like=True):
    reason: str = ""


# ----------------------------------------------------------------------------- weight cache (preload)


class Fingerprint(msgspec.Struct, kw_only=True, frozen=True):
    """Everything that decides the processed weights of one rank; any difference means "load from disk"."""

    checkpoint: str  # sha256 of the shard names and safetensors headers (no weight reads)
    architecture: str
    model_config: str  # sha256 of config.json's canonical JSON
    tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int
    dtype: str
    quantization: str
    quant_config: str  # the quantization method's config hash
    revision: str
    engine_version: str
    device: str  # CUDA: the GPU UUID; CPU: the host's machine id and boot id
    role: str = "target"  # or "draft"
    nnodes: int = 1  # the global placement: nodes the engine spans, and the node holding this rank
    node_rank: int = 0


class CacheRequest(msgspec.Struct, kw_only=True):
    """Engine -> daemon over its Unix socket: "state" (give me the weights) or "ping" (are you ready?)."""

    kind: CacheRequestKind
    fingerprint: Fingerprint | None = None


class CacheTensor(msgspec.Struct, array_like=True, frozen=True):
    """One tensor inside the shared arena (CPU) or one CUDA IPC handle (GPU)."""

    name: str
    kind: str  # "param" | "buffer"
    shape: list[int]
    stride: list[int]
    dtype: str
    offset: int = 0  # bytes into the arena (CPU)
    nbytes: int = 0  # bytes the tensor's strided span covers
    ipc: list[Any] = []  # CUDA: the storage's IPC handle fields


class CacheReply(msgspec.Struct, kw_only=True):
    """Daemon -> engine. "ok" comes with the arena's file descriptor (SCM_RIGHTS) on CPU."""

    status: CacheStatus
    message: str = ""
    fields: list[str] = []  # fingerprint fields that differ (status "mismatch")
    fingerprint: Fingerprint | None = None  # what the daemon holds
    tensors: list[CacheTensor] = []
    aliases: dict[str, str] = {}  # tied names -> the name whose tensor they share
    module_attrs: dict[str, dict[str, Any]] = {}  # per-module quantization attributes
    arena_bytes: int = 0


class DaemonReady(msgspec.Struct, kw_only=True):
    """Sent once by each preload daemon to its launcher: listening (with its socket), or why it failed."""

    role: str
    dp_rank: int
    tp_rank: int
    socket: str = ""
    weight_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


class SpawnWorker(msgspec.Struct, kw_only=True, tag=True):
    """Launcher -> zygote: fork an engine process, `role` "worker" (from the core) or "core" (from the
    frontend), with these arguments; stdout/stderr ride as SCM_RIGHTS."""

    argv: list[str]
    config: bytes  # the EngineConfig as JSON
    env: dict[str, str] = {}
    role: str = "worker"
    code: str = ""  # zygote_link.code_stamp() of the requester: the zygote refuses other code
    affinity: list[int] = []  # the requester's CPUs (taskset): the child runs on them


class SpawnServe(msgspec.Struct, kw_only=True, tag=True):
    """`ember serve` -> zygote: fork the server with the launcher's command line, whole environment and
    working directory; stdin/stdout/stderr ride as SCM_RIGHTS. `executable`, `package` (where the
    launcher's Ember is installed) and `code` (zygote_link.code_stamp) must be the zygote's own, or it
    refuses."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    executable: str
    package: str
    code: str
    affinity: list[int] = []  # the launcher's CPUs (taskset): the server runs on them


class SpawnReply(msgspec.Struct, kw_only=True):
    pid: int = 0
    error: str | None = None


class ServeExit(msgspec.Struct, kw_only=True):
    """A zygote-forked server -> its launcher, on the spawn connection: the exit status to take."""

    code: int


class ZygoteQuery(msgspec.Struct, kw_only=True, tag=True):
    """A tool or test -> zygote: what it holds ready (answered with `ZygoteState`)."""


class ZygoteState(msgspec.Struct, kw_only=True):
    prepared_pid: int = 0  # the worker prepared for the next restart (0: none)
    prepared_ready: bool = False  # its weights mapped and faulted in, its kernels picked


class PreparedReady(msgspec.Struct, kw_only=True):
    """A prepared worker -> its zygote: ready to be taken (`error`: why it could not prepare; it exits)."""

    error: str = ""


class PreparedTake(msgspec.Struct, kw_only=True):
    """Zygote -> its prepared worker: become the worker of this `SpawnWorker` request (its argv and
    environment); stdout, stderr and the request's connection ride as SCM_RIGHTS. Answered with a
    `SpawnReply` (the worker's pid, or why it cannot: it then exits)."""

    argv: list[str]
    env: dict[str, str]


ZygoteRequest = SpawnWorker | SpawnServe | ZygoteQuery


# ----------------------------------------------------------------------------- framing

# one-byte kind frame -> message type; the high nibble says the direction
KIND_OF: dict[type, bytes] = {
    SubmitRequests: b"\x01",
    AbortRequests: b"\x02",
    UtilityCall: b"\x03",
    OutputBatch: b"\x11",
    UtilityResult: b"\x12",
    EngineDead: b"\x13",
    StepRequest: b"\x21",
    Shutdown: b"\x22",
    WorkerReady: b"\x31",
    StepResult: b"\x32",
    WorkerFailed: b"\x33",
    WorkerHello: b"\x34",
    CoreReady: b"\x41",
    DaemonReady: b"\x42",
    CacheRequest: b"\x51",
    CacheReply: b"\x52",
    SpawnWorker: b"\x53",
    SpawnReply: b"\x54",
    SpawnServe: b"\x55",
    ServeExit: b"\x56",
}
TYPE_OF: dict[bytes, type] = {kind: t for t, kind in KIND_OF.items()}

TO_CORE = (SubmitRequests, AbortRequests, UtilityCall)
TO_CLIENT = (OutputBatch, UtilityResult, EngineDead)
TO_WORKER = (StepRequest, Shutdown)
FROM_WORKER = (WorkerReady, StepResult, WorkerFailed, WorkerHello)
