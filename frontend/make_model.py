"""Build small, deterministic, randomly initialised Hugging Face checkpoints for Ember to load.

``build_checkpoint`` constructs a real transformers model (each of `ARCHS`: Llama, Gemma 3, ...) from a
size preset plus overrides, seeds its weights, and saves a complete offline-loadable folder:
config.json, safetensors weights (sharded on request), generation_config.json and a BPE tokenizer
trained on the local standard library. The CLI is ``python -m frontend.make_model OUT --arch llama``;
``--arch llava`` builds `frontend.make_llava`'s image-and-text checkpoint.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from coreproc.base.errors import ConfigError
from coreproc.base.gguf_config import GEMMA3_SWA_PATTERN, GEMMA3_SWA_THETA, swa_layer_types
from frontend.tokenizer_train import save_hf_tokenizer, special_token_ids, train_tokenizer

ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
}
MOE_ARCHS = ("glm4_moe", "granitemoe", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe")
MOE_EXPERTS, MOE_TOP_K = 6, 2  # the MoE archs' defaults (extra_config changes them)
ROUTER_SCALE = 8.0  # router weights times this: decisive routing, so bf16 picks transformers' experts
_PRESET_FIELDS = ("vocab", "hidden", "layers", "heads", "kv_heads", "intermediate", "max_pos", "shard")
PRESETS: dict[str, dict[str, Any]] = {
    name: dict(zip(_PRESET_FIELDS, values))
    for name, values in {
        # vocab, hidden, layers, heads, kv_heads, intermediate, max_pos, max_shard_size
        "tiny": (512, 64, 2, 4, 2, 128, 1024, None),  # ~0.1M params: tests
        "small": (16384, 512, 8, 8, 4, 1536, 2048, None),  # 42M untied / 34M tied
        "medium": (32000, 1024, 10, 16, 4, 2816, 4096, None),  # 178M untied / 146M tied: CPU benchmarks
        "large": (32000, 2048, 16, 32, 8, 8192, 4096, "1GB"),  # 1.10B untied / 1.04B tied: load time
    }.items()
}
DTYPES = ("float32", "bfloat16", "float16")  # torch is imported only when a model is built
TIED_BY_DEFAULT = frozenset(
    {"qwen2", "qwen3", "gemma2", "gemma3", "smollm3", "granite"}
)  # as their small releases
# Realistic, non-10000 thetas so an engine that hard-codes the RoPE base is caught by comparisons.
ROPE_THETA = {
    "llama": 500000.0,
    "qwen2": 1000000.0,
    "qwen3": 1000000.0,
    "mistral": 1000000.0,
    "gemma2": 10000.0,  # as every Gemma 2
    "gemma3": 1000000.0,  # the global layers'; the sliding ones use llama.cpp's GEMMA3_SWA_THETA
    "smollm3": 2000000.0,
    "olmo2": 500000.0,
    "granite": 10000000.0,
    "phi3": 250000.0,
    "mixtral": 1000000.0,
    "qwen2_moe": 1000000.0,
    "qwen3_moe": 1000000.0,
    "olmoe": 10000.0,
    "granitemoe": 10000000.0,
    "glm4_moe": 1000000.0,
}
# Granite 3's multipliers (2B): far from 1, so an engine that skips one is caught by comparisons
GRANITE_MULTIPLIERS = dict(
    embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=8.0
)


ROUTERS = (
    "mlp.gate.weight",
    "moe.gate.weight",
    "router.layer.weight",
)  # MoE routers, as transformers names them


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _perturb_unit_params(model: Any, seed: int) -> None:
    """Give norm weights and biases seeded non-trivial values (HF inits them to ones and zeros).

    With all-ones norms and zero biases an engine that forgot the qkv bias or q/k norm would still
    match transformers; small random offsets make such bugs visible in numerical comparisons.
    """
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
            elif "norm" in name and param.dim() == 1:  # around its init: 1, or 0 for Gemma's 1 + w norms
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(ROUTERS):
                param.mul_(ROUTER_SCALE)


def make_config(
    arch: str,
    *,
    vocab: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    head_dim: int | None,
    max_pos: int,
    tie: bool,
    dtype: str,
    token_ids: dict[str, int],
    rope_parameters: dict | None,
    sliding_window: int | None,
) -> Any:
    """The transformers config object for ``arch`` with the given shapes and token ids."""
    import transformers

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie,
        bos_token_id=token_ids["bos"],
        eos_token_id=token_ids["eos"],
        pad_token_id=token_ids["pad"],
        head_dim=head_dim if head_dim is not None else hidden // heads,
    )
    rope = rope_parameters if rope_parameters is not None else {"rope_type": "default"}
    kwargs["rope_parameters"] = {"rope_theta": ROPE_THETA[arch], **rope}
    if arch in ("mistral", "phi3"):
        kwargs["sliding_window"] = sliding_window
    elif arch in ("qwen2", "qwen3") and sliding_window is not None:
        # Every layer slides: layers numbered >= max_window_layers use the window.
        kwargs.update(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=0)
    if arch in ("qwen2", "phi3", "olmoe"):
        kwargs.pop("head_dim")  # these always use hidden // heads (Qwen2 has qkv bias by construction)
    head = kwargs.get("head_dim") or hidden // heads
    kwargs.update(_family_kwargs(arch, layers, head, kwargs["rope_parameters"], sliding_window))
    config = getattr(transformers, ARCHS[arch][0])(**kwargs)
    config.architectures = [ARCHS[arch][1]]
    config.dtype = dtype
    return config


def _family_kwargs(
    arch: str, layers: int, head_dim: int, rope: dict, sliding_window: int | None
) -> dict[str, Any]:
    """The config fields of the architectures beyond Llama's shape."""
    if arch == "gemma3":
        local = {"rope_type": "default", "rope_theta": GEMMA3_SWA_THETA}
        return dict(
            layer_types=swa_layer_types(layers, GEMMA3_SWA_PATTERN),
            sliding_window=sliding_window or 512,
            query_pre_attn_scalar=head_dim,  # as Gemma 3's 1B-12B (and what llama.cpp derives)
            rope_parameters={"sliding_attention": local, "full_attention": rope},
        )
    if arch == "gemma2":  # Gemma 2's soft caps, the sliding layers every other one
        return dict(
            layer_types=swa_layer_types(layers, 2),
            sliding_window=sliding_window or 512,
            query_pre_attn_scalar=head_dim,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        )
    if arch == "smollm3" and sliding_window is not None:
        return dict(use_sliding_window=True, sliding_window=sliding_window)
    if arch == "granite":
        return dict(GRANITE_MULTIPLIERS)
    if arch in ("mixtral", "granitemoe"):
        experts = dict(num_local_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K)
        return experts | (GRANITE_MULTIPLIERS if arch == "granitemoe" else {"sliding_window": sliding_window})
    if arch in ("qwen2_moe", "qwen3_moe", "olmoe"):
        experts = dict(num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K, decoder_sparse_step=1)
        if arch == "olmoe":
            return experts
        inter = {"moe_intermediate_size": head_dim * 2, "mlp_only_layers": []}
        return (
            experts
            | inter
            | ({"shared_expert_intermediate_size": head_dim * 3} if arch == "qwen2_moe" else {})
        )
    if arch == "glm4_moe":  # GLM-4.5's routing at small sizes: 2 of 4 groups, the first layer dense
        return dict(
            n_routed_experts=MOE_EXPERTS + 2, num_experts_per_tok=MOE_TOP_K + 1, n_group=4, topk_group=2,
            n_shared_experts=1, moe_intermediate_size=head_dim * 2, first_k_dense_replace=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
            rope_parameters={**rope, "partial_rotary_factor": 0.5},
        )  # fmt: skip
    if arch == "phi3" and "original_max_position_embeddings" in rope:  # LongRoPE's trained context
        return dict(original_max_position_embeddings=rope["original_max_position_embeddings"])
    return {}


