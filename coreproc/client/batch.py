"""`ember batch -i requests.jsonl -o results.jsonl`: an OpenAI batch file through one in-process engine.

Runs in the user's shell process: it tokenizes (or renders chat templates), drives one `EngineCore`
with continuous batching (at most `--max-in-flight` requests submitted at once) and detokenizes with the
`OutputProcessor`. Reads OpenAI batch input lines ({custom_id, method, url, body}); writes one OpenAI
batch output line per request as soon as it finishes (flushed, fsynced for files). Rerunning with the
same output file skips custom_ids already answered. The body's "model" is not checked, except that a
line naming a loaded LoRA adapter (`--enable-lora --lora-modules NAME=PATH`) runs with it: one engine
serves the whole file, and responses name the model that ran (the adapter, or the folder's name).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coreproc.base import options
from coreproc.base.errors import EmberError, QueueFull
from coreproc.base.protocol import LoRARef
from coreproc.client.batch_files import (
    Answered,
    BatchItem,
    LineError,
    RecordSink,
    count_lines,
    parse_line,
    read_lines,
    record,
    scan_output,
)
from coreproc.text import openai_protocol as oai
from coreproc.text.chat_features import FEATURE_SECTIONS, ChatFeatures
from coreproc.text.media import MediaIntake
from coreproc.text.media_config import MEDIA_SECTIONS, MediaConfig
from coreproc.text.openai_protocol import ChatCompletionRequest, CompletionRequest, RequestError
from coreproc.text.outputs import RequestOutput
from coreproc.text.render import Prompt, render_prompts, response_body, take_images

IN_FLIGHT_PER_SEQ = 4  # default --max-in-flight: this many times --max-num-seqs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The batch options (the CLI adds the engine flags)."""
    parser.add_argument("-i", "--input", required=True, help="OpenAI batch input JSONL ('-' for stdin)")
    parser.add_argument("-o", "--output", required=True, help="results JSONL, appended ('-' for stdout)")
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help=f"requests submitted to the engine at once (default {IN_FLIGHT_PER_SEQ} x --max-num-seqs)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    options.add_arguments(parser, (*FEATURE_SECTIONS, *MEDIA_SECTIONS))  # --tool-call-parser, images, ...


# ----------------------------------------------------------------------------- the run


@dataclass
class Job:
    """One batch line in the engine: one sub-request per prompt (completions may carry several)."""

    item: BatchItem
    request: CompletionRequest | ChatCompletionRequest
    rids: list[str]
    created: int
    model: str  # what the response names: the adapter the line ran with, or the engine's model
    results: dict[str, RequestOutput] = field(default_factory=dict)


