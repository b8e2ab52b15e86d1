"""LlavaForConditionalGeneration: a CLIP vision tower and a two-layer projector in front of a Llama or
Qwen2 text model.

Runs in worker processes. The built model IS the text model's Ember class (`LlavaLlama` subclasses
LlamaForCausalLM, `LlavaQwen2` Qwen2ForCausalLM; `LlavaForConditionalGeneration(hf_config, ...)` picks
one from `text_config`), so the runner, the KV cache and the kernels see a plain decoder; it adds
`vision_tower`, `multi_modal_projector` and `embed_images(pixel_values[N, C, H, W]) -> [N, tokens,
hidden]`, whose rows the runner writes over the image placeholders before `forward(..., inputs_embeds=)`.
The tower is plain torch in the model's dtype, never quantized and whole on every TP rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels import AttentionBackend
from workers.models import resolve
from workers.models.layers import WEIGHT_LOADER, ColumnLinear, attach_weight_loader, default_weight_loader
from workers.models.llama import LlamaForCausalLM
from workers.parallel import PPGroup, TPGroup
from workers.quant.base import QuantMethod

Activation = Callable[[torch.Tensor], torch.Tensor]

# the activations of transformers' ACT2FN that CLIP towers and LLaVA projectors use
ACTIVATIONS: dict[str, Activation] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

# the text model's Ember architecture, by `text_config.model_type`
TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def activation(name: str) -> Activation:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class PlainLinear(nn.Linear):
    """nn.Linear without its random initialisation (the checkpoint supplies every weight)."""

    def reset_parameters(self) -> None:
        pass


class ClipEmbeddings(nn.Module):
    """Patch embedding (a strided convolution), the class token, learned positions."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.image_size, self.patch_size = cfg.image_size, cfg.patch_size
        self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding((cfg.image_size // cfg.patch_size) ** 2 + 1, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n, _, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"image size {height}x{width} is not the tower's ({self.image_size} square)")
        weight = self.patch_embedding.weight
        # [N, C, H, W] -> [N, D, H / p, W / p] -> [N, patches, D]
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_embedding.expand(n, 1, -1), patches], dim=1)
        return x + self.position_embedding.weight


