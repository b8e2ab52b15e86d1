"""The `ember` command: one entry point, one subcommand per job.

Runs in the user's shell process. Subcommands import their modules lazily so `ember --help` is fast.
Engine flags mirror vLLM's names. Errors a user can fix (bad flag values, missing model files, bad
prompts) end with a non-zero exit and one line on stderr saying what is wrong.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from coreproc.limits import RequestLimits


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine (names as in vLLM)."""
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model", dest="model_flag", default=None, help="checkpoint folder (default: bundled model)"
    )
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="quantize weights while loading: fp8_per_tensor (alias fp8), int8, int4",
    )
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache across all layers")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule the next step while workers run the current one (multiprocess engine)",
    )
    g.add_argument(
        "--max-num-active-seqs", type=int, default=None, help="cap on running requests (<= --max-num-seqs)"
    )
    g.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="prefills longer than this share the step budget fairly while others wait "
        "(default 4%% of the context; 0 disables)",
    )
    g.add_argument("--max-num-queued-requests", type=int, default=None, help="refuse (503) beyond this many")
    g.add_argument(
        "--max-num-queued-tokens", type=int, default=None, help="refuse (503) beyond this many prompt tokens"
    )
    g.add_argument(
        "--stall-timeout",
        type=float,
        default=60.0,
        help="seconds with work held and no step completed before /health reports a stall",
    )
    g.add_argument(
        "--prefix-cache-seed", type=int, default=None, help="prefix-cache hash seed (default: random)"
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    g.add_argument("--data-parallel-rank", type=int, default=0, help="this engine's rank among DP engines")
    g.add_argument("--revision", default=None, help="your name for this checkpoint version (cache key)")
    g.add_argument("--load-format", default="auto", choices=["auto", "ipc_cache"])
    g.add_argument("--socket-dir", default=None, help="preload daemons' socket directory")
    g.add_argument(
        "--preload-wait-timeout", type=float, default=0.0, help="wait this long for a preload daemon (s)"
    )
    g.add_argument(
        "--logits-processors",
        nargs="*",
        default=[],
        metavar="MODULE:CLASS",
        help="extra logits processors (built-ins and ember.logits_processors entry points always load)",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='e.g. \'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\'',
    )
    g.add_argument("--weights-file", default=None, help=argparse.SUPPRESS)  # set by `ember snapshot`
    g.add_argument(
        "--worker-zygote",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --load-format ipc_cache, fork workers from the preload zygote when one is running",
    )
    g.add_argument("--device", default="auto")
    g.add_argument("--attention-backend", default=None, choices=["torch", "triton"])
    RequestLimits.add_arguments(p)


def engine_kwargs(args: argparse.Namespace) -> dict:
    model = getattr(args, "model", None) or args.model_flag
    return dict(
        model=model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        quantization=args.quantization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        async_scheduling=args.async_scheduling,
        max_num_active_seqs=args.max_num_active_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_queued_requests=args.max_num_queued_requests,
        max_num_queued_tokens=args.max_num_queued_tokens,
        stall_timeout=args.stall_timeout,
        prefix_hash_seed=args.prefix_cache_seed,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        data_parallel_rank=args.data_parallel_rank,
        revision=args.revision,
        load_format=args.load_format,
        socket_dir=args.socket_dir,
        preload_wait_timeout=args.preload_wait_timeout,
        device=args.device,
        attention_backend=args.attention_backend,
        logits_processors=tuple(args.logits_processors),
        speculative_config=args.speculative_config,
        weights_file=args.weights_file,
        worker_zygote=args.worker_zygote,
        request_limits=RequestLimits.from_args(args),
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def cmd_generate(args: argparse.Namespace) -> int:
    from coreproc import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(show_progress=False, **engine_kwargs(args))
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    reason = None
    for delta in llm.stream(args.prompt, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        reason = delta.finish_reason or reason
    sys.stdout.write("\n")
    print(f"[finished: {reason}]", file=sys.stderr)
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    from tools import make_model

    return make_model.run(args)


def cmd_core(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coreproc.config import EngineConfig
    from coreproc.core_proc import run_core_process
    from coreproc.ipc import ipc_endpoint, make_runtime_dir, remove_runtime_dir

    config = EngineConfig.create(**engine_kwargs(args))
    runtime_dir = make_runtime_dir()
    try:
        listen = args.listen or ipc_endpoint(runtime_dir, "core")
        keys = Path(args.curve_keys) if args.curve_keys else None
        return run_core_process(
            config,
            listen,
            runtime_dir,
            curve_keys=keys,
            shutdown_timeout=args.shutdown_timeout,
            client_timeout=args.client_timeout,
        )
    finally:
        remove_runtime_dir(runtime_dir)


def cmd_keygen(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coreproc.ipc import generate_curve_keys

    server, client = generate_curve_keys(Path(args.directory))
    print(f"server secret key: {server} (give the directory to `ember core --curve-keys`)")
    print(f"client secret key: {client}; server public key: {server.with_suffix('.key')}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from coreproc.config import EngineConfig
    from frontend import serve

    return serve.run(args, EngineConfig.create(**engine_kwargs(args)))


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from coreproc.config import EngineConfig
    from tools import bench_throughput

    return bench_throughput.run(args, EngineConfig.create(**engine_kwargs(args)))


def cmd_preload(args: argparse.Namespace) -> int:
    from coreproc.config import EngineConfig
    from workers.weight_cache import preload

    kwargs = engine_kwargs(args)
    config = EngineConfig.create(**kwargs)
    draft = None
    if args.draft_model:
        draft = EngineConfig.create(
            **(kwargs | {"model": args.draft_model, "quantization": None, "revision": None})
        )
    return preload.run(args, config, draft)


def cmd_bench_restart(args: argparse.Namespace) -> int:
    from coreproc.config import EngineConfig
    from tools import bench_restart

    return bench_restart.run(args, EngineConfig.create(**engine_kwargs(args)))


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from coreproc.config import EngineConfig
    from tools import bench_latency

    return bench_latency.run(args, EngineConfig.create(**engine_kwargs(args)))


def cmd_snapshot(args: argparse.Namespace) -> int:
    from frontend import snapshot

    return snapshot.run(args)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from tools import bench_serve

    return bench_serve.main(args)


def cmd_batch(args: argparse.Namespace) -> int:
    from coreproc import batch

    return batch.run(args)


def command_of(argv: list[str]) -> str | None:
    """The subcommand named in `argv` (None for none or --help): only its module needs importing."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--log-level":
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI; with `only`, the other subcommands are listed but their modules not imported
    (start-up time counts for `ember snapshot restore`)."""

    def want(name: str) -> bool:
        return only is None or only == name

    parser = argparse.ArgumentParser(prog="ember", description="Ember: LLM inference and serving")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a completion of one prompt to the terminal")
    gen.add_argument("prompt")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    if want("serve"):
        from frontend import serve

        serve.add_arguments(srv)
        add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    core = sub.add_parser("core", help="run the engine core (scheduler + workers) for ZMQ clients")
    core.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: bundled model)")
    core.add_argument(
        "--listen", default=None, help="ipc://PATH or tcp://HOST:PORT (default: a private ipc path)"
    )
    core.add_argument(
        "--curve-keys", default=None, help="directory from `ember keygen` (required off loopback)"
    )
    core.add_argument("--shutdown-timeout", type=float, default=30.0, help="grace period on SIGTERM (s)")
    core.add_argument(
        "--client-timeout", type=float, default=10.0, help="abort requests of clients silent this long (s)"
    )
    add_engine_args(core)
    core.set_defaults(func=cmd_core)

    pre = sub.add_parser("preload", help="keep processed weights in memory for fast engine restarts")
    if want("preload"):
        from workers.weight_cache import preload

        preload.add_arguments(pre)
        add_engine_args(pre)
    pre.set_defaults(func=cmd_preload)

    kg = sub.add_parser("keygen", help="make CurveZMQ key pairs for `ember core --curve-keys` and clients")
    kg.add_argument("directory")
    kg.set_defaults(func=cmd_keygen)

    bt = sub.add_parser("batch", help="run an OpenAI batch file (JSONL in, JSONL out) through the engine")
    if want("batch"):
        from coreproc import batch

        batch.add_arguments(bt)
        add_engine_args(bt)
    bt.set_defaults(func=cmd_batch)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    if want("bench"):
        tput = bench.add_parser("throughput", help="offline throughput, in-process vs multiprocess engine")
        from tools import bench_throughput

        bench_throughput.add_arguments(tput)
        add_engine_args(tput)
        tput.set_defaults(func=cmd_bench_throughput)
        restart = bench.add_parser(
            "restart", help="time to ready: cold start from disk vs warm from ember preload"
        )
        from tools import bench_restart

        bench_restart.add_arguments(restart)
        add_engine_args(restart)
        restart.set_defaults(func=cmd_bench_restart)
        lat = bench.add_parser("latency", help="batch-1 decode latency and achieved memory bandwidth")
        from tools import bench_latency

        bench_latency.add_arguments(lat)
        add_engine_args(lat)
        lat.set_defaults(func=cmd_bench_latency)
        load = bench.add_parser("serve", help="load-test any OpenAI-compatible server (TTFT, TPOT, ITL, E2E)")
        from tools import bench_serve

        bench_serve.add_arguments(load)
        load.set_defaults(func=cmd_bench_serve)

    snap = sub.add_parser("snapshot", help="CRIU snapshots of a ready server: create, restore, inspect")
    if want("snapshot"):
        from frontend import snapshot

        snapshot.add_arguments(snap)
    snap.set_defaults(func=cmd_snapshot)

    mk = sub.add_parser("make-model", help="write a small Hugging Face checkpoint with random weights")
    if want("make-model"):
        from tools import make_model

        make_model.add_arguments(mk)
    mk.set_defaults(func=cmd_make_model)
    return parser


USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, RuntimeError)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(command_of(argv))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return 130
    except USER_ERRORS as e:
        if args.log_level.upper() == "DEBUG":
            raise
        print(f"ember {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
