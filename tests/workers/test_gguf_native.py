"""GGUF quantized weights in their own bits on the CPU fast path (workers/gguf/repack.py, quant/gguf.py).

Every repackable type (Q8_0, Q6_K, Q4_0, Q5_0, Q4_1, Q5_1, Q4_K, Q5_K) becomes integers and group
parameters that stand for exactly the reference dequantization, on random blocks. Tiny GGUF files
(written by `tools.hf_to_gguf`) load on the bf16 CPU fast path with each linear in the file's own
format (fused shards of different types as segments), holding exactly the file's values (llama's q/k
rows unpermuted, a tied head packed beside its dequantized embedding), and generate like the float32
engine on the same file within the error of int8 activations.
Run: `pytest -q tests/workers/test_gguf_native.py`.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from coreproc import LLM, SamplingParams
from coreproc.base.gguf_file import GGUFFile
from kernels.qgemm import QFormat, pack_qweight, pack_qweight_torch, unpack_qweight
from tools.bench_moe import random_blocks
from tools.hf_to_gguf import write_gguf
from workers.gguf.dequant import dequantize
from workers.gguf.repack import REPACKABLE, concat, repack, repack_torch
from workers.gguf.weights import GGUFTensor, iter_gguf, pack_tensors

pytestmark = pytest.mark.model

T = GGMLQuantizationType
PROMPTS = [[1, 5, 9, 200, 31], [1, 77, 78], [1, 300, 301, 302, 303, 304, 305, 306, 42]]


@pytest.mark.parametrize("qtype", sorted(REPACKABLE), ids=lambda t: T(t).name)
def test_repack_stands_for_the_reference_dequantization(qtype: int) -> None:
    n, k = 21, 3 * GGML_QUANT_SIZES[T(qtype)][0]
    raw = random_blocks(qtype, n, k)
    part = repack(raw, qtype, (n, k))
    assert part.q.shape == (n, k) and part.scales.shape == (n, k // part.fmt.group)
    assert (part.supers is not None) == part.fmt.superblock == (block_size(qtype) == 256)
    assert torch.equal(unpack_qweight(part.pack(), part.fmt, n, k), dequantize(raw, qtype, (n, k)))
    flat = part.flat()  # float32 parameters per group (a slice that cuts a superblock)
    assert torch.equal(unpack_qweight(flat.pack(), flat.fmt, n, k), dequantize(raw, qtype, (n, k)))
    if part.fmt.superblock:
        assert part.pack().numel() < flat.pack().numel()
        cut = part.narrow_cols(32, k - 32)
        assert not cut.fmt.superblock
        assert torch.equal(cut.dequantize(), dequantize(raw, qtype, (n, k))[:, 32:])


def block_size(qtype: int) -> int:
    return GGML_QUANT_SIZES[T(qtype)][0]


@pytest.fixture(scope="module")
def native_ops(native_kernels: None) -> None:
    """The native CPU ops (the path under test); skip where they cannot build."""


@pytest.mark.parametrize("qtype", sorted(REPACKABLE), ids=lambda t: T(t).name)
@pytest.mark.parametrize("n", [1, 16, 37])
def test_native_load_time_ops_equal_the_torch_ones(native_ops, qtype: int, n: int) -> None:
    """torch.ops.ember.gguf_decode / qpack (what a GGUF file loads with) give the bytes of the torch
    references: integers, parameters and packed blocks, for rows that fill blocks or not."""
    block = GGML_QUANT_SIZES[T(qtype)][0]
    k = 2 * block
    raw = random_blocks(qtype, n, k)
    native, ref = repack(raw, qtype, (n, k)), repack_torch(raw, qtype, (n, k))
    assert native.fmt == ref.fmt and torch.equal(native.q, ref.q) and native.q.dtype == ref.q.dtype
    for name in ("scales", "offsets", "supers"):
        got, want = getattr(native, name), getattr(ref, name)
        assert (got is None) == (want is None)
        assert got is None or (got.dtype == want.dtype and torch.equal(got, want)), name
    packed = native.pack()
    assert torch.equal(packed, pack_qweight_torch(ref.q, ref.scales, ref.fmt, ref.offsets, ref.supers))


@pytest.mark.parametrize("qtype", sorted(REPACKABLE), ids=lambda t: T(t).name)
def test_packing_straight_from_the_bytes_equals_repack_then_pack(native_ops, qtype: int) -> None:
    """`pack_tensors` (torch.ops.ember.gguf_pack, what a GGUF layer loads with): shards of 16 and 37 rows,
    a column slice at block boundaries (strided rows) and zero padding rows give the bytes of the parts
    repacked, stacked and packed; a shard before the last that cuts a block of rows falls back."""
    block = GGML_QUANT_SIZES[T(qtype)][0]
    k = 3 * block
    a, b = (
        GGUFTensor(random_blocks(qtype, 16, k), qtype, (16, k)),
        GGUFTensor(random_blocks(qtype, 37, k), qtype, (37, k)),
    )
    a.raw, b.raw = a.raw.view(16, -1), b.raw.view(37, -1)
    got = pack_tensors([a, b], 60)
    want = concat([a.repack(), b.repack().pad_rows(44)]).pack()
    assert got is not None and torch.equal(got, want)
    cut = b.narrow_cols(block, 2 * block)
    assert cut is not None and not cut.raw.is_contiguous()
    got = pack_tensors([cut.narrow_rows(3, 30)], 30)
    assert got is not None and torch.equal(
        got, b.repack().narrow_cols(block, 2 * block).narrow_rows(3, 30).pack()
    )
    assert b.narrow_cols(block // 2, block) is None
    assert pack_tensors([b, a], 53) is None


@pytest.mark.parametrize("qtype", sorted(REPACKABLE), ids=lambda t: T(t).name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_dequantize_equals_the_reference(native_ops, qtype: int, dtype: torch.dtype) -> None:
    """An embedding's rows through the native repack: the reference dequantization's values exactly."""
    n, k = 37, 2 * GGML_QUANT_SIZES[T(qtype)][0]
    raw = random_blocks(qtype, n, k)
    got = GGUFTensor(raw, qtype, (n, k)).dequantize(dtype)
    assert got.dtype == dtype and torch.equal(got, dequantize(raw, qtype, (n, k), dtype))


@pytest.mark.parametrize("qtype", sorted(REPACKABLE), ids=lambda t: T(t).name)
def test_embedding_shards_decode_the_rows_they_look_up(native_ops, qtype: int) -> None:
    """A GGUF embedding keeps each rank's rows as stored (the last rank's padded past the vocabulary)
    and a lookup equals the reference dequantization of those rows; padding rows look up as zeros."""
    from workers.models.layers import VocabEmbedding
    from workers.parallel import TPGroup

    vocab, k = 37, 2 * GGML_QUANT_SIZES[T(qtype)][0]
    raw = random_blocks(qtype, vocab, k)
    ref = dequantize(raw, qtype, (vocab, k), torch.bfloat16)
    for rank in range(2):
        with torch.device("cpu"):
            emb = VocabEmbedding(vocab, k, TPGroup(rank=rank, size=2)).to(torch.bfloat16)
        emb.load_gguf(GGUFTensor(raw.view(vocab, -1), qtype, (vocab, k)))
        assert emb.weight.dtype == torch.uint8 and emb.out_dtype == torch.bfloat16
        local = torch.tensor([[0, 3], [emb.local_vocab - 1, 2]])
        want = torch.cat([ref, torch.zeros(1, k, dtype=torch.bfloat16)])[local + emb.start]
        assert torch.equal(emb.lookup(local), want)
    assert rank == 1 and emb.start + emb.local_vocab == vocab + 1  # the last rank has a padding row


@pytest.mark.parametrize(
    "fmt",
    [
        QFormat("i8"),
        QFormat("i8", group=16),
        QFormat("u4", offsets=True),
        QFormat("u5", zero=16, half=True),
        QFormat("u6", group=16, zero=32),
    ],
    ids=str,
)
def test_native_pack_pads_odd_shapes(native_ops, fmt: QFormat) -> None:
    """K not a multiple of 32 (zero steps and parameters past it) and N not of 16."""
    n, k = 19, 70
    gen = torch.Generator().manual_seed(3)
    hi = {"i8": 127, "u4": 15, "u5": 31, "u6": 63}[fmt.kind]
    q = torch.randint(-127 if fmt.kind == "i8" else 0, hi + 1, (n, k), generator=gen)
    q = q.to(torch.int8 if fmt.kind == "i8" else torch.uint8)
    groups = -(-k // fmt.group)
    scales = torch.rand(n, groups, generator=gen)
    offsets = torch.rand(n, groups, generator=gen) if fmt.offsets else None
    assert torch.equal(pack_qweight(q, scales, fmt, offsets), pack_qweight_torch(q, scales, fmt, offsets))


@pytest.fixture(scope="module")
def gguf_files(make_ckpt, tmp_path_factory):
    root, made = tmp_path_factory.mktemp("gguf-native"), {}

    def make(arch: str, qtype: str, **kwargs):
        key = (arch, qtype, tuple(sorted(kwargs.items())))
        if key not in made:
            folder = make_ckpt(arch, **kwargs)
            made[key] = write_gguf(folder, root / f"{arch}-{qtype}-{len(made)}.gguf", qtype)
        return made[key]

    return make


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), max_num_batched_tokens=64, show_progress=False, **kwargs)


@pytest.mark.parametrize(("arch", "qtype"), [("llama", "Q4_1"), ("qwen2", "Q5_0"), ("qwen3", "Q8_0")])
def test_layers_hold_the_files_bits(native_ops, gguf_files, arch: str, qtype: str) -> None:
    """Each linear (and the head) is packed in its tensor's own format and stands for exactly the
    reference dequantization of the file's tensors, stacked as the model fuses them."""
    path = gguf_files(arch, qtype)
    file_tensors = {name: t for _, name, t in iter_gguf(GGUFFile(path), native=True)}
    with engine(path, dtype="bfloat16") as llm:
        net = llm.engine.executor.worker.runner.model
        layer = net.model.layers[0]
        prefix = "model.layers.0."
        fused = {
            layer.self_attn.qkv_proj: ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            layer.self_attn.o_proj: ["self_attn.o_proj"],
            layer.mlp.gate_up_proj: ["mlp.gate_proj", "mlp.up_proj"],
            layer.mlp.down_proj: ["mlp.down_proj"],
        }
        for module, names in fused.items():
            assert type(module.quant).__name__ == "GGUFPacked"
            expected = torch.cat([file_tensors[f"{prefix}{n}.weight"].dequantize() for n in names])
            assert torch.equal(unpacked(module), expected), names
        head_name = "lm_head.weight" if "lm_head.weight" in file_tensors else "model.embed_tokens.weight"
        head = file_tensors[head_name]
        assert isinstance(head, GGUFTensor)
        assert torch.equal(unpacked(net.lm_head)[: head.shape[0]], head.dequantize())
        # the embedding keeps the file's rows as stored and decodes the rows it looks up
        embedding = net.model.embed_tokens
        stored = file_tensors["model.embed_tokens.weight"]
        assert embedding.weight.dtype == torch.uint8 and embedding.out_dtype == torch.bfloat16
        assert embedding.quant_attrs["gguf_type"] == stored.qtype
        ids = torch.tensor([[0, 5, stored.shape[0] - 1], [7, 7, 1]])
        assert torch.equal(embedding(ids), stored.dequantize(torch.bfloat16)[ids])