class ClipAttention(nn.Module):
    """Bidirectional multi-head attention; q/k/v stacked in one projection (the loader maps them)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv_proj = ColumnLinear(hidden, [hidden] * 3, True, TPGroup())  # whole on every rank
        self.out_proj = PlainLinear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, seq, hidden = x.shape
        # [N, S, 3 * D] -> 3 x [N, heads, S, head_dim]
        q, k, v = self.qkv_proj(x).view(n, seq, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(n, seq, hidden))


class ClipMLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.act = activation(cfg.hidden_act)
        self.fc1 = PlainLinear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = PlainLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = ClipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = ClipMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClipLayer(cfg) for _ in range(cfg.num_hidden_layers))


class ClipVisionTower(nn.Module):
    """CLIP's vision transformer, named as transformers' CLIPVisionModel names it (`post_layernorm` is
    loaded but unused: LLaVA reads hidden states, not the pooled output)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.embeddings = ClipEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = ClipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, layers: tuple[int, ...]) -> list[torch.Tensor]:
        """The hidden states [N, 1 + patches, D] at `layers` (0: the embeddings after pre_layrnorm, i:
        the output of layer i); only the layers up to the deepest one requested run."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [x]
        for layer in self.encoder.layers[: max(layers)]:
            x = layer(x)
            states.append(x)
        return [states[i] for i in layers]


class LlavaProjector(nn.Module):
    def __init__(self, in_features: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = PlainLinear(in_features, hidden, bias=bias)
        self.act = activation(act)
        self.linear_2 = PlainLinear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def feature_layers(hf_config: Any) -> tuple[int, ...]:
    """`vision_feature_layer` (an int or a list) as non-negative indices into the tower's hidden
    states (num_hidden_layers + 1 of them)."""
    selected = hf_config.vision_feature_layer
    count = hf_config.vision_config.num_hidden_layers + 1
    layers = (selected,) if isinstance(selected, int) else tuple(selected)
    for i in layers:
        if not -count <= i < count:
            raise ValueError(f"vision_feature_layer {i} is outside the tower's {count} hidden states")
    return tuple(i % count for i in layers)


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """The LLaVA parts over a text model; constructing it builds the `Llava<Text>` class that fits
    `hf_config.text_config` (see `llava_class`)."""

    # checkpoint prefixes (transformers 4 and 5 layouts, CLIP with or without `vision_model`) -> ours
    checkpoint_renames: tuple[tuple[str, str], ...] = (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.vision_tower.vision_model.", "vision_tower."),
        ("model.vision_tower.", "vision_tower."),
        ("vision_tower.vision_model.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )
    ignored_suffixes = (*LlamaForCausalLM.ignored_suffixes, "embeddings.position_ids")

    def __new__(cls, hf_config: Any = None, *args: Any, **kwargs: Any) -> LlavaForConditionalGeneration:
        if cls is LlavaForConditionalGeneration:  # the registry's entry: build the class that fits
            cls = llava_class(text_class(hf_config.text_config))
        return super().__new__(cls)

    def __init__(
        self,
        hf_config: Any,
        tp: TPGroup,
        backend: AttentionBackend,
        max_positions: int,
        quant: QuantMethod | None = None,
        pp: PPGroup | None = None,
    ) -> None:
        super().__init__(hf_config.text_config, tp, backend, max_positions, quant, pp)
        if getattr(hf_config, "tie_word_embeddings", False) and not self.tie_word_embeddings:
            # transformers ties the head when either config says so (LlavaConfig's own flag, or the
            # text config's, which the text class followed)
            self.tie_word_embeddings = True
            self.lm_head.weight = self.model.embed_tokens.weight
        vision = hf_config.vision_config
        self.image_token_id: int = hf_config.image_token_index
        self.feature_layers = feature_layers(hf_config)
        self.select_strategy: str = hf_config.vision_feature_select_strategy
        if self.select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {self.select_strategy!r} is not supported")
        self.patch_size: int = vision.patch_size
        self.vision_tower = ClipVisionTower(vision)
        self.multi_modal_projector = LlavaProjector(
            vision.hidden_size * len(self.feature_layers),
            hf_config.text_config.hidden_size,
            hf_config.projector_hidden_act,
            bool(getattr(hf_config, "multimodal_projector_bias", True)),
        )
        for part in (self.vision_tower, self.multi_modal_projector):
            part.requires_grad_(False)
            for param in part.parameters():
                if not hasattr(param, WEIGHT_LOADER):
                    attach_weight_loader(param, default_weight_loader)

    def num_image_tokens(self, height: int, width: int) -> int:
        """Placeholders one image of this processed size takes (its patches, and the class token when
        the strategy keeps it)."""
        patches = (height // self.patch_size) * (width // self.patch_size)
        return patches + (1 if self.select_strategy == "full" else 0)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] pixels (any float dtype) -> [N, tokens, text hidden] in the model's dtype, the
        rows that replace each image's placeholders (transformers' `get_image_features`)."""
        states = self.vision_tower(pixel_values, self.feature_layers)
        if self.select_strategy == "default":
            states = [s[:, 1:] for s in states]  # drop the class token
        return self.multi_modal_projector(torch.cat(states, dim=-1))


def text_class(text_config: Any) -> type[LlamaForCausalLM]:
    """The Ember class of a LLaVA's text model."""
    kind = getattr(text_config, "model_type", None)
    if kind not in TEXT_ARCHITECTURES:
        supported = ", ".join(TEXT_ARCHITECTURES)
        raise ValueError(f"LLaVA text model {kind!r} is not supported; supported: {supported}")
    return resolve(TEXT_ARCHITECTURES[kind])


LLAVA_CLASSES: dict[type[LlamaForCausalLM], type[LlavaForConditionalGeneration]] = {}


def llava_class(text: type[LlamaForCausalLM]) -> type[LlavaForConditionalGeneration]:
    """`Llava<Text>`: LlavaForConditionalGeneration's parts over `text` (its class attributes, such as
    Qwen2's q/k/v bias, apply to the text layers); made once per text class."""
    if text not in LLAVA_CLASSES:
        name = "Llava" + text.__name__.removesuffix("ForCausalLM")
        LLAVA_CLASSES[text] = type(name, (LlavaForConditionalGeneration, text), {"__module__": __name__})
    return LLAVA_CLASSES[text]
