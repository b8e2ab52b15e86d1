"""The offline Python API: `LLM(model).generate(prompts, SamplingParams(...))`.

Runs everything in the caller's process: tokenization and detokenization (frontend pieces), and an
`EngineCore` whose scheduler and model runner are the same ones the server uses. Prompts may be
strings, token-id lists, or dicts with "prompt" / "prompt_token_ids"; for a vision-language model a
dict's "multi_modal_data": {"image": ...} holds its images (PIL images, encoded bytes or URLs; one
image token in the prompt per image), taken in by `coreproc.text.media` as the server takes them, and
`chat(messages)` renders conversations with image parts. With no model it uses the small model bundled
with Ember.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator, Sequence
from typing import Any, cast

from tqdm import tqdm

from coreproc.base import boot
from coreproc.base.config import EngineConfig
from coreproc.base.errors import InvalidParam, QueueFull
from coreproc.base.protocol import LoRARef, MultiModalRef, SamplingParams, SchedulerStats
from coreproc.base.tokenizer import load_tokenizer
from coreproc.client.dp_engine import DPEngine, make_engine
from coreproc.text.chat import chat_images, render_chat
from coreproc.text.media import ImagePart, MediaIntake
from coreproc.text.media_config import MediaConfig
from coreproc.text.openai_protocol import RequestError
from coreproc.text.output_processor import OutputProcessor, SequenceDelta
from coreproc.text.outputs import RequestOutput

PromptInput = str | list[int] | dict
Prepared = tuple[str | None, list[int], list[MultiModalRef]]  # text, token ids (images expanded), images


class LLM:
    """An engine in this process. Keyword arguments mirror vLLM's engine arguments."""

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        show_progress: bool = True,
        media: MediaConfig | None = None,
        **engine_args: Any,
    ) -> None:
        """Build from vLLM-style engine arguments, or from a ready `EngineConfig` (`config=`).

        The garbage collector is paused while the engine is built (coreproc.base.boot): full collections
        would walk torch's objects again and again. The heap is not frozen here, so a dropped engine
        is still collected. `media`: where images may come from and how they are processed (the
        server's `media` flags; by default file:// URLs are refused, pass PIL images or bytes instead).
        """
        with boot.paused():
            self.config = config if config is not None else EngineConfig.create(model, **engine_args)
            self.tokenizer = load_tokenizer(self.config.model.tokenizer)
            self.eos_token_ids = list(self.config.model.eos_token_ids)
            self.engine = make_engine(self.config, show_progress)  # DPEngine with data_parallel_size > 1
        self.processor = OutputProcessor(self.tokenizer)
        image_token = self.config.model.image_token_id
        self.media = (
            None
            if image_token is None
            else MediaIntake.from_model(self.config.model.model, image_token, media or MediaConfig())
        )
        self._ids = itertools.count()
        self._backlog: collections.deque = collections.deque()  # held back by the engine's queue limit

    def close(self) -> None:
        """Stop worker processes (tensor parallelism) and the image processes, and free the engine."""
        if self.media is not None:
            self.media.close()
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def stats(self) -> SchedulerStats:
        return self.engine.stats()

    def load_lora(self, name: str, path: str) -> None:
        """Serve a PEFT LoRA adapter folder under `name` (the engine needs `enable_lora=True`); loading
        a name again replaces its weights (requests already running keep the old ones)."""
        for core in self._cores():
            core.scheduler.loras.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Stop serving an adapter (requests running with it finish with it)."""
        for core in self._cores():
            core.scheduler.loras.unload(name)

    def _cores(self) -> list:
        return self.engine.cores if isinstance(self.engine, DPEngine) else [self.engine]

    # ------------------------------------------------------------------ prompts

    def _normalize(self, prompts: PromptInput | Sequence[PromptInput]) -> list[Prepared]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        out = []
        for p in prompts:
            images: list[Any] = []
            if isinstance(p, dict):
                images = self._images_of(p)
                if "prompt_token_ids" in p:
                    out.append(self._with_images(p.get("prompt"), list(p["prompt_token_ids"]), images))
                    continue
                p = p["prompt"]
            if isinstance(p, str):
                out.append(self._with_images(p, self.tokenizer(p).input_ids, images))
            elif isinstance(p, list) and all(isinstance(t, int) for t in p):
                out.append((None, list(p), []))
            else:
                raise InvalidParam(
                    f"a prompt must be a string or a list of token ids, got {type(p).__name__}", "prompt"
                )
        return out

    @staticmethod
    def _images_of(prompt: dict) -> list[Any]:
        data = prompt.get("multi_modal_data") or {}
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise InvalidParam('multi_modal_data takes {"image": an image or a list of them}', "prompt")
        images = data.get("image", [])
        return list(images) if isinstance(images, (list, tuple)) else [images]

    def _with_images(self, text: str | None, ids: list[int], images: list[Any]) -> Prepared:
        """The prompt's images loaded, processed, and their image tokens expanded (RequestError, a
        ValueError, for bad images, as the server's 400)."""
        if not images:
            return text, ids, []
        if self.media is None:
            raise InvalidParam("this model does not take image input", "prompt")
        where = [f"image {k}" for k in range(len(images))]
        self.media.check(ids, [ImagePart("", w) for w in where])  # the count and the per-prompt limit
        data = [self.media.load(_encoded(im), w) for im, w in zip(images, where)]
        ids, refs = self.media.expand(ids, self.media.process(data, where=where))
        return text, ids, refs

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations (OpenAI-style messages; image parts for a vision-language
        model), rendered with the checkpoint's chat template."""
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = cast(list[list[dict]], [messages] if one else messages)
        prompts: list[PromptInput] = []
        for conversation in conversations:
            ids = render_chat(
                self.tokenizer,
                conversation,
                chat_template,
                add_generation_prompt,
                takes_images=self.media is not None,
            )
            urls = [part.url for part in chat_images(conversation)]
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": urls}} if urls else ids)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _submit(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
        lora_request: str | Sequence[str | None] | None = None,
    ) -> list[str]:
        items = self._normalize(prompts)
        names = (
            [lora_request] * len(items)
            if lora_request is None or isinstance(lora_request, str)
            else list(lora_request)
        )
        if len(names) != len(items):
            raise InvalidParam("need one lora_request per prompt (or a single one)", "lora_request")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise InvalidParam("need one SamplingParams per prompt (or a single one)", "sampling_params")
        for params in params_list:
            params.validate()
        rids = []
        for i, ((text, ids, refs), params) in enumerate(zip(items, params_list)):
            rid = str(next(self._ids))
            name = names[i]
            lora = None if name is None else LoRARef(name, "")
            self._backlog.append((rid, text, ids, params, priority[i] if priority else 0, refs, lora))
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
            rid, text, ids, params, prio, refs, lora = self._backlog[0]
            try:
                self.processor.submit(
                    self.engine,
                    [(rid, text, ids, params)],
                    eos_token_ids=self.eos_token_ids,
                    priority=prio,
                    mm_refs={rid: tuple(refs)},
                    lora={rid: lora} if lora is not None else None,
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
        lora_request: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion with continuous batching; results in prompt order. `lora_request`:
        the name of a loaded adapter (`--lora-modules`, `load_lora`) for every prompt, or one per prompt
        (None: the base model)."""
        ids = self._submit(prompts, sampling_params, priority, lora_request)
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


def _encoded(image: Any) -> str | bytes:
    """An image as the intake takes it: a URL or encoded bytes (a PIL image becomes a PNG, lossless)."""
    if isinstance(image, (str, bytes, bytearray)):
        return bytes(image) if isinstance(image, bytearray) else image
    save = getattr(image, "save", None)
    if save is None:
        raise RequestError(
            f"an image must be a PIL image, encoded bytes or a URL, not {type(image).__name__}"
        )
    import io

    buf = io.BytesIO()
    save(buf, format="PNG")
    return buf.getvalue()
