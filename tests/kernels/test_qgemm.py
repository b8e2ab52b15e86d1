"""Tests of the integer-dot CPU matmul for group-quantized weights (kernels/qgemm.py, csrc/cpu_qgemm.cpp).

Every format (i8 with groups of 32 and 16, i8, u4 and u5 with zero points or offsets) round-trips through
its packed layout exactly; the native op quantizes activations exactly as the torch reference does (per
32 k, and per 256 k for the K-quants' superblocks, whose sums are integers over a superblock) and
equals the reference (quantized activations @ dequantized weight) within float32 summation order over
every row-count path (1-3 rows against multi-block tiles, 4-row tiles and their 1-3 row tails, more
than one 256-k chunk; with 512-bit vectors, 16+ rows over two blocks and an odd last one), odd input
sizes (padded to 32) and ragged output blocks; rows are bit-identical whatever the batch; the int8 /
int4 methods pack for it under the cpu_bf16 kernel.
Run: `pytest -q tests/kernels/test_qgemm.py` (the first run builds the ops, under a minute).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kernels.qgemm import QFormat, pack_qweight, qgemm, qgemm_torch, quantize_activations, unpack_qweight
from workers.quant import make_method
from workers.quant.packed import PackedBf16

pytestmark = pytest.mark.model
REPO = Path(__file__).resolve().parents[2]

FORMATS = [
    QFormat("i8"),
    QFormat("i8", group=16),
    QFormat("i8", half=True),
    QFormat("i8", offsets=True),  # no GGUF type, but the op takes it: the i8 kernels' minimums path
    QFormat("i8", zero=3, half=True),
    QFormat("u4", offsets=True),
    QFormat("u4", zero=8),
    QFormat("u4", offsets=True, half=True),
    QFormat("u5", zero=16),
    QFormat("u5", offsets=True),
    QFormat("u5", zero=16, half=True),
    QFormat("u6", group=16, zero=32),
    QFormat("u6", group=16, offsets=True, half=True),
]
# the K-quants' own parameters: int8 sub-scales (and mins) times a float32 per row and 256 k
SUPER_FORMATS = [
    QFormat("i8", group=16, superblock=True),
    QFormat("u6", group=16, zero=32, superblock=True),  # Q6_K
    QFormat("u4", offsets=True, superblock=True),  # Q4_K
    QFormat("u5", offsets=True, superblock=True),  # Q5_K
]


def fmt_id(f: QFormat) -> str:
    base = f"{f.kind}-g{f.group}-z{f.zero}-o{int(f.offsets)}-h{int(f.half)}"
    return base + ("-super" if f.superblock else "")


def random_weight(fmt: QFormat, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed, float64 dense weight it stands for, integers)."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // fmt.group)
    if fmt.kind == "i8":
        q = torch.randint(-127, 128, (n, k), generator=gen).to(torch.int8)
    else:
        top = {"u4": 16, "u5": 32, "u6": 64}[fmt.kind]
        q = torch.randint(0, top, (n, k), generator=gen).to(torch.uint8)
    supers = None
    if fmt.superblock:  # signed 8-bit sub-scales (Q6_K's; 6-bit in Q4_K), 6-bit mins, float16 d and dmin
        lo, hi = (-128, 128) if fmt.kind == "i8" else (0, 64)
        sub = torch.randint(lo, hi, (n, groups), generator=gen)
        mins = torch.randint(0, 64, (n, groups), generator=gen) if fmt.offsets else None
        supers = (torch.rand(n, k // 256, 2 if fmt.offsets else 1, generator=gen) * 1e-3).half().float()
        if fmt.offsets:
            supers[..., 1] = -supers[..., 1]
        per_group = supers.repeat_interleave(fmt.subs, dim=1)
        scales, offsets = sub.to(torch.int8), None if mins is None else mins.to(torch.int8)
        scale_f, offset_f = sub * per_group[..., 0], None if mins is None else mins * per_group[..., 1]
    else:
        scales = torch.rand(n, groups, generator=gen) * 0.02 + 1e-3
        offsets = torch.randn(n, groups, generator=gen) * 0.1 if fmt.offsets else None
        if fmt.half:  # float16 parameters hold float16 values (GGUF's)
            scales = scales.half().float()
            offsets = None if offsets is None else offsets.half().float()
        scale_f, offset_f = scales, offsets
    per = lambda t: t.double().repeat_interleave(fmt.group, dim=1)[:, :k]
    qd = q.double()
    dense = qd * per(scale_f) + per(offset_f) if offset_f is not None else (qd - fmt.zero) * per(scale_f)
    return pack_qweight(q, scales, fmt, offsets, supers), dense, q


@pytest.mark.parametrize("fmt", FORMATS + SUPER_FORMATS, ids=fmt_id)
def test_layout_round_trips(fmt: QFormat) -> None:
    shapes = ((16, 256), (33, 512), (5, 768)) if fmt.superblock else ((16, 32), (33, 100), (5, 300))
    for n, k in shapes:
        packed, dense, _ = random_weight(fmt, n, k, n + k)
        units = -(-k // 32) * 32 // fmt.group // fmt.subs
        assert packed.dtype == torch.uint8 and packed.shape[:2] == (-(-n // 16), units)
        torch.testing.assert_close(unpack_qweight(packed, fmt, n, k).double(), dense, atol=1e-6, rtol=1e-6)


def test_activations_are_quantized_like_the_reference(native_ops) -> None:
    """An identity weight (i8, scale 1) returns the op's quantized activations: equal to the reference."""
    k = 96
    q = torch.eye(k, dtype=torch.int8)
    packed = pack_qweight(q, torch.ones(k, k // 32), QFormat("i8"))
    x = torch.randn(7, k) * torch.logspace(-3, 2, k)
    x[3, :32] = 0.0  # an all-zero group: scale 0, no division by zero
    assert torch.equal(qgemm(x, packed, QFormat("i8"), k), quantize_activations(x))


def test_superblock_activations_are_quantized_per_256(native_ops) -> None:
    """A u6 identity (q - 32 = 1 on the diagonal, sub-scales and d 1) returns the superblock path's
    activations, quantized per 256 k (Q8_K's groups): equal to the reference with that group, and not
    the per-32 quantization of the other formats."""
    k = 512
    fmt = QFormat("u6", group=16, zero=32, superblock=True)
    assert fmt.xgroup == 256 and QFormat("u4", offsets=True).xgroup == 32
    q = (torch.eye(k) + 32).to(torch.uint8)
    packed = pack_qweight(q, torch.ones(k, k // 16, dtype=torch.int8), fmt, None, torch.ones(k, 2, 1))
    x = torch.randn(5, k) * torch.logspace(-3, 2, k)
    x[2, 256:] = 0.0  # an all-zero superblock: scale 0
    for m in (1, 5):  # the few-row and the many-row path
        out = qgemm(x[:m], packed, fmt, k)
        assert torch.equal(out, quantize_activations(x[:m], 256))
        assert not torch.equal(out, quantize_activations(x[:m]))


ROWS = [1, 2, 3, 4, 6, 11, 13, 18, 40]
CASES = [(f, n, k) for f in FORMATS for n, k in [(17, 64), (70, 100), (200, 32), (33, 608)]]
CASES += [(f, n, k) for f in SUPER_FORMATS for n, k in [(17, 256), (70, 512), (33, 768)]]


def case_id(c: object) -> str:
    return fmt_id(c) if isinstance(c, QFormat) else str(c)


@pytest.mark.parametrize(("fmt", "n", "k"), CASES, ids=case_id)
@pytest.mark.parametrize("m", ROWS)
def test_qgemm_matches_reference(native_ops, fmt: QFormat, m: int, n: int, k: int) -> None:
    packed, dense, _ = random_weight(fmt, n, k, m * 1000 + n + k)
    gen = torch.Generator().manual_seed(m + n)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(m, k, generator=gen).to(dtype)
        out = qgemm(x, packed, fmt, n)
        assert out.shape == (m, n) and out.dtype == dtype
        ref = qgemm_torch(x, packed, fmt, n)
        exact = quantize_activations(x, fmt.xgroup).double() @ dense.t()
        tol = 2e-6 * k if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.double(), exact, atol=tol, rtol=tol)
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
        if m > 1:  # batch invariance: a row's result does not depend on the rows beside it
            assert torch.equal(qgemm(x[:1], packed, fmt, n), out[:1])
            assert torch.equal(qgemm(x[m - 1 :], packed, fmt, n), out[m - 1 :])


@pytest.mark.parametrize("fmt", [f for f in SUPER_FORMATS if f.kind != "i8"], ids=fmt_id)
def test_tile_path_equals_the_vector_path(native_ops, fmt: QFormat) -> None:
    """The K-quants' many-row products on AMX tiles (where this build and CPU have them: torch.ops.ember.
    qgemm_tiles) give every row the bits of the row alone on the vector path (cpu_qamx.h): rows on both
    sides of each format's threshold, 16-row tiles with padding, thread chunks of 8 blocks with a rest,
    a partial last block and several superblocks."""
    n, k = 200, 1280
    packed, dense, _ = random_weight(fmt, n, k, 7)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(70, k, generator=gen).bfloat16()
    alone = torch.cat([qgemm(x[i : i + 1], packed, fmt, n) for i in range(x.shape[0])])
    for m in (8, 15, 16, 17, 33, 70):
        assert torch.equal(qgemm(x[:m], packed, fmt, n), alone[:m]), f"{m} rows"
    exact = quantize_activations(x.float(), fmt.xgroup).double() @ dense.t()
    torch.testing.assert_close(alone.double(), exact, atol=1e-2, rtol=1e-2)
    tiles = "on" if torch.ops.ember.qgemm_tiles() else "not built or not granted here"
    print(f"{fmt_id(fmt)}: tile path {tiles}")


WALK_SCRIPT = """
import sys, torch
from kernels.native import load_native
from kernels.qgemm import QFormat, qgemm
assert load_native() is None
case = torch.load(sys.argv[1])
print(list(torch.ops.ember.qgemm_walk()))
out = {
    name: [qgemm(x, packed, QFormat(**attrs), n) for x in case["xs"]]
    for name, (attrs, packed, n) in case["w"].items()
}
torch.save(out, sys.argv[2])
"""


def test_few_row_walk_is_chosen_per_cpu_and_never_changes_bits(native_ops, tmp_path) -> None:
    """The K-quants' one-to-three-row products stream the weight once, walking one block at a time with
    the hardware prefetcher alone on AMD cores and the build's widest walk with software prefetch elsewhere
    (cpu_qsuper.h, few_walk); $EMBER_QWALK overrides it, a malformed value is refused, and every walk
    gives the same bits for 1, 2 and 3 rows (the walk only orders the blocks)."""
    import subprocess
    import sys

    walk = list(torch.ops.ember.qgemm_walk())
    amd = "AuthenticAMD" in open("/proc/cpuinfo").read()
    widest = walk[2]  # 4 with 512-bit vectors, 2 with 256-bit ones
    assert widest in (2, 4) and walk[:2] == ([1, 0] if amd else [widest, 16]), walk
    gen = torch.Generator().manual_seed(3)
    weights = {}
    for f in SUPER_FORMATS[1:]:
        n = 16 * 9 + 5  # blocks past a walk of four, and a partial one
        weights[fmt_id(f)] = (f.attrs(), random_weight(f, n, 768, 3)[0], n)
    xs = [torch.randn(m, 768, generator=gen).bfloat16() for m in (1, 2, 3)]
    torch.save({"xs": xs, "w": weights}, tmp_path / "case.pt")
    here = {
        name: [qgemm(x, packed, QFormat(**attrs), n) for x in xs]
        for name, (attrs, packed, n) in weights.items()
    }
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for value in ("1:0", "4:16", "4:0"):
        run = subprocess.run(
            [sys.executable, "-c", WALK_SCRIPT, str(tmp_path / "case.pt"), str(tmp_path / "out.pt")],
            env=dict(env, EMBER_QWALK=value),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        blocks, ahead = (int(v) for v in value.split(":"))
        assert run.stdout.split()[-3:-1] == [f"[{1 if blocks == 1 else widest},", f"{ahead},"], run.stdout
        there = torch.load(tmp_path / "out.pt")
        for name, outs in here.items():
            for m, (a, b) in enumerate(zip(outs, there[name]), 1):
                assert torch.equal(a, b), f"{name}, {m} rows, walk {value}"
    bad = subprocess.run(
        [sys.executable, "-c", WALK_SCRIPT, str(tmp_path / "case.pt"), str(tmp_path / "out.pt")],
        env=dict(env, EMBER_QWALK="fast"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode != 0 and "EMBER_QWALK must be BLOCKS:AHEAD" in bad.stderr


def test_qgemm_refuses_mismatched_shapes(native_ops) -> None:
    fmt = QFormat("u4", offsets=True)
    packed, _, _ = random_weight(fmt, 32, 64, 0)
    with pytest.raises(RuntimeError, match="mismatch"):
        qgemm(torch.randn(2, 128), packed, fmt, 32)
    with pytest.raises(RuntimeError, match="n does not match"):
        qgemm(torch.randn(2, 64), packed, fmt, 48)
    with pytest.raises(RuntimeError, match="unit bytes"):
        qgemm(torch.randn(2, 64), packed, QFormat("u4", zero=8), 32)


def test_int8_method_packs_groups_for_the_native_kernel(native_ops) -> None:
    """Under the cpu_bf16 kernel, int8 packs Q8_0-style groups (a bf16 head beside it), odd input sizes
    included (padded), and applies like the reference on its integers (and like the bf16 matmul within
    the error of Q8_0 weights and int8 activations)."""
    method = make_method("int8", "cpu_bf16")
    assert method.params == {"layout": "cpu_int8_q8_0_qgemm"}
    assert isinstance(method.head_method(), PackedBf16) and make_method("int8", "torch").head_method() is None
    for k in (64, 40):
        layer = torch.nn.Module()
        method.create_weights(layer, 24, k)
        w = torch.randn(24, k, generator=torch.Generator().manual_seed(k)).bfloat16()
        layer.weight.data = w.clone()
        method.process_weights_after_loading(layer)
        assert layer.weight.dtype == torch.uint8 and layer.weight_scale.numel() == 0
        assert layer.quant_attrs["kind"] == "i8" and layer.quant_attrs["in_features"] == k
        x = torch.randn(5, k).bfloat16()
        out = method.apply(layer, x, torch.ones(24, dtype=torch.bfloat16))
        assert out.dtype == torch.bfloat16
        dense = unpack_qweight(layer.weight, QFormat("i8"), 24, k)
        ref = quantize_activations(x) @ dense.t() + 1
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)  # out is rounded to bf16
        torch.testing.assert_close(out.float(), x.float() @ w.float().t() + 1, atol=0.3, rtol=0.05)


def test_int4_method_packs_for_the_native_kernel(native_ops) -> None:
    """Under the cpu_bf16 kernel, int4 with groups of 32 packs its exact values (float32 scales and
    offsets) for the native matmul; other group sizes (and inputs they do not divide) keep int4's own
    layout."""
    from kernels.int4_matmul import dequantize_int4
    from workers.quant.int4 import quantize_groupwise

    for k, group, native_layout in ((64, 32, True), (48, 32, False), (64, 64, False)):
        method = make_method("int4", "cpu_bf16", group_size=group)
        gen = torch.Generator().manual_seed(k + group)
        w = torch.randn(24, k, generator=gen).bfloat16()
        layer = torch.nn.Module()
        method.create_weights(layer, 24, k)
        layer.weight.data = w.clone()
        method.process_weights_after_loading(layer)
        assert (layer.weight.dim() == 3) == native_layout
        x = torch.randn(5, k, generator=gen).bfloat16()
        ours = method.apply(layer, x)
        group_of = 32 if native_layout else layer.quant_attrs["group_size"]
        dense = dequantize_int4(*quantize_groupwise(w, group_of), group_of)
        if native_layout:
            fmt = QFormat("u4", offsets=True)
            torch.testing.assert_close(unpack_qweight(layer.weight, fmt, 24, k), dense, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.float(), x.float() @ dense.t(), atol=0.3, rtol=0.05)
