"""One mixture-of-experts layer on the CPU: the native one-call layer against the torch reference.

A repository script (not installed): `python -m tools.bench_moe [--formats Q4_K,bf16] [--rows 1,32,512]`
builds one MoE layer of random weights in each format (default: Granite-3-1B-A400M's shapes, hidden
1024, 32 experts of 512, top-8) and times, per row count, `torch.ops.ember.moe_forward`
(kernels/csrc/cpu_moe.cpp) beside the same layer on the torch reference path (the same native
matmuls, called per expert from Python), printing ms per call and GB/s of the weights the selected
experts hold (each selected expert's bytes counted once per call). `random_layer` and
`random_blocks` also serve the kernel tests.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tools.bench_gemm import timed
from workers.gguf.weights import GGUFTensor
from workers.loader import quantize
from workers.models.moe import MoEMLP, MoEParts
from workers.models.ops import TORCH_OPS, NativeCpuOps, install_ops
from workers.parallel import TPGroup
from workers.quant import make_method

T = GGMLQuantizationType
# byte offsets of each type's float16 fields (scales, mins): random bytes elsewhere are valid blocks
F16_FIELDS = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q4_K: [0, 2]}
F16_FIELDS |= {T.Q5_K: [0, 2], T.Q6_K: [208]}
METHODS = {"fp8": "fp8_per_tensor", "int8": "int8", "int4": "int4"}  # --quantization of the others


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """n x k weights of random valid blocks of `qtype` (small float16 scales and mins), flat bytes."""
    block, size = GGML_QUANT_SIZES[T(qtype)]
    gen = torch.Generator().manual_seed(qtype + n + seed)
    raw = torch.randint(0, 256, (n * k // block, size), dtype=torch.uint8, generator=gen)
    for offset in F16_FIELDS[T(qtype)]:
        halves = (torch.rand(raw.shape[0], generator=gen) * 0.1).half()
        raw[:, offset : offset + 2] = halves.view(torch.uint8).view(-1, 2)
    return raw.reshape(-1)


def random_layer(moe: MoEParts, fmt: str, hidden: int, seed: int = 0) -> MoEMLP:
    """A MoE layer of seeded random weights in `fmt` (bf16, fp8, int8, int4 or a GGUF type name),
    processed as the loader processes a checkpoint's."""
    gen = torch.Generator().manual_seed(seed)
    gguf = fmt.startswith("Q")
    method = make_method(METHODS.get(fmt), "cpu_bf16", gguf)
    layer = MoEMLP(SimpleNamespace(hidden_size=hidden), TPGroup(), moe, "silu", method)
    experts = [*layer.experts, *([layer.shared_expert] if layer.shared_expert is not None else [])]
    with torch.no_grad():
        for router in (layer.gate, layer.shared_expert_gate):
            if router is not None:
                router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * 0.5)
        if layer.gate.e_score_correction_bias is not None:
            layer.gate.e_score_correction_bias.copy_(torch.randn(moe.num_experts, generator=gen) * 0.1)
        for i, expert in enumerate(experts):
            for lin, shards in ((expert.gate_up_proj, (0, 1)), (expert.down_proj, (None,))):
                if not gguf:
                    lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.05)
                    continue
                for shard in shards:
                    n, k = lin.weight.shape[0] // len(shards), lin.weight.shape[1]
                    raw = random_blocks(T[fmt], n, k, seed=seed + 7 * i + (shard or 0)).view(n, -1)
                    lin.quant.load_quantized(lin, GGUFTensor(raw, T[fmt], (n, k)), shard)
    quantize(layer)
    return layer


def expert_bytes(layer: MoEMLP) -> float:
    """Bytes of one routed expert's weights as the native op reads them."""
    assert layer.native is not None
    total = sum(w.numel() * w.element_size() for w in layer.native.weights)
    shared = layer.moe.shared_intermediate / layer.moe.intermediate
    return total / (layer.moe.num_experts + shared)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench_moe", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=512, help="one expert's")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--formats", default="Q4_K,Q6_K,Q8_0,bf16")
    p.add_argument("--rows", default="1,4,32,512")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kernels.native import use_native

    if not use_native("cpu"):
        print("error: the native CPU ops do not run here", file=sys.stderr)
        return 2
    moe = MoEParts(args.experts, args.top_k, args.intermediate, renormalize=True)
    print(f"hidden {args.hidden}, {args.experts} experts of {args.intermediate}, top-{args.top_k}, "
          f"{args.threads} threads")  # fmt: skip
    head = ("format", "rows", "experts hit", "native ms", "GB/s", "torch path ms")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (6, 5, 11, 10, 6, 14), strict=True)))
    for fmt in args.formats.split(","):
        layer = random_layer(moe, fmt, args.hidden)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.hidden, generator=torch.Generator().manual_seed(rows)).bfloat16()
            with torch.no_grad():
                install_ops(layer, TORCH_OPS)
                reference = timed(layer, x)
                install_ops(layer, NativeCpuOps())
                native = timed(layer, x)
                layer.expert_load.zero_()
                layer(x)
            hit = int((layer.expert_load > 0).sum())
            gbs = hit * expert_bytes(layer) / native / 1e6
            print(f"{fmt:>6} {rows:>5} {hit:>11} {native:>10.3f} {gbs:>6.1f} {reference:>14.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
