"""The tensors of a GGUF checkpoint under their Hugging Face names, dequantized, for the loader.

Runs in worker processes (`workers.loader.open_checkpoint` hands a `.gguf` file here). Each tensor is
read zero-copy from the file's memory map (`coreproc.base.gguf_file.GGUFFile`), dequantized to float32
exactly as the `gguf` package's reference does (`workers.gguf.dequant`), renamed from llama.cpp's
names (`blk.3.attn_q.weight`) to transformers' (`model.layers.3.self_attn.q_proj.weight`; per
architecture where its norms differ), for the architectures llama.cpp's converter permutes (Llama's
and those derived from it) the rotary permutation of the q and k projections is undone, and Gemma's
norm weights, stored as 1 + w, come out as transformers' w. Names with no mapping come out
unchanged, so the loader names them in its error. With `native=True` (the CPU fast path) 2-D tensors
of the types `workers.gguf.repack` handles come out as `GGUFTensor`s instead: their bytes, unpermuted
by rows, for a quantization method to repack.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from coreproc.base.gguf_file import GGUFFile, TensorInfo
from kernels.native import use_native
from kernels.qgemm import BLOCK as ROWS
from kernels.qgemm import KINDS, QFormat, group_bytes, padded_k
from workers.gguf.dequant import dequantize, nbytes, type_name
from workers.gguf.repack import REPACKABLE, Repacked, format_of, repack

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
    # a mixture of experts: the router, the experts stacked in 3-D tensors (the model cuts them:
    # moe.split_experts), the shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


# the norms after attention and MLP, and Gemma's before the MLP (where Llama's `ffn_norm` is its
# `post_attention_layernorm`)
POST_NORMS = {
    "post_attention_norm": "post_attention_layernorm",  # llama.cpp's ATTN_POST_NORM
    "post_ffw_norm": "post_feedforward_layernorm",  # FFN_POST_NORM
}
BLOCKS = {
    "gemma2": BLOCK | POST_NORMS | {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": BLOCK | POST_NORMS | {"ffn_norm": "pre_feedforward_layernorm"},
    "olmo2": {k: v for k, v in BLOCK.items() if k not in ("attn_norm", "ffn_norm")} | POST_NORMS,
    # Phi-3's fused projections, as in its checkpoint: q/k/v in one, gate and up in `ffn_up`
    "phi3": {k: v for k, v in BLOCK.items() if k not in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")}
    | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # GLM-4.5: its pre-MLP norm under llama.cpp's post-attention name, the router's correction bias
    # (`exp_probs_b.bias`, the model's `mlp.gate.e_score_correction_bias`: glm4_moe.py renames it)
    "glm4moe": {k: v for k, v in BLOCK.items() if k != "ffn_norm"}
    | {"post_attention_norm": "post_attention_layernorm", "exp_probs_b": "mlp.gate.e_score_correction"},
}
# llama.cpp's converter interleaves the q/k rotary halves for Llama and the models it derives from
PERMUTED = ("llama", "granite", "granitemoe", "smollm3")
NORM_SHIFTED = ("gemma2", "gemma3")  # llama.cpp stores Gemma's 1 + w norm weights with the 1 added


def block_names(arch: str) -> dict[str, str]:
    """llama.cpp's per-layer tensor names -> transformers' for one GGUF architecture."""
    return BLOCKS.get(arch, BLOCK)


def hf_name(name: str, arch: str = "llama") -> str:
    """transformers' name of a GGUF tensor (the GGUF name itself when there is no mapping)."""
    stem, _, suffix = name.rpartition(".")
    if stem in TOP:
        return f"{TOP[stem]}.{suffix}"
    parts = stem.split(".")
    block = block_names(arch)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block:
        return f"model.layers.{parts[1]}.{block[parts[2]]}.{suffix}"
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