class BatchRunner:
    """Takes input lines, submits requests to the engine, steps it and writes each record as it finishes."""

    def __init__(
        self,
        config: Any,
        sink: RecordSink,
        done: Answered,
        show_progress: bool = True,
        features: ChatFeatures | None = None,
        media: MediaConfig | None = None,
    ) -> None:
        from coreproc.base.tokenizer import load_tokenizer
        from coreproc.client.dp_engine import make_engine
        from coreproc.text.output_processor import OutputProcessor

        self.tokenizer = load_tokenizer(config.model.tokenizer)
        self.eos_ids = list(config.model.eos_token_ids)
        self.model_name = Path(config.model.model).name
        self.max_model_len, self.vocab_size = config.model.max_model_len, config.model.vocab_size
        self.limits = config.limits  # the same per-request bounds as the HTTP server's
        self.features = features or ChatFeatures()  # the same `openai` flags as the HTTP server's
        self.fields = self.features.fields()
        self.media_config = media or MediaConfig()  # the same `media` flags too; images fetched inline
        self.media = None
        if config.model.image_token_id is not None:
            self.media = MediaIntake.from_model(
                config.model.model, config.model.image_token_id, self.media_config
            )
        self.sink, self.done = sink, done
        self.engine = make_engine(config, show_progress)  # several cores with --data-parallel-size
        self.processor = OutputProcessor(self.tokenizer)
        self.jobs: dict[str, Job] = {}  # by sub-request id
        self.seen: set[str] = set()  # custom_ids of the lines read so far
        self.in_flight = 0
        self.deferred: deque[BatchItem] = deque()  # refused by the queue limit, to submit again
        self.num_ok = self.num_errors = self.num_skipped = self.tokens = 0
        self.refused: dict[str, RequestError] = {}  # engine request id -> why the workers refused it
        self._next = 0

    def take(self, line_no: int, raw: bytes) -> int:
        """Handle one input line; returns how many records it settled at once (skipped or refused)."""
        try:
            item = parse_line(line_no, raw, self.seen)
        except LineError as err:
            if str(err) in self.done.line_errors:
                self.num_skipped += 1
            else:
                self.sink.write(record(err.custom_id, error={"code": err.code, "message": str(err)}))
                self.num_errors += 1
            return 1
        if item.custom_id in self.done.custom_ids:
            self.num_skipped += 1
            return 1
        before = self.num_errors
        self.submit(item)
        return self.num_errors - before

    def count_unfinished(self, rest: Iterator[tuple[int, bytes]]) -> int:
        """Requests in flight or whose record could not be written, plus the unread lines that a rerun
        would still have to answer."""
        n = self.in_flight + len(self.deferred) + self.sink.unwritten
        for line_no, raw in rest:
            try:
                n += parse_line(line_no, raw, self.seen).custom_id not in self.done.custom_ids
            except LineError as err:
                n += str(err) not in self.done.line_errors
        return n

    def _prompts(self, item: BatchItem) -> tuple[Any, list[Prompt]]:
        req: ChatCompletionRequest | CompletionRequest
        if item.kind == "chat":
            req = oai.parse_chat_request(item.body, self.limits, self.fields)
            media_kwargs = self.media_config.request_kwargs(req.mm_processor_kwargs, req.media_io_kwargs)
            kwargs, images = self.features.template_kwargs(req), self.media is not None
            prompts = render_prompts(req, self.tokenizer, self.vocab_size, None, kwargs, images)
            return req, [take_images(p, self.media, media_kwargs) for p in prompts]
        req = oai.parse_completion_request(item.body, self.limits, self.fields)
        return req, render_prompts(req, self.tokenizer, self.vocab_size)

    def submit(self, item: BatchItem) -> None:
        """Queue one request, or write its 400 record at once if it is invalid."""
        try:
            req, prompts_in = self._prompts(item)
            params = [
                oai.to_sampling_params(
                    req, len(p.ids), self.max_model_len, self.features.constraint(req, self.tokenizer, p.ids)
                )
                for p in prompts_in
            ]
        except ValueError as e:  # RequestError, InvalidParam, tokenizer errors
            return self._reject(item, e)
        adapter = req.model if req.model in self.engine.scheduler.loras.adapters else None
        job = Job(item, req, [], int(time.time()), adapter or self.model_name)
        prompts = []
        for p, sp in zip(prompts_in, params):
            job.rids.append(f"b{self._next}")
            prompts.append((job.rids[-1], p.text, p.ids, sp))
            self._next += 1
        try:  # the line's sequences are admitted together or not at all
            self.processor.submit(
                self.engine,
                prompts,
                eos_token_ids=self.eos_ids,
                priority=req.priority,
                cache_salt=req.cache_salt,
                mm_refs={rid: p.mm_refs for rid, p in zip(job.rids, prompts_in)},
                lora=None if adapter is None else dict.fromkeys(job.rids, LoRARef(adapter, "")),
            )
        except (ValueError, QueueFull) as e:  # InvalidParam, or the engine's queue limit
            if isinstance(e, QueueFull):
                self.deferred.append(item)  # submitted again once the queue drains
                return
            return self._reject(item, e)
        for rid in job.rids:
            self.jobs[rid] = job
        self.in_flight += 1

    def retry_deferred(self) -> int:
        """Submit requests the queue limit held back, in order, until it refuses again; returns how
        many records that settled (refusals)."""
        before = self.num_errors
        while self.deferred:
            item = self.deferred.popleft()
            waiting = len(self.deferred)
            self.submit(item)
            if len(self.deferred) > waiting:  # refused again: it went to the back; restore order
                self.deferred.rotate(1)
                break
        return self.num_errors - before

    def _reject(self, item: BatchItem, e: Exception) -> None:
        err = e if isinstance(e, RequestError) else RequestError(str(e), getattr(e, "param", None))
        self._respond(item.custom_id, uuid.uuid4().hex, err.status, err.error_body())

    def _respond(self, custom_id: str, hexid: str, status: int, body: dict) -> None:
        self.sink.write(
            record(custom_id, {"status_code": status, "request_id": f"req_{hexid}", "body": body})
        )
        if status == 200:
            self.num_ok += 1
        else:
            self.num_errors += 1

    def step(self) -> int:
        """One engine step; returns how many requests finished (their records are written)."""
        outputs = self.engine.step()
        for o in outputs:  # refused by the workers (a constraint that does not compile): a 400 record
            if o.error_code is not None:
                self.refused[o.request_id] = RequestError(o.error or "invalid request", o.error_param)
        deltas, to_abort = self.processor.process(outputs)
        if to_abort:
            self.engine.abort_requests(to_abort)
        finished = 0
        for d in deltas:
            self.tokens += len(d.token_ids)
            if d.finish_reason is None:
                continue
            result = self.processor.pop_finished(d.request_id)
            if result is None:
                continue
            job = self.jobs.pop(d.request_id)
            job.results[d.request_id] = result
            if len(job.results) == len(job.rids):
                self._finish(job)
                finished += 1
        assert self.engine.has_unfinished_requests() or not self.jobs, (
            "requests lost between processor and engine"
        )
        return finished

    def _finish(self, job: Job) -> None:
        self.in_flight -= 1
        results = [job.results[rid] for rid in job.rids]
        hexid = uuid.uuid4().hex
        refusal = next((self.refused.pop(rid) for rid in job.rids if rid in self.refused), None)
        if refusal is not None:
            for rid in job.rids:
                self.refused.pop(rid, None)
            return self._respond(job.item.custom_id, hexid, refusal.status, refusal.error_body())
        if any(o.finish_reason == "error" for r in results for o in r.outputs):
            err = RequestError("the engine failed this request", status=500, err_type="internal_error")
            return self._respond(job.item.custom_id, hexid, 500, err.error_body())
        body = response_body(
            job.request,
            results,
            job.model,
            job.created,
            hexid,
            self._decode,
            self.features,
            self.tokenizer,
        )
        self._respond(job.item.custom_id, hexid, 200, body)

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=True)


