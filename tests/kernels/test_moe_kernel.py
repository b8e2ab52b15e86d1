"""The fused MoE layer (workers/models/moe.py, kernels/csrc/cpu_moe.cpp) against its references.

Routing against transformers' own routers (softmax top-k, Granite's top-k softmax, GLM-4.5's sigmoid
with the correction bias and grouped top-k); the torch reference against a dense reference (every
expert on every token, weighted by the routing); the native one-call layer against the torch
reference for random shapes, top-k and skewed routings (every token to one expert too), on every
expert weight format the native matmuls run: packed bf16, fp8, int8, int4 and GGUF's Q8_0, Q4_K,
Q5_K and Q6_K bits. Run: `pytest -q tests/kernels/test_moe_kernel.py`.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tools.bench_moe import random_layer
from workers.loader import quantize
from workers.models.moe import MoEMLP, MoEParts, route
from workers.models.ops import TORCH_OPS, NativeCpuOps, install_ops
from workers.parallel import TPGroup
from workers.quant import make_method

ROUTINGS = {
    "top2-renorm": MoEParts(8, 2, 256, renormalize=True),
    "top3-topk-softmax": MoEParts(5, 3, 256, "topk_softmax"),
    "top1-shared-gate": MoEParts(6, 1, 256, shared_intermediate=256, shared_gate=True),
    "sigmoid-grouped": MoEParts(
        8, 3, 256, "sigmoid", renormalize=True, shared_intermediate=256, groups=4, topk_groups=2,
        routed_scale=2.5, correction_bias=True,
    ),
}  # fmt: skip
FORMATS = ("bf16", "fp8", "int8", "int4", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
HIDDEN = 256  # whole superblocks of the K-quants along both the hidden and the expert sizes


def layer_of(moe: MoEParts, fmt: str, hidden: int = HIDDEN, seed: int = 0) -> MoEMLP:
    return random_layer(moe, fmt, hidden, seed)


def inputs(skew: str, tokens: int, layer: MoEMLP) -> torch.Tensor:
    """Activations [tokens, hidden] in bf16; "one-expert": the router sends every token to expert 3
    first (the others in a fixed order after it: no ties)."""
    x = torch.randn(tokens, layer.gate.weight.shape[1], generator=torch.Generator().manual_seed(tokens))
    if skew == "one-expert":
        with torch.no_grad():
            layer.gate.weight.copy_(torch.arange(layer.moe.num_experts)[:, None] * 0.004)
            layer.gate.weight[3] = 0.1
        x = x.abs()
    return x.bfloat16()


def run(layer: MoEMLP, x: torch.Tensor, native: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output and the tokens per expert it counted, on the native op or the reference."""
    install_ops(layer, NativeCpuOps() if native else TORCH_OPS)
    assert (layer.native is not None) == native
    layer.expert_load.zero_()
    with torch.no_grad():
        out = layer(x)
    return out, layer.expert_load.clone()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_native_layer_equals_the_reference(native_kernels, routing: str, fmt: str) -> None:
    moe = ROUTINGS[routing]
    layer = layer_of(moe, fmt)
    for skew, tokens in (("random", 1), ("random", 3), ("random", 19), ("one-expert", 9)):
        x = inputs(skew, tokens, layer)
        (got, load), (expected, expected_load) = run(layer, x, True), run(layer, x, False)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        assert torch.equal(load, expected_load) and int(load.sum()) == tokens * moe.top_k
        if skew == "one-expert" and moe.scoring != "sigmoid":
            assert int(load[3]) == tokens
        # the same matmuls and float32 sums: at most a rounding of the bf16 output apart
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("fmt", ["bf16", "Q4_K", "Q6_K"])
def test_decode_schedule_gives_the_bits_of_the_two_phase_one(native_kernels, fmt: str) -> None:
    """A decode step's few rows per expert run a whole expert per work item on two or more threads
    (cpu_moe.cpp's run_whole_experts); one thread runs the two-phase schedule (every gate/up, then
    every down): the same bits, whatever the schedule or thread count."""
    layer = layer_of(MoEParts(8, 4, 256, renormalize=True, shared_intermediate=256), fmt)
    install_ops(layer, NativeCpuOps())
    threads = torch.get_num_threads()
    try:
        for tokens in (1, 2, 5):
            x = inputs("random", tokens, layer)
            with torch.no_grad():
                torch.set_num_threads(max(2, threads))
                many = layer(x)
                torch.set_num_threads(1)
                one = layer(x)
            assert torch.equal(many, one), tokens
    finally:
        torch.set_num_threads(threads)


