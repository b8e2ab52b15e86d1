"""The config.json a GGUF file implies: llama.cpp's metadata keys read as transformers' config fields.

Part of the shared base, beside the file reader (coreproc.base.gguf_file): `GGUFFile.hf_config` calls
`hf_config` once per file. Per architecture what llama.cpp reads (or derives) for it: the
hyperparameters and rope under llama.cpp's keys, Gemma's windows, layer patterns, soft caps and
Gemma 3's local rope base,
SmolLM3's NoPE step, Granite's scales. A GGUF architecture or rope variant Ember cannot run is a
ConfigError naming the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coreproc.base.errors import ConfigError

# GGUF architecture -> (transformers class, model_type); Mistral's files say "llama"
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3"),
    "olmo2": ("Olmo2ForCausalLM", "olmo2"),
    "granite": ("GraniteForCausalLM", "granite"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "olmoe": ("OlmoeForCausalLM", "olmoe"),
    "granitemoe": ("GraniteMoeForCausalLM", "granitemoe"),
    "glm4moe": ("Glm4MoeForCausalLM", "glm4_moe"),
}
MIXTRAL = ("MixtralForCausalLM", "mixtral")  # a `llama` file with experts
# mixtures of experts: whether llama.cpp renormalizes the top-k weights (it fixes it per architecture)
MOE_RENORMALIZED = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False, "granitemoe": True}
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's LongRoPE tensors
# Granite's multipliers: GGUF key -> config.json key
GRANITE_SCALES = {
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "attention.scale": "attention_multiplier",
    "logit_scale": "logits_scaling",
}
GEMMA2_SWA_PATTERN = 2  # llama.cpp's: every other layer global
GEMMA2_WINDOW = 4096  # llama.cpp's default window of Gemma 2
GEMMA2_SOFTCAPS = (50.0, 30.0)  # llama.cpp's defaults of Gemma 2's attention and final soft caps
GEMMA3_SWA_PATTERN = 6  # llama.cpp's default: every sixth layer global
GEMMA3_SWA_THETA = 10000.0  # llama.cpp's default rope base of the sliding layers
NO_ROPE_STEP = 4  # SmolLM3: every fourth layer without rotary (llama.cpp's n_no_rope_layer_step)
# `<arch>.<key>` -> config.json key
HPARAMS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
}
REQUIRED = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
ROPE_SCALING = ("linear", "yarn")


def hf_config(
    meta: dict[str, Any],
    tensor_names: tuple[str, ...],
    source: str,
    factors: dict[str, list[float]] | None = None,
) -> dict[str, Any]:
    """config.json keys from GGUF metadata (as transformers 4 and 5 both read them); ConfigError for an
    architecture or a rope variant Ember cannot run. `factors`: the values of the ROPE_FACTORS tensors
    the file holds (Phi-3's LongRoPE)."""
    arch = str(meta.get("general.architecture", "(none)"))
    if arch not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ConfigError(f"{source}: unsupported GGUF architecture {arch!r}; supported: {supported}")
    missing = [f"{arch}.{k}" for k in REQUIRED if f"{arch}.{k}" not in meta]
    if missing:
        raise ConfigError(f"{source}: GGUF metadata lacks {', '.join(missing)}")
    cls, model_type = MIXTRAL if arch == "llama" and meta.get("llama.expert_count") else ARCHITECTURES[arch]
    cfg: dict[str, Any] = {"architectures": [cls], "model_type": model_type}
    for key, hf_key in HPARAMS.items():
        if f"{arch}.{key}" in meta:
            cfg[hf_key] = meta[f"{arch}.{key}"]
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg.setdefault("max_position_embeddings", 2048)
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size", len(tokens) if isinstance(tokens, Sequence) else None)
    if vocab is None:
        raise ConfigError(f"{source}: GGUF metadata gives no vocabulary size")
    cfg["vocab_size"] = vocab
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim and arch not in ("phi3", "glm4moe"):
        raise ConfigError(f"{source}: partial rotary embeddings ({rotary} of {head_dim}) are not supported")
    if "rope_freqs.weight" in tensor_names:
        raise ConfigError(f"{source}: per-frequency rope factors (rope_freqs) are not supported")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0)}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", *ROPE_SCALING):
        raise ConfigError(f"{source}: rope scaling {scaling!r} is not supported")
    if scaling in ROPE_SCALING:
        rope |= {"rope_type": scaling, "factor": meta[f"{arch}.rope.scaling.factor"]}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            rope["original_max_position_embeddings"] = original
    cfg["rope_theta"] = rope["rope_theta"]  # transformers 4 reads this and rope_scaling
    cfg["rope_parameters"] = rope  # transformers 5 reads this
    if rope["rope_type"] != "default":
        cfg["rope_scaling"] = rope
    cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
    cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    cfg["hidden_act"] = "silu"
    cfg["torch_dtype"] = cfg["dtype"] = _stored_dtype(meta)
    cfg |= _family_config(arch, meta, cfg, rope)
    if arch == "phi3":
        cfg |= _phi3(meta, cfg, rope, rotary / head_dim, factors or {}, source)
    if arch == "glm4moe":
        cfg |= _glm4moe(meta, cfg, rope, rotary / head_dim, tensor_names)
    elif meta.get(f"{arch}.expert_count"):
        cfg |= _experts(arch, meta, cfg)
    return cfg


