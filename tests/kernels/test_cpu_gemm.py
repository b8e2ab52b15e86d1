"""Tests of the CPU fast path's native ops (kernels/cpu_gemm.py, kernels/native.py, kernels/csrc).

The packed layouts (bf16, fp8) round-trip exactly and the native packing
equals the torch one; the native bf16 and fp8 matmuls equal their torch references (float32
accumulation, so only summation order differs) over shapes that hit every micro-kernel row count,
the multi-block tiles of 1-3 rows and their tails, padded activation rows (K = 1024), the row-chunk
boundary and ragged output blocks, and give bit-identical rows whatever the batch; bf16 / fp16 results
are rounded like torch's conversion; fp8 decodes every e4m3 value exactly; the native RMSNorm, rotary
and SwiGLU round exactly like their torch references in bf16; the native cache write lands in the
same slots.
Run: `pytest -q tests/kernels/test_cpu_gemm.py` (the first run builds the ops, under a minute).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.cpu_gemm import (
    bf16_layout,
    gemm_bf16,
    gemm_bf16_torch,
    gemm_fp8,
    gemm_fp8_torch,
    pack_bf16,
    pack_bf16_torch,
    pack_fp8,
    pack_fp8_torch,
    select_linear_kernel,
    unpack_bf16,
    unpack_fp8,
)
from kernels.native import use_native
from kernels.torch_ops import write_kv_cpu, write_kv_torch
from workers.models.layers import RMSNorm, RotaryEmbedding
from workers.models.ops import NativeCpuOps, TorchOps, install_ops
from workers.quant import make_method
from workers.quant.fp8 import FP8
from workers.quant.packed import PackedBf16

pytestmark = pytest.mark.model


@pytest.mark.parametrize(("n", "k"), [(1, 1), (15, 7), (16, 64), (17, 67), (100, 33)])
def test_pack_round_trip(n: int, k: int) -> None:
    w = torch.randn(n, k).bfloat16()
    packed = pack_bf16_torch(w)
    assert packed.shape == (-(-n // 16), k, 16) and packed.dtype == torch.bfloat16
    assert torch.equal(unpack_bf16(packed, n), w)
    # lane i of block 0 holds rows i (low half) and i + 8 (high half) at each k
    if n >= 16:
        assert torch.equal(packed[0, 3, 2 * 5], w[5, 3]) and torch.equal(packed[0, 3, 2 * 5 + 1], w[13, 3])
    tiles = pack_bf16_torch(w, "amx32")  # k rounded up to 32, zeros past it
    assert tiles.shape == (-(-n // 16), -(-k // 32) * 32, 16) and tiles.count_nonzero() == w.count_nonzero()
    assert torch.equal(unpack_bf16(tiles, n, k, "amx32"), w)
    if n >= 16 and k >= 36:  # each 64-byte tile row: a pair of k for the 16 rows, (k, k + 1) per row
        row = tiles[0].view(-1, 32)[17]  # k 34 and 35
        assert torch.equal(row[2 * 5], w[5, 34]) and torch.equal(row[2 * 5 + 1], w[5, 35])


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 48, 50, 98, 101])
@pytest.mark.parametrize(
    ("n", "k"), [(17, 67), (64, 256), (40, 5), (59, 33), (200, 40), (40, 1024), (33, 601)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemm_matches_reference(native_ops, m: int, n: int, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).to(dtype)
    packed = pack_bf16(w)
    out = gemm_bf16(x, packed, n)
    ref = gemm_bf16_torch(x, packed, n, bf16_layout())
    assert out.shape == (m, n) and out.dtype == dtype
    exact = x.double() @ w.double().t()
    tol = 1e-5 * k if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), exact, atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("n", "k"), [(1, 1), (15, 7), (16, 64), (17, 67), (100, 33)])
def test_native_packing_equals_the_reference(native_ops, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 100 + k)
    w = torch.randn(n, k, generator=gen)
    native = torch.ops.ember.pack_weight(w.bfloat16())
    assert torch.equal(native, pack_bf16_torch(w.bfloat16(), bf16_layout()))
    q = w.mul(50).to(FP8)
    assert torch.equal(torch.ops.ember.pack_weight(q).view(torch.uint8), pack_fp8_torch(q).view(torch.uint8))


HUGE_PAGES_CHECK = """
import sys, torch
from pathlib import Path
from kernels.native import use_native
assert use_native("cpu")
big = torch.ops.ember.weight_empty([8 << 20], torch.uint8)  # 8 MiB: mapped fresh, 2 MiB aligned
assert big.shape == (8 << 20,) and big.data_ptr() % (2 << 20) == 0
big.fill_(7)
assert int(big[::4096].sum()) == 7 * 2048
packed = torch.ops.ember.pack_weight(torch.randn(4096, 512).to(torch.bfloat16))
assert packed.data_ptr() % (2 << 20) == 0
huge, inside = 0, False  # this mapping's AnonHugePages in smaps
for line in Path("/proc/self/smaps").read_text().splitlines():
    head = line.split()[0] if line else ""
    if "-" in head and not head.endswith(":"):
        lo, hi = (int(v, 16) for v in head.split("-"))
        inside = lo <= big.data_ptr() < hi
    elif inside and head == "AnonHugePages:":
        huge = int(line.split()[1])
thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
assert huge >= 2048 or not thp.is_file() or "[never]" in thp.read_text(), huge
del big, packed  # unmapped by their deleters
print("ok")
"""


def test_huge_pages_are_opt_in(native_ops) -> None:
    """EMBER_HUGE_PAGES=1 (read once per process, so checked in a child) maps packed weights of 2 MiB and
    more fresh, 2 MiB aligned, in huge pages where the kernel has them; without it they are plain."""
    small = torch.ops.ember.weight_empty([3, 5], torch.float32)
    assert small.shape == (3, 5) and small.dtype == torch.float32
    plain = torch.ops.ember.weight_empty([4 << 20], torch.uint8)
    assert plain.shape == (4 << 20,)
    # the native ops themselves, also in a suite run with EMBER_CPU_KERNELS=torch
    env = {**os.environ, "EMBER_HUGE_PAGES": "1", "EMBER_CPU_KERNELS": "native"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", HUGE_PAGES_CHECK], env=env, cwd=root, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize(("n", "k"), [(1, 1), (15, 7), (17, 67)])
def test_fp8_pack_round_trip(n: int, k: int) -> None:
    w = torch.randn(n, k).mul(50).to(FP8)
    packed = pack_fp8(w)
    assert packed.shape == (-(-n // 16), k, 16) and packed.dtype == FP8
    assert torch.equal(unpack_fp8(packed, n).view(torch.uint8), w.view(torch.uint8))
    if n >= 16:  # block 0 holds rows 0..15 side by side at each k
        assert torch.equal(packed[0, 3, 5].view(torch.uint8), w[5, 3].view(torch.uint8))


def test_fp8_decodes_every_value_exactly(native_ops) -> None:
    """All 254 finite e4m3 values, subnormals and both zeros included, times one: exact."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8)
    values = values[values.float().isfinite()].reshape(-1, 1)
    for m in (1, 13):  # packed and widened-block paths
        out = gemm_fp8(torch.ones(m, 1), pack_fp8(values), torch.tensor([1.0]), len(values))
        assert torch.equal(out, values.float().t().expand(m, -1))


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 13, 101])
@pytest.mark.parametrize(("n", "k"), [(17, 67), (64, 256), (200, 40)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemm_matches_reference(native_ops, m: int, n: int, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen).mul(100).to(FP8)
    x = torch.randn(m, k, generator=gen).to(dtype)
    packed, scale = pack_fp8(w), torch.tensor([0.0123])
    out = gemm_fp8(x, packed, scale, n)
    assert out.shape == (m, n) and out.dtype == dtype
    exact = (x.double() @ w.double().t()) * 0.0123
    tol = 1e-5 * k if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), exact, atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), gemm_fp8_torch(x, packed, scale, n).float(), atol=tol, rtol=tol)