def dense_reference(layer: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the routing (zero for experts not picked)."""
    weights, ids = route(layer.gate(x), layer.moe, layer.gate.e_score_correction_bias)
    full = torch.zeros(x.shape[0], layer.moe.num_experts, dtype=torch.float32)
    full.scatter_(1, ids, weights)
    out = sum(full[:, e, None] * layer.experts[e](x).float() for e in range(layer.moe.num_experts))
    if layer.shared_expert is not None:
        gate = torch.sigmoid(layer.shared_expert_gate(x)) if layer.shared_expert_gate is not None else 1.0
        out = out + gate * layer.shared_expert(x).float()
    return out


@pytest.mark.parametrize("skew", ["random", "one-expert"])
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_reference_equals_the_dense_reference(routing: str, skew: str) -> None:
    torch.manual_seed(0)
    moe = ROUTINGS[routing]
    layer = MoEMLP(SimpleNamespace(hidden_size=32), TPGroup(), moe, "silu", None)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    x = inputs(skew, 37, layer).float()
    with torch.no_grad():
        got, expected = layer(x), dense_reference(layer, x)
    if skew == "one-expert" and moe.scoring != "sigmoid":
        assert bool((route(layer.gate(x), moe)[1][:, 0] == 3).all())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def hf_router(kind: str, experts: int, top_k: int):
    """transformers' router of a family, with random weights: (module, routing parts, bias or None)."""
    import transformers

    gen = torch.Generator().manual_seed(1)
    if kind == "glm4_moe":
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

        cfg = transformers.Glm4MoeConfig(
            hidden_size=32, n_routed_experts=experts, num_experts_per_tok=top_k, n_group=4, topk_group=2,
            routed_scaling_factor=2.5, norm_topk_prob=True,
        )  # fmt: skip
        router = Glm4MoeTopkRouter(cfg)
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.1)
        parts = MoEParts(
            experts, top_k, 8, "sigmoid", renormalize=True, groups=4, topk_groups=2, routed_scale=2.5,
            correction_bias=True,
        )  # fmt: skip
        return router, parts, router.e_score_correction_bias
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    cfg = transformers.MixtralConfig(hidden_size=32, num_local_experts=experts, num_experts_per_tok=top_k)
    return MixtralTopKRouter(cfg), MoEParts(experts, top_k, 8, renormalize=True), None


@pytest.mark.parametrize("kind", ["mixtral", "glm4_moe"])
def test_routing_equals_transformers(native_kernels, kind: str) -> None:
    """route() and the native op's routing pick transformers' experts with its weights."""
    router, parts, bias = hf_router(kind, 16, 4)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(2)))
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3)).bfloat16().float()
        hf = router(x)
        hf_weights, hf_ids = hf[1], hf[2]
        weights, ids = route(torch.nn.functional.linear(x, router.weight.float()), parts, bias)
    order, hf_order = ids.sort(dim=-1), hf_ids.sort(dim=-1)
    assert torch.equal(order.values, hf_order.values)
    hf_sorted = hf_weights.float().gather(1, hf_order.indices)
    torch.testing.assert_close(weights.gather(1, order.indices), hf_sorted)
    # the native op counts the same experts
    layer = MoEMLP(SimpleNamespace(hidden_size=32), TPGroup(), parts, "silu", make_method(None, "cpu_bf16"))
    with torch.no_grad():
        layer.gate.weight.copy_(router.weight)
        if bias is not None:
            layer.gate.e_score_correction_bias.copy_(bias)
        for p in layer.experts.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
    quantize(layer)
    _, load = run(layer, x.bfloat16(), True)
    assert torch.equal(load, torch.bincount(ids.flatten(), minlength=16))


@pytest.mark.parametrize("skew", ["random", "one-expert"])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 5, 2), (7, 6, 3), (37, 8, 2)])
def test_triton_grouped_experts_equal_the_reference(tokens: int, experts: int, top_k: int, skew: str) -> None:
    """The CUDA kernel (here under the Triton interpreter) against its torch reference: odd sizes,
    tiles padded past each expert's tokens, every token to one expert."""
    from kernels.moe_grouped import grouped_experts_torch, grouped_experts_triton

    gen = torch.Generator().manual_seed(tokens + experts)
    hidden, inter = 40, 24
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    scores = torch.randn(tokens, experts, generator=gen)
    if skew == "one-expert":
        scores[:, 3] += 100.0
    weights, ids = torch.topk(torch.softmax(scores, dim=-1), top_k, dim=-1)
    got = grouped_experts_triton(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, grouped_experts_torch(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("routing", ["top3-topk-softmax", "sigmoid-grouped"])
def test_stacked_experts_on_the_grouped_kernel_equal_the_reference(routing: str) -> None:
    """The CUDA path of the layer (unquantized experts stacked, no second copy, the Triton kernel;
    here interpreted) gives the torch path's output and counts."""
    shared = 24 if ROUTINGS[routing].shared_intermediate else 0
    moe = dataclasses.replace(ROUTINGS[routing], intermediate=24, shared_intermediate=shared)
    layer = MoEMLP(SimpleNamespace(hidden_size=40), TPGroup(), moe, "silu", make_method(None))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
    x = torch.randn(13, 40, generator=torch.Generator().manual_seed(5))
    expected, expected_load = run(layer, x, False)
    assert layer.stack_experts()
    assert layer.experts[2].down_proj.weight.data_ptr() == layer.stacked["down_proj"][2].data_ptr()
    layer.expert_load.zero_()
    with torch.no_grad():
        got = layer(x)
    assert torch.equal(layer.expert_load, expected_load)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