def _experts(arch: str, meta: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """A mixture of experts as llama.cpp reads one: the counts, the expert (and shared expert) sizes,
    every layer sparse, the top-k renormalized as llama.cpp does for the architecture."""
    if arch not in MOE_RENORMALIZED:
        raise ConfigError(f"{arch} files with experts are not supported")
    count, used = int(meta[f"{arch}.expert_count"]), int(meta[f"{arch}.expert_used_count"])
    size = int(meta.get(f"{arch}.expert_feed_forward_length", cfg["intermediate_size"]))
    out: dict[str, Any] = {
        "num_experts": count,
        "num_local_experts": count,
        "num_experts_per_tok": used,
        "moe_intermediate_size": size,
        "norm_topk_prob": MOE_RENORMALIZED[arch],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if arch == "granitemoe" and meta.get(f"{arch}.expert_shared_feed_forward_length"):
        raise ConfigError("granitemoe files with a shared expert (GraniteMoeShared) are not supported")
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = int(meta[f"{arch}.expert_shared_feed_forward_length"])
    return out


def _glm4moe(
    meta: dict[str, Any], cfg: dict[str, Any], rope: dict, rotary: float, names: tuple[str, ...]
) -> dict[str, Any]:
    """GLM-4.5 as llama.cpp's converter writes it: DeepSeek-V3's sigmoid routing (one group), shared
    experts, dense leading layers, partial rotary, q/k norms where the file has them, and the
    multi-token-prediction layers counted in `block_count` (not run here)."""
    arch = "glm4moe"
    nextn = int(meta.get(f"{arch}.nextn_predict_layers", 0))
    rope["partial_rotary_factor"] = rotary
    return {
        "num_hidden_layers": int(meta[f"{arch}.block_count"]) - nextn,
        "num_nextn_predict_layers": nextn,
        "n_routed_experts": int(meta[f"{arch}.expert_count"]),
        "num_experts_per_tok": int(meta[f"{arch}.expert_used_count"]),
        "moe_intermediate_size": int(meta[f"{arch}.expert_feed_forward_length"]),
        "n_shared_experts": int(meta.get(f"{arch}.expert_shared_count", 0)),
        "first_k_dense_replace": int(meta.get(f"{arch}.leading_dense_block_count", 0)),
        "routed_scaling_factor": float(meta.get(f"{arch}.expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", False)),
        "n_group": 1,
        "topk_group": 1,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in names,
        "partial_rotary_factor": rotary,
    }


def swa_layer_types(layers: int, pattern: int) -> list[str]:
    """llama.cpp's sliding-window pattern as transformers' `layer_types`: in each run of `pattern`
    layers the last is global, the others slide (Gemma 3's 5:1 is pattern 6)."""
    return ["sliding_attention" if i % pattern < pattern - 1 else "full_attention" for i in range(layers)]


def no_rope_layers(layers: int) -> list[int]:
    """SmolLM3's `no_rope_layers` as llama.cpp fixes them: 0 (no rotary) on every NO_ROPE_STEP-th layer."""
    return [int((i + 1) % NO_ROPE_STEP != 0) for i in range(layers)]


def _family_config(arch: str, meta: dict[str, Any], cfg: dict[str, Any], rope: dict) -> dict[str, Any]:
    """What an architecture beyond Llama's shape adds, as llama.cpp reads its files."""
    layers = int(cfg["num_hidden_layers"])
    if arch == "gemma2":
        gemma = _gemma(arch, meta, cfg, GEMMA2_SWA_PATTERN, GEMMA2_WINDOW, big_layers=46)
        for kind, default in zip(("attn", "final"), GEMMA2_SOFTCAPS, strict=True):
            gemma[f"{kind}_logit_softcapping"] = meta.get(f"{arch}.{kind}_logit_softcapping", default)
        return gemma
    if arch == "gemma3":
        gemma = _gemma(arch, meta, cfg, GEMMA3_SWA_PATTERN, None, big_layers=62)
        local = {
            "rope_type": "default",
            "rope_theta": meta.get(f"{arch}.rope.freq_base_swa", GEMMA3_SWA_THETA),
        }
        return gemma | {
            "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping"),
            "rope_local_base_freq": local["rope_theta"],  # transformers 4
            "rope_parameters": {"sliding_attention": local, "full_attention": rope},
        }
    if arch == "smollm3":
        return {"no_rope_layers": no_rope_layers(layers)}
    if arch in ("granite", "granitemoe"):
        return {hf: meta[f"{arch}.{key}"] for key, hf in GRANITE_SCALES.items() if f"{arch}.{key}" in meta}
    return {}


def _phi3(
    meta: dict[str, Any], cfg: dict[str, Any], rope: dict, rotary: float, factors: dict, source: str
) -> dict[str, Any]:
    """Phi-3 as llama.cpp's converter writes it: a window on every layer (0: none), partial rotary,
    LongRoPE's factors as tensors beside the trained context."""
    window = meta.get("phi3.attention.sliding_window") or None
    out: dict[str, Any] = {"sliding_window": window}
    if rotary != 1.0:
        rope["partial_rotary_factor"] = out["partial_rotary_factor"] = rotary
    if factors:
        if sorted(factors) != sorted(ROPE_FACTORS):
            raise ConfigError(f"{source}: LongRoPE needs both {' and '.join(ROPE_FACTORS)}")
        original = meta.get("phi3.rope.scaling.original_context_length", cfg["max_position_embeddings"])
        rope |= {
            "rope_type": "longrope",
            "long_factor": factors["rope_factors_long.weight"],
            "short_factor": factors["rope_factors_short.weight"],
            "original_max_position_embeddings": original,
        }
        out |= {"rope_scaling": rope, "original_max_position_embeddings": original}
    return out


def _gemma(
    arch: str, meta: dict[str, Any], cfg: dict[str, Any], pattern: int, window: int | None, big_layers: int
) -> dict[str, Any]:
    """What Gemma 2 and 3 share as llama.cpp reads them: GeGLU, the sliding pattern and window, and
    queries scaled by head_dim ** -0.5 (hidden / heads for the 27B, of `big_layers` layers)."""
    layers = int(cfg["num_hidden_layers"])
    pattern = int(meta.get(f"{arch}.attention.sliding_window_pattern", pattern))
    window = meta.get(f"{arch}.attention.sliding_window", window)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if layers == big_layers else head_dim
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": swa_layer_types(layers, pattern) if window else ["full_attention"] * layers,
        "sliding_window": window,
        "query_pre_attn_scalar": scalar,
    }


def _stored_dtype(meta: dict[str, Any]) -> str:
    """The dtype "auto" computes in: the file's float type, bfloat16 for quantized files."""
    file_type = meta.get("general.file_type")  # llama.cpp's LlamaFileType: 0 all F32, 1 mostly F16, 32 BF16
    return {0: "float32", 1: "float16", 32: "bfloat16"}.get(file_type, "bfloat16")  # type: ignore[arg-type]
