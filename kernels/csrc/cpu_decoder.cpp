// Ember CPU fast path: a whole decoder layer for a batch of decode tokens in one call.
//
// Built with the other csrc files by kernels/native.py and registered as
// torch.ops.ember.decoder_layer. A small model's decode step otherwise spends milliseconds in Python
// around some 25 torch calls per layer; this runs the same native ops (cpu_ops.h) in the same order
// on the same dtypes as workers/models/parts.py's modules do on the native CPU path, so its results
// are bit-identical to theirs: every part those modules compose (norm placements, q/k norms per head
// or over all heads, rotary or none, SwiGLU or GeGLU, a residual multiplier).
// workers/models/fused_decode.py decides when a layer qualifies (packed bf16, fp8 or integer-dot
// linears, with or without bias, one rank, the native attention ops; a dense MLP or the one-call
// experts of cpu_moe.cpp).

#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <vector>

namespace {

// Linear i of the layer, as its method applies it: each segment's matmul (qgemm kinds 0..3, bf16, fp8),
// several side by side in one parallel region (cpu_moe.cpp's grouped_linears), then the bias when it
// has one. `specs` per linear: the segment
// count, then kSegInts ints per segment; `next` walks weights and specs across linears.
struct Linears {
  at::TensorList weights, scales, biases;
  at::IntArrayRef specs;
  size_t w = 0, s = 0;

