"""The offline Python API: `LLM(model).generate(prompts, SamplingParams(...))`.

Runs everything in the caller's process: tokenization and detokenization (frontend pieces), and an
`EngineCore` whose scheduler and model runner are the same ones the server uses. Prompts may be
strings, token-id lists, or dicts with "prompt" / "prompt_token_ids". With no model it uses the small
model bundled with Ember.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from coreproc.config import EngineConfig
from coreproc.engine import EngineCore
from coreproc.outputs import RequestOutput
from coreproc.protocol import InvalidParam, QueueFull, SamplingParams, SchedulerStats
from coreproc.startup import boot
from coreproc.text.output_processor import OutputProcessor, SequenceDelta
from coreproc.text.tokenizer import load_tokenizer

PromptInput = str | list[int] | dict


class LLM:
    """An engine in this process. Keyword arguments mirror vLLM's engine arguments."""

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        show_progress: bool = True,
        **engine_args: Any,
    ) -> None:
        """Build from vLLM-style engine arguments, or from a ready `EngineConfig` (`config=`).

        The garbage collector is paused while the engine is built (coreproc.startup.boot): full collections
        would walk torch's objects again and again. The heap is not frozen here, so a dropped engine
        is still collected.
        """
        with boot.paused():
            self.config = config if config is not None else EngineConfig.create(model, **engine_args)
            self.tokenizer = load_tokenizer(self.config.model.tokenizer)
            self.eos_token_ids = list(self.config.model.eos_token_ids)
            self.engine = EngineCore(self.config, show_progress=show_progress)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._backlog: collections.deque = collections.deque()  # held back by the engine's queue limit

    def close(self) -> None:
        """Stop worker processes (tensor parallelism) and free the engine."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def stats(self) -> SchedulerStats:
        return self.engine.stats()

    # ------------------------------------------------------------------ prompts

    def _normalize(self, prompts: PromptInput | Sequence[PromptInput]) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        out = []
        for p in prompts:
            if isinstance(p, dict):
                if "prompt_token_ids" in p:
                    out.append((p.get("prompt"), list(p["prompt_token_ids"])))
                    continue
                p = p["prompt"]
            if isinstance(p, str):
                out.append((p, self.tokenizer(p).input_ids))
            elif isinstance(p, list) and all(isinstance(t, int) for t in p):
                out.append((None, list(p)))
            else:
                raise InvalidParam(
                    f"a prompt must be a string or a list of token ids, got {type(p).__name__}", "prompt"
                )
        return out

    def _submit(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
    ) -> list[str]:
        items = self._normalize(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise InvalidParam("need one SamplingParams per prompt (or a single one)", "sampling_params")
        for params in params_list:
            params.validate()
        rids = []
        for i, ((text, ids), params) in enumerate(zip(items, params_list)):
            rid = str(next(self._ids))
            self._backlog.append((rid, text, ids, params, priority[i] if priority else 0))
            rids.append(rid)
        try:
            self._feed()
        except Exception:
            self._backlog.clear()
            for rid in rids:
                self.processor.withdraw(self.engine, rid)
            raise
        return rids

    def _feed(self) -> None:
        """Submit held-back prompts until the engine's queue limit (`max_num_queued_*`) is reached."""
        while self._backlog:
            rid, text, ids, params, prio = self._backlog[0]
            try:
                self.processor.submit(
                    self.engine, [(rid, text, ids, params)], eos_token_ids=self.eos_token_ids, priority=prio
                )
            except QueueFull:
                return
            self._backlog.popleft()

    # ------------------------------------------------------------------ generation

    def _step(self) -> list[SequenceDelta]:
        self._feed()
        outputs = self.engine.step()
        refused = next((o for o in outputs if o.error_code == "invalid_request"), None)
        if refused is not None:  # a constraint the worker could not compile: like any invalid param
            raise InvalidParam(refused.error or "invalid request", refused.error_param)
        deltas, to_abort = self.processor.process(outputs)
        if to_abort:
            self.engine.abort_requests(to_abort)
        return deltas

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion with continuous batching; results in prompt order."""
        ids = self._submit(prompts, sampling_params, priority)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            try:
                while len(results) < len(ids):
                    for delta in self._step():
                        if delta.finish_reason is not None and delta.request_id not in results:
                            done = self.processor.pop_finished(delta.request_id)
                            if done is not None:
                                results[delta.request_id] = done
                                bar.update(1)
            except BaseException:  # e.g. a held-back prompt the engine refuses: leave nothing behind
                self._backlog.clear()
                for rid in ids:
                    self.processor.withdraw(self.engine, rid)
                raise
        return [results[i] for i in ids]

    def stream(
        self, prompts: PromptInput | Sequence[PromptInput], sampling_params: SamplingParams | None = None
    ) -> Iterator[SequenceDelta]:
        """Generate one prompt (or several, batched together), yielding text deltas as they are
        produced (what is unfinished is aborted if the iterator is abandoned)."""
        pending = set(self._submit(prompts, sampling_params, None))
        try:
            while pending:
                for delta in self._step():
                    if delta.request_id in pending:
                        yield delta
                pending = {rid for rid in pending if self.processor.pop_finished(rid) is None}
        finally:
            for rid in pending:
                self.processor.withdraw(self.engine, rid)