def test_fp8_method_packs_for_the_native_kernel(native_ops) -> None:
    method = make_method("fp8_per_tensor", "cpu_bf16")
    plain = make_method("fp8_per_tensor", "torch")
    assert method.params == {"layout": "cpu_fp8_packed16"} and method.config() != plain.config()
    assert isinstance(method.head_method(), PackedBf16) and plain.head_method() is None
    layers = []
    for m in (method, plain):
        layer = torch.nn.Module()
        m.create_weights(layer, 40, 24)
        layer.weight.data = torch.randn(40, 24, generator=torch.Generator().manual_seed(0)).bfloat16()
        m.process_weights_after_loading(layer)
        layers.append(layer)
    assert layers[0].weight.shape == (3, 24, 16) and layers[0].weight.dtype == FP8
    assert torch.equal(layers[0].weight_scale, layers[1].weight_scale)
    x, bias = torch.randn(5, 24).bfloat16(), torch.randn(40).bfloat16()
    ours, ref = method.apply(layers[0], x, bias), plain.apply(layers[1], x, bias)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), ref.float(), atol=5e-2, rtol=5e-2)


def test_gemm_keeps_leading_dims_and_rejects_mismatch(native_ops) -> None:
    w = torch.randn(24, 32).bfloat16()
    x = torch.randn(2, 3, 32).bfloat16()
    out = gemm_bf16(x, pack_bf16(w), 24)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out.float(), (x.float() @ w.float().t()), atol=1e-2, rtol=1e-2)
    with pytest.raises(RuntimeError, match="mismatch"):
        gemm_bf16(torch.randn(3, 33), pack_bf16(w), 24)  # (amx32 rounds k up to 32: 31 would pass)
    for m in (0, 2, 8):  # empty batches and empty rows (k = 0) give empty / zero products
        empty = torch.ops.ember.gemm_bf16(torch.randn(m, 0), pack_bf16(torch.randn(24, 0).bfloat16()), 24)
        assert empty.shape == (m, 24) and not empty.any()
    assert gemm_bf16(torch.randn(0, 32), pack_bf16(w), 24).shape == (0, 24)


def test_packed_method_processes_and_applies(native_ops) -> None:
    layer = torch.nn.Module()
    method = PackedBf16()
    method.create_weights(layer, 40, 24)
    layer.weight.data = torch.randn(40, 24).bfloat16()
    dense = layer.weight.data.clone()
    method.process_weights_after_loading(layer)
    assert torch.equal(layer.weight, pack_bf16_torch(dense, bf16_layout()))
    assert layer.quant_attrs == {"out_features": 40}
    x, bias = torch.randn(5, 24).bfloat16(), torch.randn(40).bfloat16()
    ref = torch.nn.functional.linear(x.float(), dense.float(), bias.float())
    torch.testing.assert_close(method.apply(layer, x, bias).float(), ref, atol=3e-2, rtol=3e-2)
    assert method.config() != make_method(None).config()  # the layout is part of the cache fingerprint
    assert method.config()["layout"] == f"cpu_bf16_{bf16_layout()}"
    assert method.head_method() is method and make_method(None).head_method() is None


def test_kernel_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_CPU_KERNELS", "torch")
    assert select_linear_kernel("cpu", torch.bfloat16) == "torch" and not use_native("cpu")
    assert isinstance(make_method(None, select_linear_kernel("cpu", torch.bfloat16)), type(make_method(None)))
    monkeypatch.setenv("EMBER_CPU_KERNELS", "auto")
    assert select_linear_kernel("cpu", torch.float32) == "torch"
    assert select_linear_kernel("meta", torch.bfloat16) == "torch"
    monkeypatch.setenv("EMBER_CPU_KERNELS", "fastest")
    with pytest.raises(ValueError, match="auto, native, torch"):
        use_native("cpu")


