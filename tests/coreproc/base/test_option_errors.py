"""A refused engine option value names the option as the user gave it: the flag on the command line,
the keyword in `EngineConfig.create(...)` / `LLM(...)`.

Walks every option of `ENGINE_SECTIONS` (coreproc.base.options.settings): each option with a checkable
domain gets one bad value (the others keep their defaults, but for the few it needs), and the one-line
error must name that option: `ember generate`'s parser and error path must say its flag (argparse's
`invalid choice` included), `EngineConfig.create` its keyword. Options every value of which is valid
are listed in FREE, each with the reason. Run: `pytest -q tests/coreproc/base/test_option_errors.py`.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from coreproc.base.config import ENGINE_SECTIONS, ConfigError, EngineConfig, engine_options
from coreproc.base.errors import run_command
from coreproc.base.options import flags, settings
from frontend.cli import build_parser, main

SETTINGS = {s.keyword: s for s in settings(ENGINE_SECTIONS)}
FLAGS = flags(ENGINE_SECTIONS)

# options every value of which is valid, or that no value check names
FREE = {
    "model": "a path; a missing one is refused naming the path given (often positional, not --model)",
    "seed": "any integer",
    "revision": "a free name (part of the weight cache's key)",
    "kv_cache_prefault": "a boolean",
    "enable_prefix_caching": "a boolean",
    "release_window_blocks": "a boolean",
    "prefix_hash_seed": "any integer",
    "async_scheduling": "a boolean",
    "master_addr": "any host name or address (reached when the nodes meet)",
    "curve_keys": "a folder, read when the core starts (its errors name the folder)",
    "socket_dir": "a folder, made or read by the preload client (its errors name the folder)",
    "preload_wait_timeout": "any number of seconds (<= 0: do not wait)",
    "weights_file": "a path set by `ember snapshot`, not by users",
    "worker_zygote": "a boolean",
    "enable_lora": "a boolean",
}

# one bad value per option, with the other options it needs to be checked: {keyword: (value, needs)}
BAD: dict[str, tuple[Any, dict[str, Any]]] = {
    "dtype": ("int3", {}),
    "max_model_len": (1, {}),
    "quantization": ("gptq", {}),
    "block_size": (3, {}),
    "num_kv_blocks": (0, {}),
    "kv_cache_memory": (0, {}),
    "kv_cache_memory_fraction": (1.5, {}),
    "kv_cache_dtype": ("int3", {}),
    "mm_processor_cache_gb": (-1.0, {}),
    "mm_encoder_cache_gb": (-1.0, {}),
    "max_num_seqs": (-3, {}),  # was refused as max_seqs_per_request, the limit derived from it
    "max_num_batched_tokens": (0, {}),
    "scheduling_policy": ("lifo", {}),
    "max_num_active_seqs": (300, {}),
    "long_prefill_token_threshold": (-1, {}),
    "max_num_queued_requests": (0, {}),
    "max_num_queued_tokens": (0, {}),
    "stall_timeout": (0.0, {}),
    "stall_action": ("shrug", {}),
    "tensor_parallel_size": (0, {}),
    "pipeline_parallel_size": (0, {}),
    "pp_layer_partition": ("a,b", {"pipeline_parallel_size": 2}),
    "data_parallel_size": (0, {}),
    "data_parallel_rank": (5, {}),
    "dp_routing": ("random", {}),
    "distributed_executor_backend": ("mpi", {}),
    "placement_strategy": ("STRICT", {}),
    "nnodes": (0, {}),
    "node_rank": (3, {}),
    "master_port": (70000, {"nnodes": 2, "master_addr": "10.0.0.1", "tensor_parallel_size": 2}),
    "device": ("tpu", {}),
    "attention_backend": ("flash", {}),
    "load_format": ("tape", {}),
    "lora_modules": (("adapter",), {"enable_lora": True}),
    "max_loras": (0, {}),
    "max_lora_rank": (0, {}),
    "max_cpu_loras": (1, {}),
    "logits_processors": (("nope",), {}),
    "speculative_config": ('{"num_speculative_tokens": 0}', {}),
}
BAD |= {k: (0, {}) for k, s in SETTINGS.items() if s.section == "request limits"}

# what the line says of the value, where it is not the value itself (JSON: the part at fault)
SAID = {"speculative_config": "num_speculative_tokens must be in [1, 16], got 0"}


def argv_of(keyword: str, value: Any) -> list[str]:
    flag = SETTINGS[keyword].flag
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, *map(str, value)] if isinstance(value, tuple) else [flag, str(value)]


def names(line: str, name: str) -> bool:
    """`name` (a flag or a keyword) appears in `line` as itself, not as part of a longer name."""
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", line) is not None


def says_value(line: str, keyword: str) -> bool:
    value = BAD[keyword][0]
    said = [SAID[keyword]] if keyword in SAID else value if isinstance(value, tuple) else [value]
    return all(str(v) in line for v in said)


def cli_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line `ember generate hi ARGV` fails with: argparse's, or the engine config's as `main`
    says it (run_command with the engine options' flags)."""
    try:
        args = build_parser("generate").parse_args(["generate", "hi", *argv])
    except SystemExit as e:
        assert e.code == 2
    else:

        def build() -> int:
            EngineConfig.create(**engine_options(args))
            return 0

        assert run_command("ember generate", build, flags=FLAGS) == 2, f"{argv} was not refused"
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.unit
def test_every_option_is_walked_or_listed_as_free() -> None:
    assert set(BAD) | set(FREE) == set(SETTINGS), "give a new option a bad value (or say why it has none)"
    assert not set(BAD) & set(FREE)


