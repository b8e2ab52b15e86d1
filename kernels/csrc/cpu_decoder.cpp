// Ember CPU fast path: a whole Llama decoder layer for a batch of decode tokens in one call.
//
// Built with the other csrc files by kernels/native.py and registered as
// torch.ops.ember.decoder_layer. A small model's decode step otherwise spends milliseconds in Python
// around some 25 torch calls per layer; this runs the same native ops (cpu_ops.h) in the same order
// on the same dtypes as workers/models/llama.py's modules do on the native CPU path, so its results
// are bit-identical to theirs. workers/models/fused_decode.py decides when a layer qualifies (packed
// bf16, fp8 or integer-dot linears, with or without bias, no q/k norm, one rank, the native attention
// ops).

#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <vector>

namespace {

// Segment kinds in a linear's spec: packed bf16, fp8 (with its per-tensor scale), or a qgemm format.
constexpr int64_t kSegBf16 = -1, kSegFp8 = -2;
constexpr int64_t kSegInts = 6;  // per segment: kind, group, zero, offsets, params, rows

// Linear i of the layer, as its method applies it: each segment's matmul (qgemm kinds 0..2, bf16, fp8),
// concatenated when there are several, then the bias when it has one. `specs` per linear: the segment
// count, then kSegInts ints per segment; `next` walks weights and specs across linears.
struct Linears {
  at::TensorList weights, scales, biases;
  at::IntArrayRef specs;
  size_t w = 0, s = 0;

  at::Tensor apply(const at::Tensor& x, size_t i) {
    const int64_t segments = specs[s++];
    std::vector<at::Tensor> outs;
    for (int64_t k = 0; k < segments; ++k, s += kSegInts) {
      const int64_t kind = specs[s], rows = specs[s + 5];
      const at::Tensor& packed = weights[w++];
      if (kind == kSegBf16)
        outs.push_back(gemm_bf16(x, packed, rows));
      else if (kind == kSegFp8)
        outs.push_back(gemm_fp8(x, packed, scales[i], rows));
      else
        outs.push_back(qgemm(x, packed, kind, specs[s + 1], specs[s + 2], specs[s + 3] != 0, specs[s + 4], rows));
    }
    at::Tensor y = outs.size() == 1 ? outs[0] : at::cat(outs, 1);
    return biases[i].numel() ? at::add(y, biases[i]) : y;
  }
};

// Keys or values (which = 0 / 1) [T, Hkv, D] in the cache's dtype: an fp8 cache stores x / scale of
// their kv head, saturated at e4m3's largest finite value, as kernels/torch_ops.py's quantize_kv.
at::Tensor to_cache(const at::Tensor& x, const at::Tensor& cache, const at::Tensor& kv_scales, int64_t which) {
  if (cache.scalar_type() != at::kFloat8_e4m3fn) return x.to(cache.scalar_type());
  const at::Tensor scaled = at::div(x.to(at::kFloat), kv_scales.select(0, which).view({1, -1, 1}));
  return at::clamp(scaled, -448.0, 448.0).to(at::kFloat8_e4m3fn);
}

}  // namespace

// x [T, hidden] -> x + attn(norm(x)), then + mlp(norm(.)).
// norms: input and post-attention norm weights. weights: the segments of qkv, o, gate_up and down in
// order (`specs` says how many each has and their formats). scales: the fp8 scales of the four linears,
// biases their biases (an empty tensor where there is none). kv_scales: empty, or [2, Hkv] for an fp8
// cache.
// dims: out features of qkv, o, gate_up, down; heads, kv heads, head size, rotary dims, window.
at::Tensor decoder_layer(const at::Tensor& x, const at::Tensor& positions, at::TensorList norms,
                         at::TensorList weights, at::TensorList scales, at::TensorList biases, at::IntArrayRef specs,
                         at::IntArrayRef dims, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& slot_mapping,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_scales, double scale,
                         double eps) {
  TORCH_CHECK(norms.size() == 2 && scales.size() == 4 && biases.size() == 4 && dims.size() == 9,
              "decoder_layer: 2 norms, 4 scales, 4 biases and 9 dims");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decoder_layer: x must be a contiguous [T, hidden]");
  const int64_t T = x.size(0), H = dims[4], Hkv = dims[5], D = dims[6];
  TORCH_CHECK(dims[0] == (H + 2 * Hkv) * D, "decoder_layer: qkv size does not match the heads");
  Linears lin{weights, scales, biases, specs};
  const at::Tensor qkv = lin.apply(rms_norm(x, norms[0], eps), 0);
  // views into qkv, as the module path's split + reshape
  const at::Tensor q = qkv.narrow(1, 0, H * D).view({T, H, D});
  at::Tensor k = qkv.narrow(1, H * D, Hkv * D).view({T, Hkv, D});
  at::Tensor v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({T, Hkv, D});
  rotary_(positions, q, k, cos, sin, dims[7]);
  write_kv(to_cache(k, k_cache, kv_scales, 0), to_cache(v, v_cache, kv_scales, 1), k_cache, v_cache, slot_mapping);
  const at::Tensor attn = at::empty({T, H, D}, x.options());
  decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, dims[8], kv_scales, attn);
  const at::Tensor h = at::add(x, lin.apply(attn.view({T, H * D}), 1));
  const at::Tensor act = silu_and_mul(lin.apply(rms_norm(h, norms[1], eps), 2));
  const at::Tensor y = at::add(h, lin.apply(act, 3));
  TORCH_CHECK(lin.w == weights.size() && lin.s == specs.size(), "decoder_layer: specs do not match the weights");
  return y;
}

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def(
      "decoder_layer(Tensor x, Tensor positions, Tensor[] norms, Tensor[] weights, Tensor[] scales, "
      "Tensor[] biases, int[] specs, int[] dims, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_tables, Tensor seq_lens, Tensor slot_mapping, "
      "Tensor cos, Tensor sin, Tensor kv_scales, float scale, float eps) -> Tensor",
      decoder_layer);
}
