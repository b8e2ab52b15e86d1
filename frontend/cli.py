"""The `ember` command: one entry point, one subcommand per job.

Runs in the user's shell process. Subcommands import their modules lazily so `ember --help` is fast.
Engine flags (vLLM's names) are derived from the config's options (coreproc.base.config.ENGINE_SECTIONS).
Errors a user can fix (`EmberError`: bad flag values, missing or mismatched model files, bad prompts)
end with exit status 2 and one line on stderr, a bad engine setting named by its flag (the config
names the keyword); anything else prints its traceback (exit 1).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import NoReturn

from coreproc.base.errors import run_command
from frontend.argv import command_of


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
    from coreproc.base.config import engine_options

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
    llm = LLM(show_progress=False, **engine_options(args))
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
    from frontend import make_model

    return make_model.run(args)


def cmd_core(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coreproc.base.config import EngineConfig, engine_options
    from coreproc.base.ipc import ipc_endpoint, make_runtime_dir, remove_runtime_dir
    from coreproc.core.server import run_core_process

    config = EngineConfig.create(**engine_options(args))
    keys = Path(args.curve_keys) if args.curve_keys else None
    if config.parallel.data_parallel_size > 1:
        from coreproc.startup.launcher import run_core_group

        return run_core_group(
            config,
            args.listen,
            curve_keys=keys,
            shutdown_timeout=args.shutdown_timeout,
            client_timeout=args.client_timeout,
        )
    runtime_dir = make_runtime_dir()
    try:
        listen = args.listen or ipc_endpoint(runtime_dir, "core")
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


def cmd_worker(args: argparse.Namespace) -> int:
    from coreproc.base.config import EngineConfig, engine_options
    from coreproc.startup.headless import run_headless

    return run_headless(EngineConfig.create(**engine_options(args)))


def cmd_keygen(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coreproc.base.ipc import generate_curve_keys

    server, client = generate_curve_keys(Path(args.directory))
    print(
        f"server secret key: {server} (give the directory to --curve-keys of `ember core` or of every node)"
    )
    print(f"client secret key: {client}; server public key: {server.with_suffix('.key')}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from coreproc.base import trace
    from coreproc.base.config import EngineConfig, engine_options
    from frontend import serve

    with trace.phase("the engine config", serve.FRONTEND):  # a folder's tokenizer built here too
        config = EngineConfig.create(**engine_options(args))
    return serve.run(args, config)


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from coreproc.base.config import EngineConfig, engine_options
    from frontend.bench import throughput as bench_throughput

    return bench_throughput.run(args, EngineConfig.create(**engine_options(args)))


def cmd_preload(args: argparse.Namespace) -> int:
    from coreproc.base.config import EngineConfig, engine_options
    from workers.weight_cache import preload

    kwargs = engine_options(args)
    config = EngineConfig.create(**kwargs)
    draft = None
    if args.draft_model:
        draft = EngineConfig.create(
            **(kwargs | {"model": args.draft_model, "quantization": None, "revision": None})
        )
    return preload.run(args, config, draft)


def cmd_bench_restart(args: argparse.Namespace) -> int:
    from coreproc.base.config import EngineConfig, engine_options
    from frontend.bench import restart as bench_restart

    return bench_restart.run(args, EngineConfig.create(**engine_options(args)))


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from coreproc.base.config import EngineConfig, engine_options
    from frontend.bench import latency as bench_latency

    return bench_latency.run(args, EngineConfig.create(**engine_options(args)))


def cmd_snapshot(args: argparse.Namespace) -> int:
    from frontend.snapshot import commands as snapshot

    return snapshot.run(args)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from frontend.bench import serve as bench_serve

    return bench_serve.main(args)


def cmd_batch(args: argparse.Namespace) -> int:
    from coreproc.client import batch

    return batch.run(args)


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error: what is wrong and where to look, not the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def engine_flags() -> dict[str, str]:
    """Each engine option's keyword -> its flag (how a `ConfigError` is said on the command line)."""
    from coreproc.base.config import ENGINE_SECTIONS
    from coreproc.base.options import flags

    return flags(ENGINE_SECTIONS)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's flags (coreproc.base.config's options: imported only for a command that takes them)."""
    from coreproc.base.config import add_engine_arguments as add

    add(p)


def model_help() -> str:
    from coreproc.base.model_config import MODEL_HELP

    return MODEL_HELP


def _generate_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    add_engine_arguments(p)
    add_sampling_args(p)


def _serve_flags(p: argparse.ArgumentParser) -> None:
    from frontend import serve

    serve.add_arguments(p)
    add_engine_arguments(p)


def _core_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help=model_help())
    p.add_argument(
        "--listen",
        default=None,
        help="ipc://PATH or tcp://HOST:PORT (default: a private ipc path); with -dp D, D addresses "
        "comma-separated, or one tcp://HOST:PORT (rank r on PORT + r)",
    )
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="grace period on SIGTERM (s)")
    silent = "abort requests of clients silent this long (s)"
    p.add_argument("--client-timeout", type=float, default=10.0, help=silent)
    add_engine_arguments(p)


def _worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help=model_help())
    p.add_argument(
        "--headless",
        action="store_true",
        required=True,
        help="no core or API here: the ranks of --node-rank connect to the head at --master-addr",
    )
    add_engine_arguments(p)


def _preload_flags(p: argparse.ArgumentParser) -> None:
    from workers.weight_cache import preload

    preload.add_arguments(p)
    add_engine_arguments(p)


def _keygen_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory")


def _batch_flags(p: argparse.ArgumentParser) -> None:
    from coreproc.client import batch

    batch.add_arguments(p)
    add_engine_arguments(p)


def _bench_flags(p: argparse.ArgumentParser) -> None:
    from frontend.bench import latency, restart, serve, throughput

    bench = p.add_subparsers(dest="bench_command", required=True)
    runs = (
        (
            "throughput",
            "offline throughput, in-process vs multiprocess engine",
            throughput,
            cmd_bench_throughput,
        ),
        (
            "restart",
            "time to ready: cold start from disk vs warm from ember preload",
            restart,
            cmd_bench_restart,
        ),
        ("latency", "batch-1 decode latency and achieved memory bandwidth", latency, cmd_bench_latency),
        ("serve", "load-test any OpenAI-compatible server (TTFT, TPOT, ITL, E2E)", serve, cmd_bench_serve),
    )
    for name, help_text, module, func in runs:
        one = bench.add_parser(name, help=help_text)
        module.add_arguments(one)
        if name != "serve":  # `bench serve` loads any server: no engine of its own
            add_engine_arguments(one)
        one.set_defaults(func=func)


def _snapshot_flags(p: argparse.ArgumentParser) -> None:
    from frontend.snapshot import commands as snapshot

    snapshot.add_arguments(p)


def _make_model_flags(p: argparse.ArgumentParser) -> None:
    from frontend import make_model

    make_model.add_arguments(p)


Flags = Callable[[argparse.ArgumentParser], None]
# name, help, its flags (imported and added only for the command being run), what runs it
SUBCOMMANDS: tuple[tuple[str, str, Flags, Callable[[argparse.Namespace], int] | None], ...] = (
    ("generate", "stream a completion of one prompt to the terminal", _generate_flags, cmd_generate),
    ("serve", "serve the OpenAI-compatible HTTP API", _serve_flags, cmd_serve),
    ("core", "run the engine core (scheduler + workers) for ZMQ clients", _core_flags, cmd_core),
    ("worker", "run this node's workers of an engine whose core runs on node 0", _worker_flags, cmd_worker),
    ("preload", "keep processed weights in memory for fast engine restarts", _preload_flags, cmd_preload),
    (
        "keygen",
        "make CurveZMQ key pairs for `ember core --curve-keys` and clients",
        _keygen_flags,
        cmd_keygen,
    ),
    ("batch", "run an OpenAI batch file (JSONL in, JSONL out) through the engine", _batch_flags, cmd_batch),
    ("bench", "benchmarks", _bench_flags, None),
    ("snapshot", "CRIU snapshots of a ready server: create, restore, inspect", _snapshot_flags, cmd_snapshot),
    (
        "make-model",
        "write a small Hugging Face checkpoint with random weights",
        _make_model_flags,
        cmd_make_model,
    ),
)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI; with `only`, the other subcommands are listed but their modules not imported
    and their flags not added (start-up time counts: `ember snapshot restore`, a forked `ember serve`)."""
    parser = Parser(prog="ember", description="Ember: LLM inference and serving")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text, flags, func in SUBCOMMANDS:
        command = sub.add_parser(name, help=help_text)
        if only is None or only == name:
            flags(command)
        if func is not None:
            command.set_defaults(func=func)
    return parser


def parser_for(argv: list[str]) -> argparse.ArgumentParser:
    """The parser `ember ARGV` is read with: every subcommand, with the flags of the one `argv` names.
    Builds the parser only (nothing runs); the tests parse the command lines the docs show with it."""
    return build_parser(command_of(argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser_for(argv).parse_args(argv)
    args.argv = list(argv)  # `ember serve --api-server-count` starts its other API servers with it
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    debug = args.log_level.upper() == "DEBUG"
    return run_command(f"ember {args.command}", lambda: func(args), debug, engine_flags)


if __name__ == "__main__":
    sys.exit(main())
