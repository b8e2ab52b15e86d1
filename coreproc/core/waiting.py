"""The scheduler's waiting queue, its admission limits, and the checks every new request passes.

Runs in the scheduler process. Requests that are not running wait here, ordered by policy: FCFS by
arrival, priority by (priority, arrival time, arrival). A preempted request keeps its arrival order,
so in FCFS it is served before every request that never ran. New work beyond
`max_num_queued_requests` / `max_num_queued_tokens` raises `QueueFull`; an empty queue always takes
one request, and the sequences of one API request (`SubmitRequests`) are admitted or refused
together.
"""

from __future__ import annotations

import bisect

from coreproc.base.errors import InvalidParam, QueueFull
from coreproc.base.limits import RequestLimits
from coreproc.base.logits_processors import LogitsProcessor, validate_request
from coreproc.base.protocol import EngineRequest
from coreproc.core.request import Request


def validate(
    er: EngineRequest,
    max_model_len: int,
    vocab_size: int,
    limits: RequestLimits,
    processors: list[LogitsProcessor],
    image_token_id: int | None = None,
) -> None:
    """Raise InvalidParam (naming the field) for a request that can never run here."""
    n = len(er.prompt_token_ids)
    if n == 0:
        raise InvalidParam("the prompt is empty", "prompt")
    if n > max_model_len:
        raise InvalidParam(
            f"the prompt has {n} tokens but the model's maximum length is {max_model_len}", "prompt"
        )
    if any(t < 0 or t >= vocab_size for t in er.prompt_token_ids):
        raise InvalidParam(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    params = er.sampling_params
    if params.n != 1:
        raise InvalidParam(
            "the engine runs one sequence per request: submit n > 1 as n requests with n = 1 "
            "(the SDK's generate_many, or the OpenAI API's n)",
            "n",
        )
    params.validate()
    limits.check_sampling(params)
    validate_request(processors, params)
    if er.mm_refs or image_token_id is not None:
        validate_images(er, image_token_id)


PIXEL_DTYPES = {"float32": 4, "float16": 2}


def validate_images(er: EngineRequest, image_token_id: int | None) -> None:
    """Each image's span lies in the prompt, holds only its placeholder token, overlaps no other, and
    its pixels (when sent) are a [channels, height, width] array of a known dtype; no placeholder
    stands outside a span."""
    if image_token_id is None:
        raise InvalidParam("this engine's model takes no multimodal input", "messages")
    ids = er.prompt_token_ids
    covered = 0
    end = 0
    for k, ref in enumerate(sorted(er.mm_refs, key=lambda r: r.offset)):
        if ref.length < 1 or ref.offset < end or ref.offset + ref.length > len(ids):
            raise InvalidParam(
                f"image {k}'s placeholder span is outside the prompt or overlaps another", "messages"
            )
        if any(t != image_token_id for t in ids[ref.offset : ref.offset + ref.length]):
            raise InvalidParam(f"image {k}'s span holds tokens other than its placeholder", "messages")
        end = ref.offset + ref.length
        covered += ref.length
        data = ref.data
        if data is not None and (
            data.dtype not in PIXEL_DTYPES
            or len(data.shape) != 3
            or min(data.shape) < 1
            or len(data.data) != data.shape[0] * data.shape[1] * data.shape[2] * PIXEL_DTYPES[data.dtype]
        ):
            raise InvalidParam(f"image {k}'s pixel data does not match its shape and dtype", "messages")
    if sum(1 for t in ids if t == image_token_id) != covered:
        raise InvalidParam("the prompt holds image placeholder tokens that no image fills", "prompt")


class WaitingQueue:
    """Requests not running, ordered by policy key; preempted requests keep their place at the front."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._items: list[tuple[tuple, Request]] = []
        self.num_tokens = 0  # of the queued requests (their tokens do not change while they wait)

    def _key(self, req: Request) -> tuple:
        if self.policy == "priority":
            return (req.priority, req.arrival_time, req.arrival_seq)
        return (req.arrival_seq,)

    def add(self, req: Request) -> None:
        bisect.insort(self._items, (self._key(req), req), key=lambda item: item[0])
        self.num_tokens += req.num_tokens

    def peek(self) -> Request:
        return self._items[0][1]

    def pop(self) -> Request:
        req = self._items.pop(0)[1]
        self.num_tokens -= req.num_tokens
        return req

    def remove(self, req: Request) -> None:
        self._items.remove((self._key(req), req))
        self.num_tokens -= req.num_tokens

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return (req for _, req in self._items)

    def admit(self, ers: list[EngineRequest], max_requests: int | None, max_tokens: int | None) -> None:
        """Raise QueueFull if the sequences of one request may not join the queue now (they are
        admitted together or not at all), InvalidParam if they never could."""
        size = len(ers)
        if max_requests is not None and size > max_requests:
            raise InvalidParam(
                f"the request has {size} sequences but this engine queues at most {max_requests} "
                "(--max-num-queued-requests), so it can never be admitted",
                "n",
            )
        if not self._items:  # an empty queue always takes one request, however long its prompts
            return
        if max_requests is not None and len(self) + size > max_requests:
            raise QueueFull(f"the engine's queue is full ({len(self)} requests waiting); retry later")
        tokens = sum(len(er.prompt_token_ids) for er in ers)
        if max_tokens is not None and self.num_tokens + tokens > max_tokens:
            raise QueueFull(
                f"the engine's queue is full ({self.num_tokens} prompt tokens waiting, "
                f"limit {max_tokens}); retry later"
            )
