"""The tensors of a GGUF checkpoint under their Hugging Face names, dequantized, for the loader.

Runs in worker processes (`workers.loader.open_checkpoint` hands a `.gguf` file here). Each tensor is
read zero-copy from the file's memory map (`coreproc.gguf_file.GGUFFile`), dequantized to float32
exactly as the `gguf` package's reference does (`workers.gguf_dequant`), renamed from llama.cpp's
names (`blk.3.attn_q.weight`) to transformers' (`model.layers.3.self_attn.q_proj.weight`), and for
the `llama` architecture the rotary permutation that llama.cpp's converter applies to the q and k
projections is undone. Names with no mapping come out unchanged, so the loader names them in its error.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch

from coreproc.gguf_file import GGUFFile, TensorInfo
from workers.gguf_dequant import dequantize

TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(name: str) -> str:
    """transformers' name of a GGUF tensor (the GGUF name itself when there is no mapping)."""
    stem, _, suffix = name.rpartition(".")
    if stem in TOP:
        return f"{TOP[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in BLOCK:
        return f"model.layers.{parts[1]}.{BLOCK[parts[2]]}.{suffix}"
    return name


def unpermute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (its rotary pairs interleaved per head) for transformers' halves."""
    shape = weight.shape
    return weight.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def raw_bytes(gguf: GGUFFile, info: TensorInfo) -> torch.Tensor:
    """A uint8 tensor over the mapped bytes (read-only memory: never written)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the buffer is not writable
        return torch.frombuffer(gguf.data(info), dtype=torch.uint8)


def iter_gguf(gguf: GGUFFile) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file name, transformers name, float32 tensor) for every tensor of the file, lazily."""
    arch = gguf.architecture
    q_heads = int(gguf.metadata.get(f"{arch}.attention.head_count") or 0)
    kv_heads = int(gguf.metadata.get(f"{arch}.attention.head_count_kv") or q_heads)
    heads = {"attn_q": q_heads, "attn_k": kv_heads}
    for name, info in gguf.tensors.items():
        try:
            tensor = dequantize(raw_bytes(gguf, info), info.qtype, info.shape)
        except ValueError as e:
            raise ValueError(f"tensor {name}: {e}") from None
        kind = name.split(".")[-2] if name.startswith("blk.") else ""
        if arch == "llama" and kind in heads and heads[kind]:
            tensor = unpermute_rotary(tensor, heads[kind])
        yield gguf.path.name, hf_name(name), tensor
