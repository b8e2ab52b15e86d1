"""Write a Hugging Face folder as a GGUF file, the way llama.cpp's converter lays one out.

A repository script for tests and experiments (not installed): `python -m tools.hf_to_gguf MODEL_DIR
OUT.gguf [--type Q8_0]`. Metadata under llama.cpp's keys (hyperparameters, the byte-level BPE
tokenizer's tokens, merges, token types, special ids and chat template), tensors under llama.cpp's
names, q/k rows permuted where llama.cpp's converter permutes them (Llama and the models derived from
it), Gemma's norm weights stored as 1 + w, the families' own keys (Gemma 3's window, Granite's
multipliers); Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3, SmolLM3, OLMo 2, Granite, Phi-3 and the
mixtures of experts (Mixtral, Qwen2/3-MoE, OLMoE, Granite-MoE, GLM-4.5) folders; 2-D weights
quantized with the `gguf` package's reference quantizer (norms and biases stay F32). The `gguf`
package writes the file (`GGUFWriter`). Only types that package can quantize: F32, F16, BF16, Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter, quants
from safetensors.torch import load_file

from coreproc.base.gguf_config import (
    GEMMA3_SWA_THETA,
    GRANITE_SCALES,
    MOE_RENORMALIZED,
    no_rope_layers,
    swa_layer_types,
)
from workers.gguf.weights import NORM_SHIFTED, PERMUTED, TOP, block_names

ARCHS = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "smollm3": "smollm3",
    "olmo2": "olmo2",
    "granite": "granite",
    "phi3": "phi3",
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
    "granitemoe": "granitemoe",
    "glm4_moe": "glm4moe",
}
MIXTRAL_NAMES = (
    ("block_sparse_moe.", "mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)
GRANITE_NAMES = (
    ("block_sparse_moe.router.layer.", "mlp.gate."),
    ("block_sparse_moe.output_linear.", "mlp.experts.down_proj."),
)
GLM_NAMES = (  # GLM-4.5's shared experts and router bias under the names `block_names` maps
    (".mlp.shared_experts.", ".mlp.shared_expert."),
    (".mlp.gate.e_score_correction_bias", ".mlp.gate.e_score_correction.bias"),
)
GRANITE_GATE_UP = re.compile(r"^(.*)\.block_sparse_moe\.input_linear\.weight$")  # [E, 2I, H], gate first
EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")
WRITABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
CONTROL, NORMAL = 3, 1


def gguf_name(name: str, arch: str = "llama") -> str:
    """llama.cpp's name of a transformers tensor (the inverse of `workers.gguf.weights.hf_name`)."""
    stem, _, suffix = name.rpartition(".")
    for gguf, hf in TOP.items():
        if stem == hf:
            return f"{gguf}.{suffix}"
    parts = stem.split(".", 3)  # model, layers, N, rest
    for gguf, hf in block_names(arch).items():
        if len(parts) == 4 and parts[3] == hf:
            return f"blk.{parts[2]}.{gguf}.{suffix}"
    raise ValueError(f"no GGUF name for tensor {name}")