def assert_bf16_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 results of a native op against torch's: float32 work done in another order or with other
    instructions (and they differ by ISA) can flip a bf16 rounding now and then, so: equal but for an
    element in a hundred at most, each within two bf16 steps."""
    assert (out != ref).float().mean() < 0.01
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=2**-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_rms_norm(native_ops, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(104)  # a seed whose bf16 rows land on a rounding edge
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = torch.randn(96, generator=gen)
    norm = norm.to(dtype)
    x = torch.randn(64, 3, 96, generator=gen).to(dtype)[:, 1]  # rows of a strided view, as q/k norms see them
    ref = norm(x)
    install_ops(norm, NativeCpuOps())
    out = norm(x)
    assert out.shape == ref.shape and out.dtype == dtype
    if dtype == torch.bfloat16:  # the float32 sum of squares is vectorized: its order differs from torch's
        assert_bf16_matches(out, ref)
    else:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_rotary_in_place(native_ops, dtype: torch.dtype, rotary_fraction: float) -> None:
    from types import SimpleNamespace

    cfg = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if rotary_fraction != 1.0:
        cfg.rope_parameters["partial_rotary_factor"] = rotary_fraction
    rope = RotaryEmbedding(cfg, 32, 64)
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (4 + 2 + 2) * 32, generator=gen).to(dtype)  # q, k: strided views of one projection
    q, k, _ = qkv.split([128, 64, 64], dim=-1)
    q, k = q.reshape(5, 4, 32), k.reshape(5, 2, 32)
    positions = torch.tensor([0, 3, 9, 10, 63])
    ref_q, ref_k = rope(positions, q.clone(), k.clone())
    install_ops(rope, NativeCpuOps())
    out_q, out_k = rope(positions, q, k)
    assert out_q.data_ptr() == q.data_ptr(), "the native rotary works in place"
    with pytest.raises(RuntimeError, match="outside the table"):
        rope(torch.tensor([0, 1, 2, 3, 64]), q, k)
    for out, ref in ((out_q, ref_q), (out_k, ref_k)):
        if dtype == torch.bfloat16:
            assert_bf16_matches(out, ref)
        else:
            torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_silu_and_mul(native_ops, dtype: torch.dtype) -> None:
    x = (torch.randn(9, 2 * 40, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    out = torch.ops.ember.silu_and_mul(x)
    ref = TorchOps().silu_and_mul(x)
    if dtype == torch.bfloat16:
        assert_bf16_matches(out, ref)
    else:
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_native_write_kv(native_ops) -> None:
    kv = torch.full((2, 6, 4, 2, 8), float("nan"))
    ref_kv = kv.clone()
    rows = torch.randn(5, 3, 2, 8)  # [T, k|v|other, Hkv, D]: key and value are strided views
    slots = torch.tensor([7, -1, 0, 23, 12])
    write_kv_cpu(rows[:, 0], rows[:, 1], kv[0], kv[1], slots)
    write_kv_torch(rows[:, 0], rows[:, 1], ref_kv[0], ref_kv[1], slots)
    torch.testing.assert_close(kv, ref_kv, atol=0.0, rtol=0.0, equal_nan=True)
    with pytest.raises(RuntimeError, match="outside the cache"):
        write_kv_cpu(rows[:, 0], rows[:, 1], kv[0], kv[1], torch.tensor([0, 1, 2, 3, 24]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_outputs_round_like_torch(native_ops, dtype: torch.dtype) -> None:
    """bf16 / fp16 activations are widened and the float32 result rounded inside the op: the same
    values as the float32 op followed by torch's conversion (round to nearest even, NaN and inf kept)."""
    gen = torch.Generator().manual_seed(5)
    w = pack_bf16(torch.randn(300, 200, generator=gen).bfloat16())
    for m in (1, 2, 7, 50):
        x = torch.randn(m, 200, generator=gen).mul(30).to(dtype)
        x[0, :3] = torch.tensor([float("nan"), float("inf"), 0.0])
        out = gemm_bf16(x, w, 300)
        assert out.dtype == dtype
        ref = gemm_bf16(x.float(), w, 300).to(dtype)
        torch.testing.assert_close(out, ref, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_gemm_is_batch_invariant(native_ops, fmt: str) -> None:
    """Each output is one FMA chain over k whatever the batch: rows alone equal rows in any batch
    (1-3 rows take the multi-block tiles (1-8 on AVX-512), the rest up to 11 the one-block
    micro-kernel, 12+ the widened block;
    k = 300 is two passes of the many-row path, 120 rows a 96-row chunk and a 24-row one)."""
    gen = torch.Generator().manual_seed(3)
    dense = torch.randn(200, 300, generator=gen)  # 13 blocks, the last one ragged
    x = torch.randn(120, 300, generator=gen).bfloat16()
    if fmt == "bf16":
        w = pack_bf16(dense.bfloat16())
        run = lambda rows: gemm_bf16(x[rows], w, 200)  # noqa: E731
    else:
        w, scale = pack_fp8(dense.mul(30).to(FP8)), torch.tensor([0.03])
        run = lambda rows: gemm_fp8(x[rows], w, scale, 200)  # noqa: E731
    full = run(slice(0, 120))
    for rows in (slice(0, 1), slice(5, 7), slice(10, 13), slice(20, 24), slice(30, 37), slice(40, 100)):
        assert torch.equal(run(rows), full[rows]), rows


def test_bf16_layout_follows_the_cpu(native_ops) -> None:
    """The bf16 layout is the best kernel this build and CPU run: AMX tiles where granted, else the
    AVX512-BF16 `vdpbf16ps` kernels on the same bytes ("pairs32": Zen 4 / 5), else the FMA kernels'
    "packed16" (AVX2, or an AVX-512 build without BF16). On "pairs32" rows alone equal rows in any
    batch for bf16 and float32 activations (three bf16 terms) over several passes of 256 pairs of k,
    a walk of four blocks and a ragged rest, and float32 activations keep float32's precision."""
    flags = set(open("/proc/cpuinfo").read().split())
    march = os.environ.get("EMBER_CPU_MARCH", "").strip()
    layout = bf16_layout()
    if layout != "amx32" and march in ("", "native"):  # another march's build: its own flags decide
        assert layout == ("pairs32" if "avx512_bf16" in flags else "packed16"), layout
    if layout != "pairs32":
        pytest.skip(f"the pair kernels do not run here (layout {layout})")
    gen = torch.Generator().manual_seed(5)
    n, k = 16 * 9 + 7, 1100  # 10 blocks: two walks of four, a rest of two; 550 pairs: three passes
    dense = torch.randn(n, k, generator=gen)
    w = pack_bf16(dense.bfloat16())
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(40, k, generator=gen).to(dtype)
        full = gemm_bf16(x, w, n)
        for rows in (slice(0, 1), slice(3, 5), slice(7, 10), slice(10, 17), slice(17, 40)):
            assert torch.equal(gemm_bf16(x[rows], w, n), full[rows]), (dtype, rows)
        exact = x.double() @ dense.bfloat16().double().t()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(full.double(), exact, atol=tol, rtol=tol)


def test_bench_gemm_prints_its_rows(
    native_ops, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tools.bench_gemm import main

    monkeypatch.setenv("EMBER_CPU_KERNELS", "native")  # it measures the native ops, whatever the suite runs

    threads = torch.get_num_threads()
    try:
        assert main(["--shapes", "40:33", "--rows", "1,17", "--threads", str(threads)]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 40 x 33 |")]
    assert [r.split(" | ")[1] for r in rows] == ["1", "17"]
    assert all(float(r.split(" | ")[2]) > 0 for r in rows)
