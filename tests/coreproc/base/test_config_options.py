"""Every engine setting is said once (coreproc.base.config, coreproc.base.options) and reachable everywhere.

For each option of `ENGINE_SECTIONS`: every command that builds an engine has its flag with the same
default, the flag's value reaches `EngineConfig.create`'s keyword, and that keyword (as `LLM(...)`
takes it) lands in the config field that declares it. Unknown keywords and bad choices are refused
with one line. Run: `pytest -q tests/coreproc/base/test_config_options.py`.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from coreproc.base import options
from coreproc.base.config import ENGINE_SECTIONS, ConfigError, EngineConfig, engine_options
from coreproc.base.host import default_draft_dir, default_model_dir
from frontend.cli import build_parser
from tests.paths import PLUGINS

COMMANDS = (
    ["generate", "hi"],
    ["serve"],
    ["core"],
    ["preload"],
    ["batch", "-i", "in", "-o", "out"],
    ["bench", "throughput"],
    ["bench", "latency"],
    ["bench", "restart"],
)

# one value other than the default per option: (command-line text, value the config holds)
SAMPLES: dict[str, tuple[str, object]] = {
    "model": (str(default_model_dir()), str(default_model_dir())),
    "dtype": ("bfloat16", "bfloat16"),
    "max_model_len": ("64", 64),
    "seed": ("7", 7),
    "quantization": ("fp8", "fp8_per_tensor"),
    "revision": ("v2", "v2"),
    "block_size": ("8", 8),
    "num_kv_blocks": ("40", 40),
    "kv_cache_memory": ("1000000", 1000000),
    "kv_cache_memory_fraction": ("0.5", 0.5),
    "kv_cache_dtype": ("fp8", "fp8"),
    "kv_cache_prefault": ("--kv-cache-prefault", True),
    "enable_prefix_caching": ("--no-enable-prefix-caching", False),
    "release_window_blocks": ("--no-release-window-blocks", False),
    "prefix_hash_seed": ("3", 3),
    "enable_lora": ("--enable-lora", True),
    "lora_modules": ("a=/nonexistent", ("a=/nonexistent",)),
    "max_loras": ("2", 2),
    "max_lora_rank": ("8", 8),
    "max_cpu_loras": ("4", 4),
    "mm_processor_cache_gb": ("0.5", 0.5),
    "mm_encoder_cache_gb": ("0.25", 0.25),
    "max_num_seqs": ("12", 12),
    "max_num_batched_tokens": ("300", 300),
    "scheduling_policy": ("priority", "priority"),
    "async_scheduling": ("--no-async-scheduling", False),
    "max_num_active_seqs": ("5", 5),
    "long_prefill_token_threshold": ("0", 0),
    "max_num_queued_requests": ("9", 9),
    "max_num_queued_tokens": ("999", 999),
    "stall_timeout": ("5.5", 5.5),
    "stall_action": ("report", "report"),
    "tensor_parallel_size": ("2", 2),
    "data_parallel_size": ("2", 2),
    "data_parallel_rank": ("1", 1),
    "pipeline_parallel_size": ("2", 2),
    "pp_layer_partition": ("1,3", "1,3"),
    "dp_routing": ("prefix", "prefix"),
    "distributed_executor_backend": ("ray", "ray"),
    "placement_strategy": ("SPREAD", "SPREAD"),
    "nnodes": ("2", 2),
    "node_rank": ("1", 1),
    "master_addr": ("10.0.0.1", "10.0.0.1"),
    "master_port": ("29511", 29511),
    "curve_keys": ("/keys", "/keys"),
    "device": ("cpu", "cpu"),
    "attention_backend": ("triton", "triton"),
    "load_format": ("ipc_cache", "ipc_cache"),
    "socket_dir": ("/tmp/ember-sockets", "/tmp/ember-sockets"),
    "preload_wait_timeout": ("1.5", 1.5),
    "weights_file": ("/tmp/w.bin", "/tmp/w.bin"),
    "worker_zygote": ("--no-worker-zygote", False),
    "logits_processors": ("ember_test_plugin:ForceToken", ("ember_test_plugin:ForceToken",)),
    "speculative_config": ('{"num_speculative_tokens": 2}', None),  # checked below: it is parsed
}
SAMPLES |= {s.keyword: ("3", 3) for s in options.settings(ENGINE_SECTIONS) if s.section == "request limits"}

SETTINGS = list(options.settings(ENGINE_SECTIONS))


def argv_for(keyword: str) -> list[str]:
    setting = next(s for s in SETTINGS if s.keyword == keyword)
    text, _ = SAMPLES[keyword]
    return [text] if text.startswith("--") else [setting.flag, text]


@pytest.mark.unit
def test_every_option_has_a_sample_and_one_keyword() -> None:
    keywords = [s.keyword for s in SETTINGS]
    assert len(keywords) == len(set(keywords)), "two options share a keyword"
    assert set(keywords) == set(SAMPLES), "add a sample value for each new option"


@pytest.mark.unit
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_command_has_every_flag_with_the_same_default(command: list[str]) -> None:
    parser = build_parser(command[0])
    args = parser.parse_args(command)
    assert engine_options(args) == options.defaults(ENGINE_SECTIONS)
    for s in SETTINGS:
        if s.keyword in ("model", "logits_processors", "lora_modules"):
            continue  # model: positional or flag; nargs="*" before a positional reads it as a value
        cut = 2 if command[0] == "bench" else 1  # the subcommand, then the flag, then the rest
        got = engine_options(parser.parse_args([*command[:cut], *argv_for(s.keyword), *command[cut:]]))
        want = SAMPLES[s.keyword][0] if s.keyword == "speculative_config" else SAMPLES[s.keyword][1]
        want = {"quantization": "fp8", "logits_processors": None}.get(s.keyword, want)
        assert got[s.keyword] == want, (command, s.flag)


@pytest.mark.unit
def test_create_takes_every_default_explicitly() -> None:
    """Passing each default as a keyword (what the CLI does) builds what passing nothing builds."""
    assert EngineConfig.create(**options.defaults(ENGINE_SECTIONS)) == EngineConfig.create()


@pytest.mark.unit
@pytest.mark.parametrize("keyword", [s.keyword for s in SETTINGS if s.keyword != "model"])
def test_each_keyword_lands_in_its_field(keyword: str, monkeypatch: pytest.MonkeyPatch) -> None:
    setting = next(s for s in SETTINGS if s.keyword == keyword)
    value = SAMPLES[keyword][1]
    extra: dict[str, object] = {}
    if keyword == "logits_processors":  # a processor must load: the test plugin's
        monkeypatch.syspath_prepend(str(PLUGINS))
    if keyword == "data_parallel_rank":
        extra["data_parallel_size"] = 2
    if keyword in ("nnodes", "node_rank"):  # several nodes need the head's address and whole ranks each
        extra |= {"nnodes": 2, "master_addr": "10.0.0.1", "master_port": 29511, "tensor_parallel_size": 2}
        extra.pop(keyword, None)
    if keyword == "pp_layer_partition":
        extra["pipeline_parallel_size"] = 2
    if keyword == "max_num_active_seqs":
        extra["max_num_seqs"] = 8
    if keyword == "lora_modules":
        extra["enable_lora"] = True
    if keyword == "speculative_config":
        config = EngineConfig.create(speculative_config=SAMPLES[keyword][0])
        assert config.speculative is not None and config.speculative.num_speculative_tokens == 2
        assert not config.scheduler.async_scheduling  # verification needs each step's tokens
        return
    text = SAMPLES[keyword][0]
    given = value if keyword != "quantization" else text  # the alias, as a user writes it
    config = EngineConfig.create(**{keyword: given}, **extra)
    section = {"model": config.model, "engine": config, "request limits": config.limits}.get(setting.section)
    if section is None:
        section = getattr(config, setting.section)
    got = getattr(section, setting.field)
    if keyword == "logits_processors":  # after the installed entry points
        got = got[-1:]
    assert got == value


@pytest.mark.unit
def test_derived_defaults_come_from_the_model() -> None:
    config = EngineConfig.create(max_model_len=1000)
    assert config.model.max_model_len == 1000
    assert config.scheduler.max_num_batched_tokens == 2048  # the context, clamped to [2048, 8192]
    assert config.scheduler.long_prefill_token_threshold == 40  # 4% of the context
    assert config.model.eos_token_ids  # read from the checkpoint, once


@pytest.mark.unit
def test_draft_model_is_read_and_checked() -> None:
    spec = {"method": "draft_model", "model": str(default_draft_dir()), "num_speculative_tokens": 2}
    config = EngineConfig.create(speculative_config=spec)
    assert config.speculative is not None and config.speculative.draft is not None


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"scheduling_policy": "lifo"}, "unknown scheduling_policy 'lifo'; choose one of fcfs, priority"),
        ({"load_format": "tape"}, "unknown load_format 'tape'"),
        ({"dtype": "int3"}, "unknown dtype 'int3'"),
        ({"quantization": "gptq"}, "unknown quantization method 'gptq'"),
        ({"max_num_seq": 3}, "unknown engine option 'max_num_seq'; did you mean 'max_num_seqs'?"),
        ({"max_n": 0}, "max_n must be a positive integer"),
        ({"request_limits": {"max_x": 1}}, "unknown request limit 'max_x'"),
        ({"logits_processors": ("nope",)}, "expected module:Class"),
    ],
)
def test_bad_values_are_one_line_config_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        EngineConfig.create(**kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.unit
def test_request_limits_mapping_and_flat_keywords_compose() -> None:
    config = EngineConfig.create(max_n=5, request_limits={"max_stop_strings": 2})
    assert (config.limits.max_n, config.limits.max_stop_strings) == (5, 2)
    assert dataclasses.replace(config.limits, max_n=128, max_stop_strings=32) == EngineConfig.create().limits


@pytest.mark.e2e
@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--scheduling-policy", "lifo"], "argument --scheduling-policy: invalid choice: 'lifo'"),
        (["generate", "hi", "--max-n", "0"], "--max-n must be a positive integer, got 0"),
    ],
)
def test_cli_refuses_bad_values_in_one_line(argv: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "frontend.cli", *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr


@pytest.mark.unit
def test_serve_help_lists_each_engine_option_once_with_its_group_and_default() -> None:
    text = build_parser("serve")._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for s in SETTINGS:
        if s.option.hidden:
            assert s.flag not in text
            continue
        shown = sum(text.count(f"  {s.flag}{end}") for end in (" ", ", ", "\n"))
        assert shown == 1, s.flag
    for title, _ in ENGINE_SECTIONS:
        assert f"\n{title}:\n" in text
    assert "[256]" in text and "[fcfs]" in text  # defaults are shown


@pytest.mark.unit
def test_llm_refuses_an_unknown_policy_before_building_anything() -> None:
    from coreproc import LLM

    with pytest.raises(ConfigError, match="unknown scheduling_policy 'lifo'; choose one of fcfs, priority"):
        LLM(scheduling_policy="lifo")


@pytest.mark.unit
def test_one_logits_processor_may_be_given_as_a_string(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))
    config = EngineConfig.create(logits_processors="ember_test_plugin:ForceToken")
    assert config.logits_processors[-1] == "ember_test_plugin:ForceToken"