def unpacked(module) -> torch.Tensor:
    """A GGUF-packed layer's float32 weight, from its segments."""
    from workers.quant.qpacked import qformat

    attrs, rows = module.quant_attrs, []
    for s in attrs["segments"]:
        size = s["shape"][0] * s["shape"][1] * s["shape"][2]
        packed = module.weight.narrow(0, s["offset"], size).view(*s["shape"])
        fmt = qformat(s["kind"], s["group"], s["zero"], s["offsets"], s["half"], s["superblock"])
        rows.append(unpack_qweight(packed, fmt, s["rows"], attrs["in_features"]))
    return torch.cat(rows)


def test_fused_shards_of_different_types_become_segments(native_ops, gguf_files, tmp_path) -> None:
    """q and k in Q5_0, v in Q8_0 (as llama.cpp's Q4_K_M files mix them): two segments, one matmul."""
    import numpy as np
    from gguf import GGUFReader, GGUFWriter, quants

    src = gguf_files("qwen2", "Q5_0")
    reader = GGUFReader(src)
    path = tmp_path / "mixed.gguf"
    writer = GGUFWriter(str(path), "qwen2")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        writer.add_key_value(
            field.name, value, field.types[0], field.types[-1] if len(field.types) > 1 else None
        )
    for t in reader.tensors:
        data = quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        if t.name.endswith("attn_v.weight"):
            writer.add_tensor(t.name, quants.quantize(data, T.Q8_0), raw_dtype=T.Q8_0)
        elif t.tensor_type == T.Q5_0:
            writer.add_tensor(t.name, quants.quantize(data, T.Q5_0), raw_dtype=T.Q5_0)
        else:
            writer.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=0)
    with engine(path, dtype="bfloat16") as llm:
        qkv = llm.engine.executor.worker.runner.model.model.layers[0].self_attn.qkv_proj
        assert [(s["kind"], s["zero"]) for s in qkv.quant_attrs["segments"]] == [("u5", 16), ("i8", 0)]
        ours = llm.generate(PROMPTS, params, use_tqdm=False)
    with engine(path, dtype="float32") as ref_llm:
        ref = ref_llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(ours, ref, strict=True):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        token = b.outputs[0].token_ids[0]
        if token in first_a:
            assert abs(first_a[token].logprob - first_b[token].logprob) < 0.1