@dataclass
class GGUFTensor:
    """A quantized 2-D GGUF tensor as stored: `raw` uint8 [N, bytes per row] (rows are whole blocks)."""

    raw: torch.Tensor
    qtype: int
    shape: tuple[int, int]

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reference values (computed in float32, then rounded to `dtype`): natively where the op
        runs (torch.ops.ember.gguf_dequant for float32 and bfloat16, else through the native repack;
        an embedding of 233M weights in ~0.15 s instead of ~0.45 s), else `workers.gguf.dequant`."""
        if use_native("cpu") and dtype in (torch.float32, torch.bfloat16):
            out = torch.empty(self.shape, dtype=dtype)
            torch.ops.ember.gguf_dequant(self.raw.contiguous().reshape(-1), self.qtype, *self.shape, out)
            return out
        if use_native("cpu"):
            return self.repack().dequantize(dtype)
        return dequantize(self.raw, self.qtype, self.shape, dtype)

    @property
    def fmt(self) -> QFormat:
        return format_of(self.qtype)

    @property
    def rows(self) -> int:
        return self.shape[0]

    def repack(self) -> Repacked:
        return repack(self.raw.contiguous(), self.qtype, self.shape)

    def narrow_rows(self, start: int, length: int) -> GGUFTensor:
        return GGUFTensor(self.raw.narrow(0, start, length), self.qtype, (length, self.shape[1]))

    def narrow_cols(self, start: int, length: int) -> GGUFTensor | None:
        """Inputs start .. start + length, as a view of the rows' bytes; None unless they are whole
        blocks of the type (and of its superblock format)."""
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.qtype)]
        if start % block or length % block:
            return None
        raw = self.raw[:, start // block * size : (start + length) // block * size]
        return GGUFTensor(raw, self.qtype, (self.shape[0], length))


def pack_tensors(parts: list[GGUFTensor], rows: int) -> torch.Tensor | None:
    """The packed blocks (`kernels.qgemm.pack_qweight`) of tensors of one format stacked by rows, zero
    rows after them up to `rows`, written straight from their bytes by the native op (no integers in
    between: a second or two less start-up on a 1.5B model); None where it cannot (no native op, or a
    part before the last whose rows are not whole blocks of 16)."""
    if not parts or not use_native("cpu") or any(p.rows % ROWS for p in parts[:-1]):
        return None
    fmt, k = parts[0].fmt, parts[0].shape[1]
    assert all(p.fmt == fmt and p.shape[1] == k for p in parts), "one format and width"
    units = padded_k(k) // fmt.group // fmt.subs
    out = torch.ops.ember.weight_empty([-(-rows // ROWS), units, group_bytes(fmt)], torch.uint8)
    start = 0
    for p in parts:
        blocks = -(-p.rows // ROWS)
        args = (KINDS.index(fmt.kind), fmt.group, fmt.params)
        torch.ops.ember.gguf_pack(p.raw, p.qtype, p.rows, k, out[start : start + blocks], *args)
        start += blocks
    out[start:].zero_()
    return out


def iter_gguf(gguf: GGUFFile, native: bool = False) -> Iterator[tuple[str, str, torch.Tensor | GGUFTensor]]:
    """(file name, transformers name, tensor) for every tensor of the file, lazily: float32, or with
    `native` a `GGUFTensor` for each 2-D tensor that `workers.gguf.repack` can repack."""
    arch = gguf.architecture
    q_heads = int(gguf.metadata.get(f"{arch}.attention.head_count") or 0)
    kv_heads = int(gguf.metadata.get(f"{arch}.attention.head_count_kv") or q_heads)
    heads = {"attn_q": q_heads, "attn_k": kv_heads}
    for name, info in gguf.tensors.items():
        kind = name.split(".")[-2] if name.startswith("blk.") else ""
        permute = arch in PERMUTED and kind in heads and heads[kind]
        tensor: torch.Tensor | GGUFTensor
        if native and len(info.shape) in (2, 3) and info.qtype in REPACKABLE:
            n, k = math.prod(int(s) for s in info.shape[:-1]), int(info.shape[-1])  # experts: rows of all
            raw = raw_bytes(gguf, info)
            try:
                need = nbytes(info.qtype, (n, k))
            except ValueError as e:
                raise ValueError(f"tensor {name}: {e}") from None
            if raw.numel() != need:
                raise ValueError(f"tensor {name}: needs {need} bytes, the file has {raw.numel()}")
            raw = raw.view(n, -1)
            if permute:  # rows are whole blocks: undo the permutation on the bytes
                order = unpermute_rotary(torch.arange(n), heads[kind])
                raw = raw.index_select(0, order)
            tensor = GGUFTensor(raw, info.qtype, (n, k))
        else:
            try:
                tensor = dequantize(raw_bytes(gguf, info), info.qtype, info.shape)
            except ValueError as e:
                raise ValueError(f"tensor {name}: {e}") from None
            if permute:
                tensor = unpermute_rotary(tensor, heads[kind])
            if arch in NORM_SHIFTED and name.endswith("norm.weight"):
                tensor = tensor - 1.0  # transformers' w; the model's norm loads it as 1 + w again
        yield gguf.path.name, hf_name(name, arch), tensor
