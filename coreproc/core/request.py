"""The scheduler's view of one request: its tokens, progress, status and why it finished.

Runs in the scheduler process (coreproc). Built from an `EngineRequest`; the scheduler advances
`num_computed_tokens` when it schedules work and appends sampled tokens from `RunnerOutput`, asking the
request whether each one ends it.
"""

from __future__ import annotations

import enum

from coreproc.base.protocol import EngineRequest, FinishReason, LoRARef, MultiModalRef, SamplingParams
from coreproc.core.ngram import ProposalLength


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Mutable per-request state owned by the scheduler."""

    def __init__(
        self,
        req: EngineRequest,
        arrival_seq: int,
        mm_refs: list[MultiModalRef] | None = None,
        lora: LoRARef | None = None,
    ) -> None:
        self.request_id = req.request_id
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.sampling_params: SamplingParams = req.sampling_params
        self.eos_token_ids = list(req.eos_token_ids)
        self.arrival_time = req.arrival_time
        self.arrival_seq = arrival_seq
        self.priority = req.priority
        self.cache_salt = req.cache_salt
        self.lora = req.lora if lora is None else lora  # the registry's (with its path)
        self.mm_refs = (
            req.mm_refs if mm_refs is None else mm_refs
        )  # with pixels (the core's store resolves them)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(req.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = -1  # prefix-cache hit on first admission; -1 until admitted
        self.block_hashes: list[bytes] = []
        self.num_prompt_logprobs_sent = 0
        self.in_workers = False  # workers hold its state (sent as NewRequestData, not yet forgotten)
        self.num_preemptions = 0
        # tokens being sampled by a step still in flight (overlapped scheduling); their ids are unknown
        self.num_output_placeholders = 0
        self.spec_token_ids: list[int] = []  # proposed continuation to verify in the next step
        self.proposal_length: ProposalLength | None = None  # speculative decoding: its adaptive k

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    def append_output_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.all_token_ids.append(token)

    def stop_status(self, token: int, max_model_len: int) -> RequestStatus | None:
        """Whether `token`, just appended, ends the request: EOS or a stop token (after `min_tokens`),
        or its length; a stop token is kept as `stop_reason`."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def unsent_prompt_logprobs(self, entries: list, start: int) -> list:
        """Of the prompt logprobs a step computed from position `start`, those not sent before (a
        preempted request computes them again)."""
        first = start + 1 if start > 0 else 0
        skip = max(0, self.num_prompt_logprobs_sent - first)
        self.num_prompt_logprobs_sent = max(self.num_prompt_logprobs_sent, first + len(entries))
        return entries[skip:]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
