// Ember CPU fast path: paged decode attention (one query token per request) and RMSNorm.
//
// Built with cpu_gemm.cpp into one library by kernels/cpu_gemm.py and registered as
// torch.ops.ember.decode_attention / torch.ops.ember.rms_norm. Same contract as the torch references
// in kernels/decode_attention.py and workers/models/layers.py (RMSNorm): float32 math, keys
// 0 .. seq_len - 1 (the last `window` of them when window > 0), GQA head h -> kv head h / (H / Hkv).
// Work is split over (request, kv head) pairs on torch's OpenMP pool; each pair reads its keys and
// values once for all the query heads that share them.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <typename T>
void decode_pair(const float* q, const T* kc, const T* vc, const int32_t* table, int64_t len,
                 int64_t window, int64_t bs, int64_t G, int64_t D, const int64_t* ks, const int64_t* vs,
                 float scale, float* out) {
  // q/out: [G, D] of this kv head's query heads; ks/vs: strides (block, slot) of the kv head's rows
  const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const int64_t L = len - start;
  std::vector<float> scores(G * L), row(D);
  for (int64_t t = 0; t < L; ++t) {
    const int64_t pos = start + t;
    load_row(kc + table[pos / bs] * ks[0] + (pos % bs) * ks[1], row.data(), D);
    for (int64_t g = 0; g < G; ++g) scores[g * L + t] = dot(q + g * D, row.data(), D) * scale;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * L;
    const float m = *std::max_element(s, s + L);
    float total = 0.0f;
    for (int64_t t = 0; t < L; ++t) total += (s[t] = std::exp(s[t] - m));
    const float inv = 1.0f / total;
    for (int64_t t = 0; t < L; ++t) s[t] *= inv;
  }
  std::fill(out, out + G * D, 0.0f);
  for (int64_t t = 0; t < L; ++t) {
    const int64_t pos = start + t;
    load_row(vc + table[pos / bs] * vs[0] + (pos % bs) * vs[1], row.data(), D);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * L + t];
      float* o = out + g * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) o[i] += p * row[i];
    }
  }
}

}  // namespace

// q [B, H, D]; k_cache / v_cache [blocks, block_size, Hkv, D]; block_tables [>=B, max_blocks];
// seq_lens [>=B]; out [B, H, D] (written, any float dtype).
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                      int64_t window, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "decode_attention: bad shapes");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "decode_attention: k/v dtypes differ");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "decode_attention: rows must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "decode_attention: head sizes do not match");
  if (B == 0) return;
  const int64_t G = H / Hkv;
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const at::Tensor table = block_tables.to(at::kInt).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  at::Tensor result = at::empty({B, H, D}, qf.options());
  const int64_t ks[2] = {k_cache.stride(0), k_cache.stride(1)};
  const int64_t vs[2] = {v_cache.stride(0), v_cache.stride(1)};
  const float* qp = qf.const_data_ptr<float>();
  const int32_t* tp = table.const_data_ptr<int32_t>();
  const int64_t* lp = lens.const_data_ptr<int64_t>();
  float* rp = result.mutable_data_ptr<float>();
  const int64_t tstride = table.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "decode_attention", [&] {
    const scalar_t* kp = k_cache.const_data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.const_data_ptr<scalar_t>();
    at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / Hkv, h = i % Hkv;
        const int64_t offset = h * G * D + b * H * D;
        decode_pair<scalar_t>(qp + offset, kp + h * k_cache.stride(2), vp + h * v_cache.stride(2),
                              tp + b * tstride, lp[b], window, bs, G, D, ks, vs,
                              static_cast<float>(scale), rp + offset);
      }
    });
  });
  out.copy_(result);
}

// HF's RMSNorm exactly: h = float(x); y = w * dtype(h * rsqrt(mean(h^2) + eps)), the last product in
// the weight's dtype. x [T, N] rows contiguous; w [N].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.dim() == 1 && weight.size(0) == x.size(1),
              "rms_norm: bad shapes");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight dtypes differ");
  const int64_t T = x.size(0), N = x.size(1);
  at::Tensor out = at::empty({T, N}, x.options());
  const at::Tensor w = weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    const int64_t xs = x.stride(0);
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      std::vector<float> h(N);
      for (int64_t t = t0; t < t1; ++t) {
        load_row(xp + t * xs, h.data(), N);
        const float inv = 1.0f / std::sqrt(dot(h.data(), h.data(), N) / static_cast<float>(N) +
                                           static_cast<float>(eps));
        for (int64_t i = 0; i < N; ++i) {
          const scalar_t normed = static_cast<scalar_t>(h[i] * inv);
          op[t * N + i] = static_cast<scalar_t>(static_cast<float>(wp[i]) * static_cast<float>(normed));
        }
      }
    });
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, int window, Tensor(a!) out) -> ()",
      decode_attention);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", rms_norm);
}
