"""Builds a model from a Hugging Face folder and loads its safetensors weights (single or sharded).

Runs in worker processes. Tensors are read through safetensors' memory map one at a time and copied
into this rank's parameters by each parameter's `weight_loader`; checkpoint names are first renamed by
the model's `checkpoint_renames` prefixes, then stacked projections are mapped from them; a pipeline
stage skips the tensors its model lists in `missing_prefixes` (other stages' layers). Every
mismatch (unknown tensor, wrong shape, missing tensor) raises `WeightLoadError` with one line naming
the tensor and the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from coreproc.base.errors import EmberError
from coreproc.base.gguf_file import is_gguf, open_gguf
from kernels import AttentionBackend
from workers.gguf.weights import GGUFTensor, iter_gguf
from workers.models import resolve
from workers.models.layers import LMHead, VocabEmbedding, weight_loader_of
from workers.models.llama import LlamaForCausalLM
from workers.parallel import PPGroup, TPGroup
from workers.quant import make_method


class WeightLoadError(EmberError, RuntimeError):
    """The checkpoint does not fit the model; the message names the tensor and the file."""


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The weight files of a checkpoint: a GGUF file, or its safetensors shards (from the shard index
    when there is one)."""
    if is_gguf(model_dir):
        return [model_dir]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise WeightLoadError(f"shard {missing[0]} listed in {index.name} is missing from {model_dir}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {model_dir}")
    return files


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yield (file name, tensor name, tensor) lazily from memory-mapped safetensors files."""
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield path.name, name, f.get_tensor(name)


def open_checkpoint(
    files: list[Path], native_gguf: bool = False
) -> tuple[int, Iterator[tuple[str, str, torch.Tensor | GGUFTensor]]]:
    """How many tensors the files hold, and the lazy (file, name, tensor) iterator over them (a GGUF
    file's quantized tensors as stored when `native_gguf`)."""
    if len(files) == 1 and is_gguf(files[0]):
        gguf = open_gguf(files[0])
        return len(gguf.tensors), iter_gguf(gguf, native_gguf)
    total = 0
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            total += len(list(f.keys()))
    return total, iter_checkpoint(files)


def load_weights(model: nn.Module, files: list[Path], show_progress: bool = True) -> None:
    """Copy every checkpoint tensor into its parameter; fail on anything unexpected or missing."""
    params = dict(model.named_parameters())
    renames = getattr(model, "checkpoint_renames", ())
    stacked = getattr(model, "stacked_params", ())
    ignored = getattr(model, "ignored_suffixes", ())
    elsewhere = getattr(model, "missing_prefixes", ())  # another pipeline stage's tensors
    tied = getattr(model, "tie_word_embeddings", False)
    expand = getattr(model, "expand_tensor", None)  # (name, tensor) -> the (name, tensor)s it holds
    seen: dict[str, set] = {}
    # a parameter's modules (a tied head shares the embedding's): those whose method repacks GGUF
    # tensors get the stored bytes, the others their dequantized values
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
    native = any(hasattr(getattr(m, "quant", None), "load_quantized") for m in model.modules())
    total, tensors = open_checkpoint(files, native)
    bar = tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show_progress)
    with bar, torch.no_grad():
        for file, name, tensor in tensors:
            bar.update(1)
            pieces = [(renamed(name, renames), tensor)]
            if expand is not None:  # a tensor that holds several parameters (stacked experts)
                pieces = list(expand(pieces[0][0], tensor))
            for target, tensor in pieces:
                shard = None
                if (
                    target.endswith(ignored)
                    or (tied and target == "lm_head.weight")
                    or target.startswith(elsewhere)
                ):
                    continue
                for param_name, ckpt_name, shard_id in stacked:
                    if f".{ckpt_name}." in target:
                        target, shard = target.replace(f".{ckpt_name}.", f".{param_name}."), shard_id
                        break
                param = params.get(target)
                if param is None:
                    raise WeightLoadError(
                        f"unexpected tensor {name} {tuple(tensor.shape)} in {file}: "
                        f"{type(model).__name__} has no such parameter"
                    )
                try:
                    values = (
                        load_quantized(owners.get(id(param), []), tensor, shard, param.dtype)
                        if isinstance(tensor, GGUFTensor)
                        else tensor
                    )
                    if values is not None:
                        weight_loader_of(param)(param, values, shard)
                except ValueError as e:
                    raise WeightLoadError(f"tensor {name} in {file}: {e}") from None
                seen.setdefault(target, set()).add(shard)
    shards_needed: dict[str, int] = {}
    for param_name, _, _ in stacked:
        shards_needed[param_name] = sum(1 for p, _, _ in stacked if p == param_name)
    for pname in params:
        leaf = pname.split(".")[-2] if pname.count(".") else pname
        need = shards_needed.get(leaf, 1)
        if len(seen.get(pname, ())) < need:
            raise WeightLoadError(f"checkpoint is missing weights for parameter {pname}")


def renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint tensor's name as the model spells it: the first of the model's (old prefix, new
    prefix) pairs that matches replaces its prefix (a multimodal checkpoint's `language_model.model.`
    becomes the text model's `model.`); without a match the name is kept."""
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def load_quantized(
    modules: list[nn.Module], tensor: GGUFTensor, shard: Any, dtype: torch.dtype
) -> torch.Tensor | None:
    """Hand a GGUF tensor's bytes to the modules whose method repacks them and to an embedding (which
    keeps its rows as stored); the dequantized tensor in the parameter's dtype when another module
    needs the values, else None."""
    plain = False
    for module in modules:
        load = getattr(getattr(module, "quant", None), "load_quantized", None)
        if load is not None:
            load(module, tensor, shard)
        elif isinstance(module, VocabEmbedding) and not isinstance(module, LMHead):
            module.load_gguf(tensor)
        else:
            plain = True
    return tensor.dequantize(dtype) if plain or not modules else None


def quantize(model: nn.Module) -> float:
    """The post-load pass of every quantized linear layer; returns the seconds it took."""
    start = time.perf_counter()
    with torch.no_grad():
        for module in model.modules():
            method = getattr(module, "quant", None)
            if method is not None:
                method.process_weights_after_loading(module)
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


# What a Llama config.json must spell out for `read_hf_config` to skip transformers, and the values
# LlamaConfig gives the optional fields the models read when they are absent.
LLAMA_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "vocab_size",
)
LLAMA_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "head_dim": None,
    "num_key_value_heads": None,
    "sliding_window": None,
    "layer_types": None,
}


def read_hf_config(model_dir: str) -> Any:
    """The checkpoint's config (a GGUF file's as `GGUFFile.hf_config` gives it): for a plain Llama, or
    a Qwen2 without sliding windows (default rotary), the config.json values themselves with the
    defaults of LlamaConfig / Qwen2Config that the models read, which saves importing transformers'
    config machinery (~2-3 s of a cold start on a small CPU); for everything else transformers'
    AutoConfig."""
    from workers.models.layers import rope_parameters

    gguf = is_gguf(model_dir)
    raw = (
        open_gguf(model_dir).hf_config if gguf else json.loads((Path(model_dir) / "config.json").read_text())
    )
    light = SimpleNamespace(**{**LLAMA_DEFAULTS, **raw})
    kind = raw.get("model_type")
    if kind == "qwen2" and not raw.get("use_sliding_window"):
        # Qwen2Config keeps `sliding_window` only when use_sliding_window is set
        light = SimpleNamespace(**{**LLAMA_DEFAULTS, **raw, "sliding_window": None, "layer_types": None})
        kind = "plain qwen2"
    # Qwen2Config's own default for a missing num_key_value_heads (32) is not LlamaConfig's
    required = LLAMA_REQUIRED + (("num_key_value_heads",) if kind == "plain qwen2" else ())
    if (
        kind in ("llama", "plain qwen2")
        and all(raw.get(k) is not None for k in required)
        and rope_parameters(light)["rope_type"] == "default"
        and "partial_rotary_factor" not in raw
    ):
        return light
    from transformers import AutoConfig

    if gguf:
        return AutoConfig.for_model(**raw)
    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What a model is built from: its checkpoint and architecture, and how it lies on this worker."""

    model_dir: str
    architecture: str
    dtype: torch.dtype
    device: torch.device
    backend: AttentionBackend
    max_positions: int
    tp: TPGroup = dataclasses.field(default_factory=TPGroup)
    pp: PPGroup | None = None  # one pipeline stage's layers only
    quantization: str | None = None
    kernel: str = "torch"  # the linear layers' kernel ("cpu_bf16": the native CPU fast path)


def construct(spec: ModelSpec) -> LlamaForCausalLM:
    """The architecture's module tree on `spec.device` (the meta device builds it without memory);
    with `spec.pp`, only that pipeline stage's part."""
    hf_config = read_hf_config(spec.model_dir)
    cls = resolve(spec.architecture)
    method = make_method(spec.quantization, spec.kernel, gguf=is_gguf(spec.model_dir))
    with torch.device(spec.device), default_dtype(spec.dtype):
        return cls(hf_config, spec.tp, spec.backend, spec.max_positions, quant=method, pp=spec.pp)


def build_model(spec: ModelSpec, show_progress: bool = True) -> tuple[LlamaForCausalLM, float, float]:
    """Instantiate the architecture (or one pipeline stage of it) on its device in its dtype, load its
    weights and quantize them.

    Returns (model, seconds loading, seconds in the quantization pass)."""
    start = time.perf_counter()
    model = construct(spec)
    load_weights(model, checkpoint_files(Path(spec.model_dir)), show_progress)
    model.eval()
    load_seconds = time.perf_counter() - start
    return model, load_seconds, quantize(model)


def release_load_memory(collect: bool = False) -> None:
    """Give back what loading from disk used and serving does not: the checkpoint file's mapping (a GGUF
    file's pages, ~its size, once no tensor views it) and the heap that packing freed (malloc keeps it
    unless trimmed): about 1.9 GB for Qwen2.5-Coder-1.5B Q4_K_M. `collect`: a full garbage collection
    first (a tenth of a second with torch loaded), for what only a cycle still holds."""
    import ctypes
    import gc

    from coreproc.base.gguf_file import forget_gguf_files

    forget_gguf_files()
    if collect:
        gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the heap stays as the allocator keeps it
        pass
