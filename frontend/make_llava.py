"""Build a small, deterministic, randomly initialised LLaVA checkpoint (`ember make-model --arch llava`).

The yardstick of image support (tests compare the engine with transformers on it): transformers' own
`LlavaForConditionalGeneration` with a CLIP vision tower, its two-layer projector and the Llama or Qwen2
text model that `frontend.make_model.build_llava` configures from its tiny preset, saved with a real
processor (`LlavaProcessor`: the CLIP image processor's resize, crop and normalisation, which needs no
torchvision; the tokenizer with an `<image>` token that the processor expands into one placeholder per
image patch; a ChatML template that writes `<image>` for each image part), so transformers'
`AutoProcessor` and `generate` load it offline as they would a published LLaVA folder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from frontend.tokenizer_train import CHAT_TEMPLATE, save_hf_tokenizer

IMAGE_TOKEN = "<image>"
# CLIP's normalisation constants, as published LLaVA processors carry them
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# ChatML with an `<image>` line where each image part stands (LLaVA-1.5 puts it before the text)
IMAGE_PART = "{%- if part['type'] in ('image', 'image_url') -%}{{- '<image>\\n' -}}{%- endif -%}"
LLAVA_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- for part in message['content'] -%}",
    "{%- for part in message['content'] -%}" + IMAGE_PART,
)


def save_llava(
    out: Path,
    text: Any,
    tok: Any,
    ids: dict[str, int],
    *,
    seed: int,
    dtype: str,
    perturb: Callable[[Any, int], None],
    image_size: int = 56,
    patch_size: int = 14,
) -> Path:
    """A seeded random LLaVA folder at `out` around the text config `text` (its vocabulary holds the
    `<image>` token of `tok`): a 2-layer CLIP tower over `image_size` square images in `patch_size`
    patches ((image_size / patch_size)^2 placeholders an image), the processor and the generation
    config. `perturb(model, seed)` gives norms and biases non-trivial values."""
    if image_size % patch_size:
        raise ValueError(f"patch_size {patch_size} must divide image_size {image_size}")
    import torch
    import transformers

    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=32,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tok.token_to_id(IMAGE_TOKEN),
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",  # the patches, without CLIP's class token
        vision_feature_layer=-2,
        image_seq_length=(image_size // patch_size) ** 2,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config)
    perturb(model, seed)
    model = model.to(getattr(torch, dtype)).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    gen = transformers.GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=[ids["eos"], ids["im_end"]], pad_token_id=ids["pad"]
    )
    gen.save_pretrained(out)
    save_hf_tokenizer(tok, out, model_max_length=text.max_position_embeddings)
    _save_processor(out, image_size, patch_size)
    return out


def _save_processor(out: Path, image_size: int, patch_size: int) -> Any:
    """The LlavaProcessor of the folder (its tokenizer as saved there, a CLIP image processor)."""
    import transformers

    images = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    processor = transformers.LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        chat_template=LLAVA_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,  # CLIP's class token, which the "default" strategy then drops
    )
    processor.save_pretrained(out)
    return processor