def expert_config(arch: str, experts: int | None, top_k: int | None) -> dict[str, Any] | None:
    """The config fields that set a MoE arch's expert count and top-k (None: the defaults)."""
    if experts is None and top_k is None:
        return None
    _check(arch in MOE_ARCHS, f"--experts and --experts-per-token are for {', '.join(MOE_ARCHS)}")
    keys = {"mixtral": "num_local_experts", "granitemoe": "num_local_experts", "glm4_moe": "n_routed_experts"}
    key = keys.get(arch, "num_experts")
    out: dict[str, Any] = {key: experts} if experts is not None else {}
    return out | ({"num_experts_per_tok": top_k} if top_k is not None else {})


def build_checkpoint(
    out_dir: str | Path,
    arch: str,
    size: str = "tiny",
    *,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    vocab: int | None = None,
    head_dim: int | None = None,
    seed: int = 0,
    dtype: str = "float32",
    tie_word_embeddings: bool | None = None,
    max_position_embeddings: int | None = None,
    rope_parameters: dict | None = None,
    sliding_window: int | None = None,
    max_shard_size: str | None = None,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Build a seeded random checkpoint of ``arch`` at ``size`` (explicit arguments win) into ``out_dir``."""
    _check(arch in ARCHS, f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    _check(size in PRESETS, f"unknown size {size!r}; choose from {list(PRESETS)}")
    _check(dtype in DTYPES, f"unknown dtype {dtype!r}; choose from {list(DTYPES)}")
    p = PRESETS[size]
    vocab = vocab if vocab is not None else p["vocab"]
    hidden = hidden if hidden is not None else p["hidden"]
    layers = layers if layers is not None else p["layers"]
    heads = heads if heads is not None else p["heads"]
    kv_heads = kv_heads if kv_heads is not None else min(p["kv_heads"], heads)
    intermediate = intermediate if intermediate is not None else p["intermediate"]
    max_pos = max_position_embeddings if max_position_embeddings is not None else p["max_pos"]
    tie = tie_word_embeddings if tie_word_embeddings is not None else arch in TIED_BY_DEFAULT
    shard = max_shard_size if max_shard_size is not None else p["shard"]
    for name, value in dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads).items():
        _check(value > 0, f"{name} must be positive, got {value}")
    for name, value in dict(intermediate=intermediate, max_position_embeddings=max_pos).items():
        _check(value > 0, f"{name} must be positive, got {value}")
    _check(hidden % heads == 0, f"heads ({heads}) must divide hidden ({hidden})")
    _check(heads % kv_heads == 0, f"kv_heads ({kv_heads}) must divide heads ({heads})")
    _check(head_dim is None or head_dim > 0, f"head_dim must be positive, got {head_dim}")
    _check(
        head_dim is None or arch != "qwen2" or head_dim == hidden // heads,
        f"qwen2 fixes head_dim to hidden // heads ({hidden // heads}); got {head_dim}",
    )
    _check(
        sliding_window is None or sliding_window > 0, f"sliding_window must be positive, got {sliding_window}"
    )
    _check(sliding_window is None or arch != "llama", "llama has no sliding window; use mistral or qwen")

    import transformers

    tok = train_tokenizer(vocab, seed=0)
    _check(tok.get_vocab_size() <= vocab, f"tokenizer has {tok.get_vocab_size()} tokens > vocab {vocab}")
    ids = special_token_ids(tok)
    config = make_config(
        arch,
        vocab=vocab,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        head_dim=head_dim,
        max_pos=max_pos,
        tie=tie,
        dtype=dtype,
        token_ids=ids,
        rope_parameters=rope_parameters,
        sliding_window=sliding_window,
    )
    for key, value in (extra_config or {}).items():  # fields the presets do not set (tests)
        setattr(config, key, value)
    import torch

    torch.manual_seed(seed)
    model = getattr(transformers, ARCHS[arch][1])(config)
    _perturb_unit_params(model, seed)
    model = model.to(getattr(torch, dtype)).eval()
    n_params = sum(t.numel() for t in model.parameters())  # tied weights are counted once
    print(f"{arch}/{size}: {n_params:,} parameters ({n_params / 1e6:.1f}M), dtype {dtype}, tied={tie}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_kwargs: dict[str, Any] = {"max_shard_size": shard} if shard is not None else {}
    model.save_pretrained(out, **save_kwargs)
    gen = transformers.GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=[ids["eos"], ids["im_end"]], pad_token_id=ids["pad"]
    )
    gen.save_pretrained(out)
    save_hf_tokenizer(tok, out, model_max_length=max_pos)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``make-model`` options to ``parser``."""
    parser.add_argument("out_dir", help="folder to write the checkpoint into")
    parser.add_argument("--arch", required=True, choices=[*sorted(ARCHS), "llava"])
    parser.add_argument(
        "--text-arch", default="llama", choices=["llama", "qwen2"], help="llava: its text model (tiny preset)"
    )
    parser.add_argument("--size", default="tiny", choices=list(PRESETS))
    for flag in ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab", "head-dim"):
        parser.add_argument(f"--{flag}", type=int, default=None, help="override the size preset")
    parser.add_argument("--max-position-embeddings", type=int, default=None)
    parser.add_argument("--experts", type=int, default=None, help=f"MoE: experts per layer ({MOE_EXPERTS})")
    parser.add_argument("--experts-per-token", type=int, default=None, help=f"MoE: top-k ({MOE_TOP_K})")
    parser.add_argument("--sliding-window", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--max-shard-size", default=None, help='e.g. "200MB"; shards the safetensors')
    parser.add_argument("--rope-theta", type=float, default=None, help="default rope with this theta")
    parser.add_argument(
        "--tie-word-embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"default: tied for {', '.join(sorted(TIED_BY_DEFAULT))}, untied for the others",
    )


def run(args: argparse.Namespace) -> int:
    """Execute ``make-model`` with parsed ``args``; prints the folder and returns an exit code."""
    rope = None if args.rope_theta is None else {"rope_type": "default", "rope_theta": args.rope_theta}
    try:
        out = (
            build_llava(args)
            if args.arch == "llava"
            else build_checkpoint(
                args.out_dir,
                args.arch,
                args.size,
                layers=args.layers,
                hidden=args.hidden,
                heads=args.heads,
                kv_heads=args.kv_heads,
                intermediate=args.intermediate,
                vocab=args.vocab,
                head_dim=args.head_dim,
                seed=args.seed,
                dtype=args.dtype,
                tie_word_embeddings=args.tie_word_embeddings,
                max_position_embeddings=args.max_position_embeddings,
                rope_parameters=rope,
                sliding_window=args.sliding_window,
                max_shard_size=args.max_shard_size,
                extra_config=expert_config(args.arch, args.experts, args.experts_per_token),
            )
        )
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    files = sorted(p.name for p in out.iterdir())
    print(json.dumps({"out_dir": str(out), "files": files}))
    return 0


def build_llava(args: argparse.Namespace) -> Path:
    """`--arch llava`: the tiny preset of `--text-arch` as the text model of `frontend.make_llava`'s
    checkpoint, with an `<image>` token in its vocabulary; the size options do not apply."""
    from frontend.make_llava import IMAGE_TOKEN, save_llava

    sized = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "head_dim", "rope_theta")
    given = [f"--{k.replace('_', '-')}" for k in sized if getattr(args, k) is not None]
    given += ["--size"] if args.size != "tiny" else []
    given += ["--sliding-window"] if args.sliding_window is not None else []
    if given:
        raise ValueError(f"--arch llava builds the tiny preset; {', '.join(given)} do not apply")
    _check(
        args.text_arch in ("llama", "qwen2"), f"llava's text model is llama or qwen2, not {args.text_arch!r}"
    )
    p = PRESETS["tiny"]
    tok = train_tokenizer(p["vocab"] - 1, seed=0)
    tok.add_special_tokens([IMAGE_TOKEN])
    ids = special_token_ids(tok)
    text = make_config(
        args.text_arch,
        vocab=tok.get_vocab_size(),
        hidden=p["hidden"],
        layers=p["layers"],
        heads=p["heads"],
        kv_heads=p["kv_heads"],
        intermediate=p["intermediate"],
        head_dim=None,
        max_pos=p["max_pos"],
        tie=False,
        dtype=args.dtype,
        token_ids=ids,
        rope_parameters=None,
        sliding_window=None,
    )
    out = Path(args.out_dir)
    return save_llava(out, text, tok, ids, seed=args.seed, dtype=args.dtype, perturb=_perturb_unit_params)


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m frontend.make_model``."""
    parser = argparse.ArgumentParser(prog="python -m frontend.make_model", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
