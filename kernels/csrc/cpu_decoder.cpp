// Ember CPU fast path: a whole Llama decoder layer for a batch of decode tokens in one call.
//
// Built with the other csrc files by kernels/native.py and registered as
// torch.ops.ember.decoder_layer. A small model's decode step otherwise spends milliseconds in Python
// around some 25 torch calls per layer; this runs the same native ops (cpu_ops.h) in the same order
// on the same dtypes as workers/models/llama.py's modules do on the native CPU path, so its results
// are bit-identical to theirs. workers/models/fused_decode.py decides when a layer qualifies (packed
// bf16 or fp8 linears without bias, no q/k norm, one rank, the native attention ops).

#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <vector>

namespace {

// A packed linear: bf16, or fp8 with its per-tensor scale (as PackedBf16 / Fp8PerTensor apply them).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t n) {
  if (packed.scalar_type() == at::kFloat8_e4m3fn) return gemm_fp8(x, packed, scale, n);
  return gemm_bf16(x, packed, n);
}

}  // namespace

// x [T, hidden] -> x + attn(norm(x)), then + mlp(norm(.)).
// weights: input norm, packed qkv, packed o, post-attention norm, packed gate_up, packed down.
// scales: the fp8 scales of qkv, o, gate_up and down (any tensor where the weight is bf16).
// dims: out features of qkv, o, gate_up, down; heads, kv heads, head size, rotary dims, window.
at::Tensor decoder_layer(const at::Tensor& x, const at::Tensor& positions, at::TensorList weights,
                         at::TensorList scales, at::IntArrayRef dims, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& slot_mapping, const at::Tensor& cos, const at::Tensor& sin,
                         double scale, double eps) {
  TORCH_CHECK(weights.size() == 6 && scales.size() == 4 && dims.size() == 9,
              "decoder_layer: 6 weights, 4 scales and 9 dims");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decoder_layer: x must be a contiguous [T, hidden]");
  const int64_t T = x.size(0), H = dims[4], Hkv = dims[5], D = dims[6];
  TORCH_CHECK(dims[0] == (H + 2 * Hkv) * D, "decoder_layer: qkv size does not match the heads");
  const at::Tensor qkv = linear(rms_norm(x, weights[0], eps), weights[1], scales[0], dims[0]);
  // views into qkv, as the module path's split + reshape
  const at::Tensor q = qkv.narrow(1, 0, H * D).view({T, H, D});
  at::Tensor k = qkv.narrow(1, H * D, Hkv * D).view({T, Hkv, D});
  at::Tensor v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({T, Hkv, D});
  rotary_(positions, q, k, cos, sin, dims[7]);
  write_kv(k.to(k_cache.scalar_type()), v.to(v_cache.scalar_type()), k_cache, v_cache, slot_mapping);
  const at::Tensor attn = at::empty({T, H, D}, x.options());
  decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, dims[8], attn);
  const at::Tensor h = at::add(x, linear(attn.view({T, H * D}), weights[2], scales[1], dims[1]));
  const at::Tensor act = silu_and_mul(linear(rms_norm(h, weights[3], eps), weights[4], scales[2], dims[2]));
  return at::add(h, linear(act, weights[5], scales[3], dims[3]));
}

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def(
      "decoder_layer(Tensor x, Tensor positions, Tensor[] weights, Tensor[] scales, int[] dims, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_tables, Tensor seq_lens, Tensor slot_mapping, "
      "Tensor cos, Tensor sin, float scale, float eps) -> Tensor",
      decoder_layer);
}