def drive(runner: BatchRunner, lines: Iterator[tuple[int, bytes]], max_in_flight: int, bar: Any) -> None:
    """Keep up to `max_in_flight` requests in the engine and step it until every line is answered."""
    start = time.perf_counter()
    exhausted = False
    while True:
        bar.update(runner.retry_deferred())
        while not exhausted and not runner.deferred and runner.in_flight < max_in_flight:
            nxt = next(lines, None)
            exhausted = nxt is None
            if nxt is not None:
                bar.update(runner.take(*nxt))
        if exhausted and runner.in_flight == 0 and not runner.deferred:
            return
        finished = runner.step()
        if finished:
            bar.update(finished)
            bar.set_postfix_str(f"{runner.tokens / (time.perf_counter() - start):.0f} tok/s", refresh=False)


def run(args: argparse.Namespace) -> int:
    """Run a batch file; 0 when every line got a record, 1 if the engine failed (rerun to resume)."""
    from tqdm import tqdm

    if args.input != "-" and not os.path.isfile(args.input):
        raise EmberError(f"input file not found: {args.input}")
    if args.input != "-" and args.output != "-" and os.path.exists(args.output):
        if os.path.samefile(args.input, args.output):
            raise EmberError("the output file must not be the input file")
    if args.max_in_flight is not None and args.max_in_flight < 1:
        raise EmberError("--max-in-flight must be at least 1")
    done = scan_output(args.output) if args.output != "-" else Answered()
    total = count_lines(args.input) if args.input != "-" else None

    from coreproc.base.config import EngineConfig, engine_options

    values = options.collect(args, (*FEATURE_SECTIONS, *MEDIA_SECTIONS))
    features = ChatFeatures(**{f.name: values[f.name] for f in dataclasses.fields(ChatFeatures)})
    media = MediaConfig(**{f.name: values[f.name] for f in dataclasses.fields(MediaConfig)})
    config = EngineConfig.create(**engine_options(args))
    sink = RecordSink(args.output)
    try:
        runner = BatchRunner(config, sink, done, not args.no_progress, features, media)
    except BaseException:
        sink.close()
        raise
    max_in_flight = args.max_in_flight or IN_FLIGHT_PER_SEQ * config.scheduler.max_num_seqs
    stream = sys.stdin.buffer if args.input == "-" else open(args.input, "rb")  # noqa: SIM115
    lines = read_lines(stream)
    bar = tqdm(total=total, desc="batch", unit="req", file=sys.stderr, disable=args.no_progress)
    start = time.perf_counter()
    try:
        drive(runner, lines, max_in_flight, bar)
    except (Exception, KeyboardInterrupt) as e:
        bar.close()
        reason = "interrupted" if isinstance(e, KeyboardInterrupt) else (str(e).splitlines() or [repr(e)])[0]
        hint = "; rerun with the same -o to resume" if args.output != "-" else ""
        unfinished = runner.count_unfinished(iter(()) if stream.isatty() else lines)
        print(f"ember batch: error: {reason}; {unfinished} requests not finished{hint}", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    finally:
        sink.close()
        if stream is not sys.stdin.buffer:
            stream.close()
        runner.engine.shutdown()
        if runner.media is not None:
            runner.media.close()
    bar.close()
    secs = time.perf_counter() - start
    print(
        f"ember batch: {runner.num_ok} done, {runner.num_errors} errors, {runner.num_skipped} already in the "
        f"output; {runner.tokens} tokens generated in {secs:.1f} s ({runner.tokens / secs:.0f} tok/s)",
        file=sys.stderr,
    )
    return 0