def permute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order: each head's rotary halves interleaved (undone by Ember's loader)."""
    shape = weight.shape
    return weight.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).transpose(1, 2).reshape(shape)


def _tokenizer_metadata(writer: GGUFWriter, model_dir: Path) -> None:
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    special = set()
    for token in spec["added_tokens"]:
        vocab[token["content"]] = token["id"]
        if token["special"]:
            special.add(token["id"])
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids must be dense"
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if i in special else NORMAL for i in range(len(tokens))])
    writer.add_token_merges(merges)
    for key, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
        ("pad_token", writer.add_pad_token_id),
    ):
        if isinstance(config.get(key), str):
            add(vocab[config[key]])
    writer.add_add_bos_token(bool(config.get("add_bos_token", False)))
    if config.get("chat_template"):
        writer.add_chat_template(config["chat_template"])


def _family_metadata(writer: GGUFWriter, arch: str, cfg: dict, head_dim: int) -> None:
    """The keys llama.cpp reads for the families beyond Llama's shape; ValueError for a config that
    llama.cpp would run differently (it derives what it does not read)."""
    if arch in ("gemma2", "gemma3"):
        if cfg.get("query_pre_attn_scalar", head_dim) != head_dim:  # llama.cpp derives the scale
            raise ValueError(
                "llama.cpp scales Gemma's queries by head_dim ** -0.5: set query_pre_attn_scalar"
            )
        kinds = cfg.get("layer_types") or []
        if "sliding_attention" in kinds:
            writer.add_sliding_window(cfg["sliding_window"])
            pattern = kinds.index("full_attention") + 1 if "full_attention" in kinds else len(kinds) + 1
            if kinds != swa_layer_types(len(kinds), pattern):
                raise ValueError("Gemma's layer_types must repeat one pattern (k sliding, then one global)")
            writer.add_uint32(f"{arch}.attention.sliding_window_pattern", pattern)
        if cfg.get("attn_logit_softcapping"):
            writer.add_attn_logit_softcapping(float(cfg["attn_logit_softcapping"]))
        if cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    if arch == "gemma3":
        local = (cfg.get("rope_parameters") or {}).get("sliding_attention", {})
        writer.add_float32(f"{arch}.rope.freq_base_swa", float(local.get("rope_theta", GEMMA3_SWA_THETA)))
    if arch == "smollm3":
        if cfg.get("no_rope_layers") != no_rope_layers(cfg["num_hidden_layers"]):
            raise ValueError("llama.cpp's SmolLM3 has no rotary on every fourth layer, exactly")
    if arch in ("granite", "granitemoe"):
        for key, hf in GRANITE_SCALES.items():
            writer.add_float32(f"{arch}.{key}", float(cfg[hf]))
    if arch == "phi3":  # as llama.cpp's converter: 0 for no window, LongRoPE's factors as tensors
        writer.add_sliding_window(int(cfg.get("sliding_window") or 0))
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type") in ("longrope", "su"):
            writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
            for which in ("long", "short"):
                factors = np.asarray(rope[f"{which}_factor"], dtype=np.float32)
                writer.add_tensor(f"rope_factors_{which}.weight", factors)


def _glm4moe_metadata(writer: GGUFWriter, cfg: dict) -> None:
    """GLM-4.5's routing as llama.cpp's converter writes it (sigmoid scores, one expert group)."""
    if int(cfg.get("n_group") or 1) != 1 or int(cfg.get("topk_group") or 1) != 1:
        raise ValueError("llama.cpp's glm4moe routes within one expert group: n_group and topk_group 1")
    writer.add_expert_count(int(cfg["n_routed_experts"]))
    writer.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    writer.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    writer.add_expert_shared_count(int(cfg["n_shared_experts"]))
    writer.add_leading_dense_block_count(int(cfg["first_k_dense_replace"]))
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(float(cfg["routed_scaling_factor"]))
    writer.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))


def _expert_metadata(writer: GGUFWriter, arch: str, cfg: dict) -> None:
    """llama.cpp's keys of a mixture of experts (Mixtral's `llama` files included)."""
    if arch == "glm4moe":
        return _glm4moe_metadata(writer, cfg)
    count = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not count:
        return
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
        raise ValueError("llama.cpp's MoE files have experts on every layer: no mlp_only_layers, step 1")
    # Mixtral and Granite always renormalize (Granite: a softmax over the top-k logits)
    renormalized = bool(cfg.get("norm_topk_prob", arch in ("llama", "granitemoe")))
    if renormalized != MOE_RENORMALIZED[arch]:
        raise ValueError(f"llama.cpp's {arch} experts have norm_topk_prob={MOE_RENORMALIZED[arch]} fixed")
    writer.add_expert_count(int(count))
    writer.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    if "moe_intermediate_size" in cfg:
        writer.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(int(cfg["shared_expert_intermediate_size"]))


def _stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with each layer's experts stacked into one [E, rows, cols] tensor per
    projection (`model.layers.N.mlp.experts.gate_proj.weight`, llama.cpp's `ffn_gate_exps`)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        if granite := GRANITE_GATE_UP.match(name):  # Granite's experts come stacked, gate and up in one
            gate, up = tensor.chunk(2, dim=1)
            out[f"{granite[1]}.mlp.experts.gate_proj.weight"] = gate
            out[f"{granite[1]}.mlp.experts.up_proj.weight"] = up
            continue
        for old, new in GRANITE_NAMES + MIXTRAL_NAMES if "block_sparse_moe" in name else GLM_NAMES:
            name = name.replace(old, new)
        found = EXPERT.match(name)
        if found is None:
            out[name] = tensor
        else:
            experts.setdefault(f"{found[1]}.{found[3]}.weight", {})[int(found[2])] = tensor
    for name, parts in experts.items():
        out[name] = torch.stack([parts[e] for e in sorted(parts)])
    return out


def write_gguf(model_dir: str | Path, out: str | Path, qtype: str = "F32") -> Path:
    """Write `model_dir` as the GGUF file `out` with 2-D weights in `qtype`; returns `out`."""
    model_dir, out = Path(model_dir), Path(out)
    if qtype not in WRITABLE:
        raise ValueError(f"cannot write GGUF type {qtype}; choose one of {', '.join(WRITABLE)}")
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = ARCHS[cfg["model_type"]]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0)}
    rope = rope.get("full_attention", rope)  # Gemma 3's per-kind parameters: the global layers' here
    writer = GGUFWriter(str(out), arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope_dims = int(
        head_dim * float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    )
    writer.add_rope_dimension_count(rope_dims)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type({"F32": 0, "F16": 1, "BF16": 32}.get(qtype, 7))
    _family_metadata(writer, arch, cfg, head_dim)
    _expert_metadata(writer, arch, cfg)
    _tokenizer_metadata(writer, model_dir)
    target = GGMLQuantizationType[qtype]
    block = GGML_QUANT_SIZES[target][0]
    state = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    for name, tensor in _stacked_experts(state).items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        tensor = tensor.float()
        if arch in PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = permute_rotary(tensor, heads)
        elif arch in PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = permute_rotary(tensor, kv_heads)
        if arch in NORM_SHIFTED and name.endswith("norm.weight"):
            tensor = tensor + 1.0
        if name.endswith("shared_expert_gate.weight"):
            tensor = tensor.reshape(-1)  # llama.cpp's ffn_gate_inp_shexp is a vector
        array = tensor.numpy()
        if (
            array.ndim in (2, 3)
            and array.shape[-1] % block == 0
            and qtype != "F32"
            and "mlp.gate." not in name
        ):
            writer.add_tensor(gguf_name(name, arch), quants.quantize(array, target), raw_dtype=target)
        else:
            writer.add_tensor(gguf_name(name, arch), np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--type", default="F32", choices=WRITABLE)
    args = parser.parse_args()
    print(write_gguf(args.model_dir, args.out, args.type))


if __name__ == "__main__":
    main()