  at::Tensor apply(const at::Tensor& x, size_t i) {
    const int64_t segments = specs[s++];
    std::vector<LinearJob> job(1);
    job[0].x = x;
    for (int64_t k = 0; k < segments; ++k, s += kSegInts) {
      job[0].packed.push_back(&weights[w++]);
      job[0].scales.push_back(&scales[i]);
      job[0].specs.push_back(specs.data() + s);
    }
    if (segments == 1) {  // one native op (and its own parallel region)
      const at::Tensor& packed = *job[0].packed[0];
      const at::Tensor y = segment_matmul(x, packed, scales[i], job[0].specs[0], 0, packed.size(0));
      return biases[i].numel() ? at::add(y, biases[i]) : y;
    }
    grouped_linears(job);  // the segments side by side, in one parallel region
    return biases[i].numel() ? at::add(job[0].out, biases[i]) : job[0].out;
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

// The decoder layer's parts (dims[9..11]), as workers/models/parts.py names them.
constexpr int64_t kNormsPre = 0, kNormsSandwich = 1, kNormsPost = 2;  // where the layer's norms sit
constexpr int64_t kQkNone = 0, kQkHead = 1, kQkAll = 2;               // q/k norms
constexpr int64_t kActSilu = 0, kActGeluTanh = 1;                     // the MLP's gate

// x -> x + attention block, then + MLP block, each block with its norms where `placement` puts them:
// pre: norm(x) -> block; sandwich: norm(x) -> block -> norm; post: block -> norm. Each block's output
// is times `residual_scale` before the add (when not 1). norms: the layer's norms in the order of
// DecoderLayer's attributes (input, post-attention[, pre-feedforward, post-feedforward]; post: the
// post-attention and post-feedforward ones), then the q and k norms when there are. weights: the
// segments of qkv, o, gate_up and down in order (`specs` says how many each has and their formats).
// scales: the fp8 scales of the four linears, biases their biases (an empty tensor where there is
// none). kv_scales: empty, or [2, Hkv] for an fp8 cache. cos/sin: this layer's rotary tables (unread
// when its rotary dims are 0: no positional encoding). dims: out features of qkv, o, gate_up, down;
// heads, kv heads, head size, rotary dims, window; norm placement, q/k norm, activation. softcap: the
// attention scores' soft cap (0: none). moe_*: a mixture of experts in place of the MLP, as
// moe_forward's arguments (moe_dims empty: the dense MLP of gate_up and down; with experts `weights`
// holds the qkv and o segments only).
at::Tensor decoder_layer(const at::Tensor& x, const at::Tensor& positions, at::TensorList norms,
                         at::TensorList weights, at::TensorList scales, at::TensorList biases, at::IntArrayRef specs,
                         at::IntArrayRef dims, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& slot_mapping,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_scales, double scale,
                         double eps, double residual_scale, double softcap, at::TensorList moe_params,
                         at::TensorList moe_weights, at::TensorList moe_scales, at::IntArrayRef moe_specs,
                         at::IntArrayRef moe_dims, double moe_scale, const at::Tensor& moe_load) {
  TORCH_CHECK(scales.size() == 4 && biases.size() == 4 && dims.size() == 12,
              "decoder_layer: 4 scales, 4 biases and 12 dims");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decoder_layer: x must be a contiguous [T, hidden]");
  const int64_t T = x.size(0), H = dims[4], Hkv = dims[5], D = dims[6];
  const int64_t placement = dims[9], qk = dims[10], act = dims[11];
  const size_t layer_norms = placement == kNormsSandwich ? 4 : 2;
  TORCH_CHECK(norms.size() == layer_norms + (qk == kQkNone ? 0 : 2), "decoder_layer: norms do not match the parts");
  TORCH_CHECK(dims[0] == (H + 2 * Hkv) * D, "decoder_layer: qkv size does not match the heads");
  const auto norm = [&](const at::Tensor& t, size_t i) { return rms_norm(t, norms[i], eps); };
  const auto add = [&](const at::Tensor& base, const at::Tensor& out) {
    return residual_scale == 1.0 ? at::add(base, out) : at::add(base, at::mul(out, residual_scale));
  };
  Linears lin{weights, scales, biases, specs};
  const at::Tensor qkv = lin.apply(placement == kNormsPost ? x : norm(x, 0), 0);
  // views into qkv, as the module path's split + reshape; q/k norms make new tensors, as there
  at::Tensor q = qkv.narrow(1, 0, H * D).view({T, H, D});
  at::Tensor k = qkv.narrow(1, H * D, Hkv * D).view({T, Hkv, D});
  const at::Tensor v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({T, Hkv, D});
  if (qk == kQkAll) {
    q = norm(qkv.narrow(1, 0, H * D), layer_norms).view({T, H, D});
    k = norm(qkv.narrow(1, H * D, Hkv * D), layer_norms + 1).view({T, Hkv, D});
  } else if (qk == kQkHead) {
    q = norm(q.reshape({-1, D}), layer_norms).view({T, H, D});
    k = norm(k.reshape({-1, D}), layer_norms + 1).view({T, Hkv, D});
  }
  if (dims[7] > 0) rotary_(positions, q, k, cos, sin, dims[7]);
  write_kv(to_cache(k, k_cache, kv_scales, 0), to_cache(v, v_cache, kv_scales, 1), k_cache, v_cache, slot_mapping);
  const at::Tensor attn = at::empty({T, H, D}, x.options());
  decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, dims[8], softcap, kv_scales, attn);
  at::Tensor o = lin.apply(attn.view({T, H * D}), 1);
  if (placement != kNormsPre) o = norm(o, placement == kNormsPost ? 0 : 1);
  const at::Tensor h = add(x, o);
  const at::Tensor mlp_in = placement == kNormsPost ? h : norm(h, placement == kNormsPre ? 1 : 2);
  at::Tensor down;
  if (!moe_dims.empty()) {  // experts in place of the MLP (cpu_moe.cpp)
    down = moe_forward(mlp_in, moe_params, moe_weights, moe_scales, moe_specs, moe_dims, moe_scale, moe_load);
  } else {
    const at::Tensor gate_up = lin.apply(mlp_in, 2);
    at::Tensor gated;
    if (act == kActGeluTanh) {
      const int64_t inter = gate_up.size(1) / 2;
      gated = at::mul(at::gelu(gate_up.narrow(1, 0, inter), "tanh"), gate_up.narrow(1, inter, inter));
    } else {
      TORCH_CHECK(act == kActSilu, "decoder_layer: unknown activation");
      gated = silu_and_mul(gate_up);
    }
    down = lin.apply(gated, 3);
  }
  if (placement != kNormsPre) down = norm(down, placement == kNormsPost ? 1 : 3);
  const at::Tensor y = add(h, down);
  TORCH_CHECK(lin.w == weights.size() && lin.s == specs.size(), "decoder_layer: specs do not match the weights");
  return y;
}

namespace {

// One layer's arguments of decoder_layer that do not change between steps (DecoderStack::add).
struct LayerArgs {
  std::vector<at::Tensor> norms, weights, scales, biases, moe_params, moe_weights, moe_scales;
  std::vector<int64_t> specs, dims, moe_specs, moe_dims;
  at::Tensor cos, sin;
  double scale, eps, residual_scale, softcap, moe_scale;
};

// A model's (or pipeline stage's) one-call layers, their constant arguments held natively, so that a
// decode step is one call (`forward`) instead of one per layer each converting some tens to a few
// hundred tensors (a mixture of experts' layer: every expert's) from Python: 1.7 ms of a 17 ms step
// of a 24-layer MoE model. Built once per model (workers/models/fused_decode.py), the tensors shared.
struct DecoderStack : torch::CustomClassHolder {
  std::vector<LayerArgs> layers;

