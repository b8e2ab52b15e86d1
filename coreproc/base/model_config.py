"""What a checkpoint says: `ModelConfig`, read once from config.json or a GGUF file's metadata (and EOS).

Part of the shared base (coreproc.base.config builds the rest of the engine's configuration around it);
`read_draft` reads a speculative draft checkpoint and checks it against the target.
The architectures and quantization methods named here are those the workers build
(workers.models, workers.quant; tests/test_layout.py keeps the lists equal).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from coreproc.base.errors import ConfigError
from coreproc.base.gguf_file import find_gguf, open_gguf
from coreproc.base.host import default_model_dir
from coreproc.base.options import option

log = logging.getLogger("ember.config")

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
# The one registry of architectures: the Hugging Face `architectures` name -> "module:Class" of its
# model (in workers.models, which imports torch: named, not imported). The config accepts these names,
# workers.models.resolve imports the class, the preload zygote imports the modules ahead.
ARCHITECTURES: dict[str, str] = {
    "Gemma2ForCausalLM": "workers.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "workers.models.gemma3:Gemma3ForCausalLM",
    "Glm4MoeForCausalLM": "workers.models.glm4_moe:Glm4MoeForCausalLM",
    "GraniteForCausalLM": "workers.models.granite:GraniteForCausalLM",
    "GraniteMoeForCausalLM": "workers.models.granite_moe:GraniteMoeForCausalLM",
    "LlamaForCausalLM": "workers.models.llama:LlamaForCausalLM",
    "LlavaForConditionalGeneration": "workers.models.llava:LlavaForConditionalGeneration",
    "MistralForCausalLM": "workers.models.mistral:MistralForCausalLM",
    "MixtralForCausalLM": "workers.models.mixtral:MixtralForCausalLM",
    "Olmo2ForCausalLM": "workers.models.olmo2:Olmo2ForCausalLM",
    "OlmoeForCausalLM": "workers.models.olmoe:OlmoeForCausalLM",
    "Phi3ForCausalLM": "workers.models.phi3:Phi3ForCausalLM",
    "Qwen2ForCausalLM": "workers.models.qwen2:Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM": "workers.models.qwen_moe:Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM": "workers.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "workers.models.qwen_moe:Qwen3MoeForCausalLM",
    "SmolLM3ForCausalLM": "workers.models.smollm3:SmolLM3ForCausalLM",
}
# vision-language architectures: config.json nests the language model's config under `text_config`
MULTIMODAL_ARCHITECTURES = ("LlavaForConditionalGeneration",)
QUANTIZATION_METHODS = ("fp8_per_tensor", "int8", "int4")  # built by workers.quant
QUANTIZATION_ALIASES = {"fp8": "fp8_per_tensor"}
MODEL_HELP = "checkpoint: a Hugging Face folder or a .gguf file (default: the bundled model)"


def resolve_quantization(name: str | None) -> str | None:
    """The canonical method name (None: no quantization); ConfigError for unknown names."""
    if name is None or name in ("", "none"):
        return None
    if name in QUANTIZATION_ALIASES:
        log.warning("--quantization %s is an alias for %s", name, QUANTIZATION_ALIASES[name])
        return QUANTIZATION_ALIASES[name]
    if name not in QUANTIZATION_METHODS:
        supported = ", ".join([*QUANTIZATION_METHODS, *QUANTIZATION_ALIASES])
        raise ConfigError(
            f"unknown quantization method {name!r}; supported: {supported}", option="quantization"
        )
    return name


def one_of(value: Any, allowed: tuple[str, ...], what: str, option: str | None = None) -> None:
    """ConfigError unless `value` is allowed (`option`: the setting's keyword, when `what` names one)."""
    if value not in allowed:
        raise ConfigError(f"unknown {what} {value!r}; choose one of {', '.join(allowed)}", option=option)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The checkpoint and what we read from its config.json or GGUF metadata (read once, here)."""

    model: str = option(
        MODEL_HELP,
        derived=True,
        dest="model_flag",
        metavar="PATH",
    )
    dtype: Dtype = option(
        "compute dtype; auto: the checkpoint's, or float32 on a CPU that would only emulate it", "auto"
    )
    max_model_len: int = option("context length (default: the model's max_position_embeddings)", derived=True)
    seed: int = option("seed of sampling and random weights", 0)
    quantization: str | None = option(
        "quantize weights while loading: fp8_per_tensor (alias fp8), int8, int4",
        None,
        short="-q",
        choices=(*QUANTIZATION_METHODS, *QUANTIZATION_ALIASES, "none"),
    )
    revision: str | None = option("your name for this checkpoint version (part of the cache key)", None)
    architecture: str
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    tokenizer: str
    eos_token_ids: tuple[int, ...] = ()  # generation_config.json's, then the tokenizer's EOS token
    image_token_id: int | None = None  # a vision-language model: the token each image patch stands on

    @property
    def is_multimodal(self) -> bool:
        return self.image_token_id is not None

    @classmethod
    def from_dir(
        cls,
        model: str | os.PathLike | None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        device: str = "cpu",
        quantization: str | None = None,
        revision: str | None = None,
    ) -> ModelConfig:
        """Read config.json, or the metadata of a GGUF file (`model` names it, or a folder holding only
        it). dtype "auto" takes the checkpoint's, except that on a CPU that would only
        emulate it (`cpu_has_fast_half`) it computes in float32 (emulated bf16 is many times slower)."""
        from coreproc.base.host import cpu_has_fast_half

        path = Path(model) if model is not None else default_model_dir()
        gguf_path = find_gguf(path)
        if gguf_path is not None:
            path, hf, eos = gguf_path, *_read_gguf(gguf_path)
        else:
            hf, eos = _read_folder(path)
        cfg_file = path if gguf_path is not None else path / "config.json"
        quantization = resolve_quantization(quantization)
        if hf.get("quantization_config"):
            method = hf["quantization_config"].get("quant_method", "unknown")
            raise ConfigError(f"{path} is a pre-quantized checkpoint ({method}); Ember does not load those")
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or '(none given)'} in {cfg_file}; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        one_of(dtype, DTYPES, "dtype", option="dtype")
        image_token_id = None
        if arch in MULTIMODAL_ARCHITECTURES:
            image_token_id = hf.get("image_token_index", hf.get("image_token_id"))
            if not isinstance(image_token_id, int):
                raise ConfigError(f"{cfg_file} names no image_token_index for its {arch}")
            hf = {"dtype": hf.get("dtype") or hf.get("torch_dtype"), **hf.get("text_config", {})}
        if dtype == "auto":
            dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").replace("torch.", "")
            if dtype not in DTYPES:
                dtype = "float32"
            if dtype != "float32" and device == "cpu" and not cpu_has_fast_half(dtype):
                dtype = "float32"
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        limit = int(hf.get("max_position_embeddings") or 2048)
        short = longrope_limit(hf)
        if max_model_len is None and short is not None and short < limit:
            log.warning(
                "%s: LongRoPE runs its short factors here: max_model_len %d, not %d", path, short, limit
            )
            max_model_len = short
        if max_model_len is None:
            max_model_len = limit
        elif short is not None and max_model_len > short:
            raise ConfigError.bad(
                "max_model_len",
                f"{max_model_len} needs LongRoPE's long factors, which this version does not run; "
                f"give at most {short}",
            )
        elif max_model_len < 2:
            raise ConfigError.bad("max_model_len", f"must be at least 2, got {max_model_len}")
        elif max_model_len > limit:
            raise ConfigError.bad(
                "max_model_len", f"{max_model_len} exceeds the model's max_position_embeddings {limit}"
            )
        return cls(
            model=str(path),
            architecture=arch,
            dtype=dtype,  # type: ignore[arg-type]  # checked against DTYPES above
            max_model_len=max_model_len,
            vocab_size=int(hf["vocab_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            hidden_size=hidden,
            tokenizer=str(path),
            eos_token_ids=tuple(eos),
            seed=seed,
            quantization=quantization,
            revision=revision,
            image_token_id=image_token_id,
        )


def longrope_limit(hf: dict[str, Any]) -> int | None:
    """The context LongRoPE (Phi-3's `longrope`, once `su`) was trained at, where a config uses it:
    Ember runs its short factors only, so no longer context (None: not LongRoPE)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) not in ("longrope", "su"):
        return None
    return int(rope.get("original_max_position_embeddings") or hf["original_max_position_embeddings"])


def refuse_unsupported(model: ModelConfig, tensor_parallel_size: int) -> None:
    """A combination an architecture cannot run yet, refused at start in one line naming both."""
    if model.architecture in ("Olmo2ForCausalLM", "OlmoeForCausalLM") and tensor_parallel_size > 1:
        raise ConfigError(
            f"{model.architecture} cannot run with tensor parallelism in this version (its q/k norms span "
            f"all heads), got tensor_parallel_size={tensor_parallel_size}",
            option="tensor_parallel_size",
        )


def read_draft(path: str | None, target: ModelConfig, tensor_parallel_size: int, device: str) -> ModelConfig:
    """The draft checkpoint that `speculative_config` names, read with the target's dtype and context
    and checked against it: a text model, one worker, the same vocabulary."""
    if target.is_multimodal:  # the draft would read image placeholders as text tokens
        raise ConfigError(
            "a draft model (speculative_config) cannot speculate for a vision-language model; use ngram",
            option="speculative_config",
        )
    if tensor_parallel_size != 1:
        raise ConfigError(
            f"a draft model (speculative_config) needs tensor_parallel_size=1 in this version, "
            f"got {tensor_parallel_size}",
            option="speculative_config",
            also=("tensor_parallel_size",),
        )
    draft = ModelConfig.from_dir(path, target.dtype, target.max_model_len, target.seed, device)
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(
            f"the draft model's vocabulary ({draft.vocab_size}) differs from the target's "
            f"({target.vocab_size}); a draft (speculative_config) must share the target's tokenizer",
            option="speculative_config",
        )
    return draft


def _read_folder(path: Path) -> tuple[dict[str, Any], list[int]]:
    """A Hugging Face folder's config.json and EOS ids (generation_config.json's, then the tokenizer's)."""
    from coreproc.base.tokenizer import eos_token_ids, load_tokenizer

    if not path.is_dir():
        raise ConfigError(f"model directory not found: {path}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{path} has no config.json (is it a Hugging Face checkpoint folder?)")
    if not any(path.glob("*.safetensors")):
        raise ConfigError(f"{path} holds no *.safetensors weights (nor one .gguf file)")
    try:
        return json.loads(cfg_file.read_text()), eos_token_ids(str(path), load_tokenizer(str(path)))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _read_gguf(path: Path) -> tuple[dict[str, Any], list[int]]:
    """A GGUF file's implied config.json and EOS ids; ConfigError for tensor types Ember cannot read."""
    from coreproc.base.gguf_tokenizer import gguf_eos_token_ids

    gguf = open_gguf(path)
    gguf.check_types()
    try:
        return gguf.hf_config, gguf_eos_token_ids(gguf.metadata)
    except ValueError as e:
        raise ConfigError(str(e)) from None