@pytest.mark.parametrize(("arch", "qtype"), [("llama", "Q4_0"), ("qwen2", "Q5_1")])
def test_generates_like_the_float32_engine(native_ops, gguf_files, arch: str, qtype: str) -> None:
    """Teacher-forced along the float32 engine's greedy continuations of the same file: the native
    engine's logprobs stay within the error of bf16 activations quantized to int8 per 32 inputs."""
    path = gguf_files(arch, qtype)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
    with engine(path, dtype="float32") as ref_llm:
        seqs = [
            p + o.outputs[0].token_ids
            for p, o in zip(PROMPTS, ref_llm.generate(PROMPTS, greedy, use_tqdm=False))
        ]
        ref = forced(ref_llm, seqs)
    with engine(path, dtype="bfloat16") as llm:
        assert (
            type(llm.engine.executor.worker.runner.model.model.layers[0].mlp.down_proj.quant).__name__
            == "GGUFPacked"
        )
        ours = forced(llm, seqs)
    errors = [abs(a - b) for a, b in zip(ours, ref, strict=True)]
    assert max(errors) < 0.25 and sum(errors) / len(errors) < 0.05, (max(errors), sum(errors) / len(errors))


def forced(llm: LLM, seqs: list[list[int]]) -> list[float]:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(seqs, params, use_tqdm=False)
    return [
        lp[tok].logprob
        for o, seq in zip(outs, seqs, strict=True)
        for tok, lp in zip(seq[1:], o.prompt_logprobs[1:], strict=True)
    ]