  void add(std::vector<at::Tensor> norms, std::vector<at::Tensor> weights, std::vector<at::Tensor> scales,
           std::vector<at::Tensor> biases, std::vector<int64_t> specs, std::vector<int64_t> dims, at::Tensor cos,
           at::Tensor sin, double scale, double eps, double residual_scale, double softcap,
           std::vector<at::Tensor> moe_params, std::vector<at::Tensor> moe_weights,
           std::vector<at::Tensor> moe_scales, std::vector<int64_t> moe_specs, std::vector<int64_t> moe_dims,
           double moe_scale) {
    layers.push_back({std::move(norms), std::move(weights), std::move(scales), std::move(biases),
                      std::move(moe_params), std::move(moe_weights), std::move(moe_scales), std::move(specs),
                      std::move(dims), std::move(moe_specs), std::move(moe_dims), std::move(cos), std::move(sin),
                      scale, eps, residual_scale, softcap, moe_scale});
  }

  // The layers in order over x [T, hidden]. Per layer i: its caches, kv_scales and experts' load
  // counter (empty tensors where none), and rows[i] picks its KV group's block tables, sequence
  // lengths and slots among tables / lens / slots.
  at::Tensor forward(at::Tensor x, at::Tensor positions, std::vector<at::Tensor> k_caches,
                     std::vector<at::Tensor> v_caches, std::vector<at::Tensor> kv_scales,
                     std::vector<at::Tensor> moe_loads, std::vector<at::Tensor> tables, std::vector<at::Tensor> lens,
                     std::vector<at::Tensor> slots, std::vector<int64_t> rows) {
    const size_t n = layers.size();
    TORCH_CHECK(k_caches.size() == n && v_caches.size() == n && kv_scales.size() == n && moe_loads.size() == n &&
                    rows.size() == n,
                "DecoderStack: one cache, kv scale, load and rows index per layer");
    for (size_t i = 0; i < n; ++i) {
      const LayerArgs& a = layers[i];
      const auto g = static_cast<size_t>(rows[i]);
      TORCH_CHECK(g < tables.size() && g < lens.size() && g < slots.size(), "DecoderStack: rows out of range");
      x = decoder_layer(x, positions, a.norms, a.weights, a.scales, a.biases, a.specs, a.dims, k_caches[i],
                        v_caches[i], tables[g], lens[g], slots[g], a.cos, a.sin, kv_scales[i], a.scale, a.eps,
                        a.residual_scale, a.softcap, a.moe_params, a.moe_weights, a.moe_scales, a.moe_specs,
                        a.moe_dims, a.moe_scale, moe_loads[i]);
    }
    return x;
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<>())
      .def("add", &DecoderStack::add)
      .def("forward", &DecoderStack::forward)
      .def("size", &DecoderStack::size);
  m.def(
      "decoder_layer(Tensor x, Tensor positions, Tensor[] norms, Tensor[] weights, Tensor[] scales, "
      "Tensor[] biases, int[] specs, int[] dims, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_tables, Tensor seq_lens, Tensor slot_mapping, "
      "Tensor cos, Tensor sin, Tensor kv_scales, float scale, float eps, float residual_scale, "
      "float softcap, Tensor[] moe_params, Tensor[] moe_weights, Tensor[] moe_scales, int[] moe_specs, "
      "int[] moe_dims, float moe_scale, Tensor(c!) moe_load) -> Tensor",
      decoder_layer);
}
