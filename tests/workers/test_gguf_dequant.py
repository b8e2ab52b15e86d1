"""GGUF dequantization in torch against the `gguf` package's numpy reference, bit for bit.

Every supported type is checked on random blocks (random bytes with finite float16 scales) and, where
the package can quantize, on blocks quantized from random float weights; float32 results must have the
same bits as `gguf.quants.dequantize`, bfloat16 results those of the reference cast to bfloat16.
Also checked: tensors done in several chunks, the errors for an unsupported type and a wrong byte
count, and inputs that are read-only, 1-D, or views that start at an odd byte.
Run: `pytest -q tests/workers/test_gguf_dequant.py`.
"""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from workers.gguf import dequant as gguf_dequant
from workers.gguf.dequant import SUPPORTED, dequantize

T = GGMLQuantizationType
TYPES = sorted((T(t) for t in SUPPORTED), key=lambda t: t.name)
SHAPES = [(3, 256), (7, 512), (1, 1024), (2, 3, 256)]
QUANTIZABLE = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.BF16]

# Byte offsets of the float16 fields (d, and dmin or m) inside one block of each quantized type.
SCALE_OFFSETS = {
    T.Q8_0: (0,),
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}


def random_bytes(qtype: T, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Stored bytes, (rows, row_bytes) uint8, of a tensor of `shape` with finite values only."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape))
    rows = n // shape[-1]
    if qtype == T.F32:
        return rng.standard_normal(n).astype(np.float32).view(np.uint8).reshape(rows, -1)
    if qtype == T.F16:
        return rng.standard_normal(n).astype(np.float16).view(np.uint8).reshape(rows, -1)
    if qtype == T.BF16:
        top = rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16
        return top.astype(np.uint16).view(np.uint8).reshape(rows, -1)
    blocks = rng.integers(0, 256, size=(n // block_size, type_size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scale = rng.standard_normal(blocks.shape[0]) * rng.choice([1e-4, 1e-2, 1.0, 100.0])
        blocks[:, offset : offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def reference(data: np.ndarray, qtype: T, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, qtype))).reshape(shape)


def assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    int_view = torch.int32 if got.dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(int_view), want.view(int_view)), "equal values but different bits"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks_match_reference(qtype: T, shape: tuple[int, ...]) -> None:
    data = random_bytes(qtype, shape, seed=int(qtype) * 1000 + sum(shape))
    want = reference(data, qtype, shape)
    raw = torch.from_numpy(data)
    assert_bitwise(dequantize(raw, qtype, shape), want)
    assert_bitwise(dequantize(raw, qtype, shape, dtype=torch.bfloat16), want.to(torch.bfloat16))
    assert torch.equal(raw, torch.from_numpy(data)), "input bytes were modified"


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_weights_match_reference(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    weights = (rng.standard_normal((8, 512)) * 0.02).astype(np.float32)
    weights[0, :32] = 0.0  # an all-zero block: scale 0
    data = gguf.quants.quantize(weights, qtype)
    want = reference(data, qtype, weights.shape)
    assert_bitwise(dequantize(torch.from_numpy(data), qtype, weights.shape), want)
    assert_bitwise(
        dequantize(torch.from_numpy(data), qtype, weights.shape, dtype=torch.bfloat16),
        want.to(torch.bfloat16),
    )


@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=lambda t: t.name)
def test_stored_dtype_is_a_copy_of_the_bytes(qtype: T) -> None:
    shape = (4, 64)
    data = random_bytes(qtype, shape, seed=1)
    raw = torch.from_numpy(data)
    dtype = torch.float16 if qtype == T.F16 else torch.bfloat16
    got = dequantize(raw, qtype, shape, dtype=dtype)
    assert_bitwise(got, raw.view(dtype).reshape(shape))
    assert got.data_ptr() != raw.data_ptr()


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_read_only_one_dim_and_unaligned_inputs(qtype: T) -> None:
    shape = (1, 256)
    data = random_bytes(qtype, shape, seed=2)
    want = reference(data, qtype, shape)
    frozen = data.reshape(-1).copy()
    frozen.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the array is not writable
        read_only = torch.from_numpy(frozen)
    assert_bitwise(dequantize(read_only, qtype, shape), want)
    padded = torch.zeros(data.size + 1, dtype=torch.uint8)
    padded[1:] = torch.from_numpy(data.reshape(-1))
    assert_bitwise(dequantize(padded[1:], qtype, shape), want)  # storage offset 1: no aligned view


@pytest.mark.parametrize("qtype", [T.F32, T.Q4_1, T.Q5_K], ids=lambda t: t.name)
def test_chunked_rows_match_reference(qtype: T, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_dequant, "_CHUNK_ELEMENTS", 768)  # 3 chunks and a partial one
    shape = (5, 512)
    data = random_bytes(qtype, shape, seed=3)
    assert_bitwise(dequantize(torch.from_numpy(data), qtype, shape), reference(data, qtype, shape))


def test_unsupported_type_names_it() -> None:
    raw = torch.zeros(GGML_QUANT_SIZES[T.IQ2_XXS][1], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"GGUF tensor type IQ2_XXS is not supported; supported: .*Q4_K"):
        dequantize(raw, T.IQ2_XXS, (256,))
    with pytest.raises(ValueError, match="type 12345 is not supported"):
        dequantize(raw, 12345, (256,))


def test_wrong_bytes_give_both_numbers() -> None:
    need = 2 * 512 // 32 * 18
    raw = torch.zeros(need - 18, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"needs {need} bytes, got {need - 18}"):
        dequantize(raw, T.Q4_0, (2, 512))
    with pytest.raises(ValueError, match="not a multiple of the block size 256"):
        dequantize(torch.zeros(144, dtype=torch.uint8), T.Q4_K, (1, 128))
    with pytest.raises(TypeError, match="must be a uint8 tensor"):
        dequantize(torch.zeros(need // 2, dtype=torch.int16), T.Q4_0, (2, 512))