@pytest.mark.unit
@pytest.mark.parametrize("keyword", sorted(BAD))
def test_the_command_line_names_the_flag(keyword: str, capsys: pytest.CaptureFixture[str]) -> None:
    value, needs = BAD[keyword]
    argv = [a for k, v in needs.items() for a in argv_of(k, v)] + argv_of(keyword, value)
    line = cli_error(argv, capsys)
    assert line.startswith("ember generate: error: ")
    assert names(line, SETTINGS[keyword].flag), line
    assert says_value(line, keyword), line


@pytest.mark.unit
@pytest.mark.parametrize("keyword", sorted(BAD))
def test_the_python_api_names_the_keyword(keyword: str) -> None:
    value, needs = BAD[keyword]
    with pytest.raises(ConfigError) as err:
        EngineConfig.create(**needs, **{keyword: value})
    line = str(err.value)
    assert "\n" not in line and names(line, keyword), line
    assert err.value.option == keyword, line
    assert says_value(line, keyword), line


@pytest.mark.unit
def test_ember_names_the_flag_given_not_a_limit_derived_from_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--max-num-seqs", "-3", "--max-tokens", "1"]) == 2
    assert capsys.readouterr().err == "ember generate: error: --max-num-seqs must be at least 1, got -3\n"
    with pytest.raises(ConfigError, match=r"^max_num_seqs must be at least 1, got -3$"):
        EngineConfig.create(max_num_seqs=-3)
    config = EngineConfig.create(max_num_seqs=12)
    assert config.limits.max_seqs_per_request == 12, "still derived from max_num_seqs"


@pytest.mark.unit
def test_a_config_error_is_said_with_the_flags_of_the_names_it_carries() -> None:
    e = ConfigError.bad("max_num_seqs", "must be at least 1, got 0 (max_num_seqs_per_x max_num_seqs)")
    assert e.said_with(FLAGS) == "--max-num-seqs must be at least 1, got 0 (max_num_seqs_per_x max_num_seqs)"
    plain = ConfigError("max_num_seqs is mentioned, but no setting is named")
    assert plain.said_with(FLAGS) == str(plain)
    with pytest.raises(AssertionError):
        ConfigError("a message that forgets its option", option="max_num_seqs")
