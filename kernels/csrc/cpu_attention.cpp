// Ember CPU fast path: paged decode attention (one query token per request) and RMSNorm.
//
// Built with cpu_gemm.cpp into one library by kernels/cpu_gemm.py and registered as
// torch.ops.ember.decode_attention / torch.ops.ember.rms_norm. Same contract as the torch references
// in kernels/decode_attention.py and workers/models/layers.py (RMSNorm): float32 math, keys
// 0 .. seq_len - 1 (the last `window` of them when window > 0), GQA head h -> kv head h / (H / Hkv).
// An fp8 (e4m3) cache holds k / k_scale[h] and v / v_scale[h]: the key scale is folded into the score
// scale and the value scale applied to each head's output.
// Work is split over (request, kv head) pairs on torch's OpenMP pool; each pair reads its keys and
// values once for all the query heads that share them.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

// s[0:n] = exp(s - m); returns the sum.
inline float exp_shift_sum(float* s, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = hsum(total);
  for (; t < n; ++t) sum += (s[t] = std::exp(s[t] - m));
  return sum;
}

// Calls f(t, row) for the rows of positions start .. len - 1 (t = pos - start) in block order: one
// table lookup per block, and the next block's rows requested before this block's are used (one kv
// head's rows sit Hkv rows apart in blocks anywhere in memory, which the hardware prefetcher does not
// follow; without this, batch-32 decode is bound by memory latency).
template <typename T, typename F>
inline void for_rows(const T* cache, const int64_t* strides, const int32_t* table, int64_t start, int64_t len,
                     int64_t bs, int64_t row_bytes, F f) {
  auto prefetch_block = [&](int64_t pos) {
    if (pos >= len) return;
    const char* base = reinterpret_cast<const char*>(cache + table[pos / bs] * strides[0]);
    for (int64_t off = pos % bs; off < bs; ++off)
      for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(base + off * strides[1] * sizeof(T) + b, _MM_HINT_T0);
  };
  prefetch_block(start);
  for (int64_t pos = start; pos < len;) {
    const int64_t off = pos % bs, n = std::min(bs - off, len - pos);
    const T* base = cache + table[pos / bs] * strides[0];
    prefetch_block(pos + n);
    for (int64_t i = 0; i < n; ++i) f(pos + i - start, base + (off + i) * strides[1]);
    pos += n;
  }
}

// dst[g * ld] = scale * (q_g . k) for the G query heads of one kv head; C = D / 8 chunks of 8.
// G and C are compile-time so the accumulators stay in registers.
template <typename T, int GB, int C>
__attribute__((noinline)) void scores_row(const float* q, int64_t D, const T* k, float* dst, int64_t ld,
                                          float scale) {
  __m256 acc[GB];
#pragma GCC unroll 8
  for (int g = 0; g < GB; ++g) acc[g] = _mm256_setzero_ps();
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) {
    const __m256 kv = load8(k + 8 * c);
#pragma GCC unroll 8
    for (int g = 0; g < GB; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + 8 * c), kv, acc[g]);
  }
#pragma GCC unroll 8
  for (int g = 0; g < GB; ++g) dst[g * ld] = hsum(acc[g]) * scale;
}

// out[0:8C] = sum_t p[t] * v_t over the rows of one query head (C <= 8 chunks of 8 floats).
template <typename T, int C, typename Rows>
__attribute__((noinline)) void weighted_rows(const float* p, Rows rows, int64_t c0, float* out) {
  __m256 acc[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  rows([&](int64_t t, const T* v) {
    const __m256 pv = _mm256_set1_ps(p[t]);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(pv, load8(v + c0 + 8 * c), acc[c]);
  });
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + c0 + 8 * c, acc[c]);
}

template <typename T, typename Rows>
void weighted(const float* p, Rows rows, int64_t D, float* out) {
  for (int64_t c0 = 0; c0 < D; c0 += 64) {
    switch (std::min<int64_t>(8, (D - c0) / 8)) {
      case 1: weighted_rows<T, 1>(p, rows, c0, out); break;
      case 2: weighted_rows<T, 2>(p, rows, c0, out); break;
      case 3: weighted_rows<T, 3>(p, rows, c0, out); break;
      case 4: weighted_rows<T, 4>(p, rows, c0, out); break;
      case 5: weighted_rows<T, 5>(p, rows, c0, out); break;
      case 6: weighted_rows<T, 6>(p, rows, c0, out); break;
      case 7: weighted_rows<T, 7>(p, rows, c0, out); break;
      default: weighted_rows<T, 8>(p, rows, c0, out); break;
    }
  }
}

// out[g, c0 : c0 + 16] = sum_t p[g, t] * v_t for 4 query heads at once (their probabilities ld
// apart): each value row is loaded and widened once for the four heads instead of once per head. Each
// output is the same FMA chain over t as in weighted_rows, so results are identical.
template <typename T, typename Rows>
__attribute__((noinline)) void weighted_4heads(const float* p, int64_t ld, Rows rows, int64_t c0, int64_t D,
                                               float* out) {
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
  rows([&](int64_t t, const T* v) {
    const __m256 va = load8(v + c0), vb = load8(v + c0 + 8);
    __m256 pv = _mm256_set1_ps(p[t]);
    a0 = _mm256_fmadd_ps(pv, va, a0);
    b0 = _mm256_fmadd_ps(pv, vb, b0);
    pv = _mm256_set1_ps(p[ld + t]);
    a1 = _mm256_fmadd_ps(pv, va, a1);
    b1 = _mm256_fmadd_ps(pv, vb, b1);
    pv = _mm256_set1_ps(p[2 * ld + t]);
    a2 = _mm256_fmadd_ps(pv, va, a2);
    b2 = _mm256_fmadd_ps(pv, vb, b2);
    pv = _mm256_set1_ps(p[3 * ld + t]);
    a3 = _mm256_fmadd_ps(pv, va, a3);
    b3 = _mm256_fmadd_ps(pv, vb, b3);
  });
  const __m256 lo[4] = {a0, a1, a2, a3}, hi[4] = {b0, b1, b2, b3};
  for (int g = 0; g < 4; ++g) {
    _mm256_storeu_ps(out + g * D + c0, lo[g]);
    _mm256_storeu_ps(out + g * D + c0 + 8, hi[g]);
  }
}

template <typename T, int GB>
void scores_for(const float* q, int64_t D, const T* k, float* dst, int64_t ld, float scale) {
  switch (D / 8) {
    case 8: return scores_row<T, GB, 8>(q, D, k, dst, ld, scale);
    case 16: return scores_row<T, GB, 16>(q, D, k, dst, ld, scale);
    case 4: return scores_row<T, GB, 4>(q, D, k, dst, ld, scale);
    case 10: return scores_row<T, GB, 10>(q, D, k, dst, ld, scale);
    case 12: return scores_row<T, GB, 12>(q, D, k, dst, ld, scale);
    case 32: return scores_row<T, GB, 32>(q, D, k, dst, ld, scale);
    default: {  // other head sizes: widen the key row once, then a plain dot per query head
      std::vector<float> row(D);
      load_row(k, row.data(), D);
      for (int g = 0; g < GB; ++g) dst[g * ld] = dot(q + g * D, row.data(), D) * scale;
    }
  }
}

template <typename T>
void scores_heads(const float* q, int64_t G, int64_t D, const T* k, float* dst, int64_t ld, float scale) {
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) scores_for<T, 4>(q + g * D, D, k, dst + g * ld, ld, scale);
  for (; g < G; ++g) scores_for<T, 1>(q + g * D, D, k, dst + g * ld, ld, scale);
}

template <typename T>
void decode_pair(const float* q, const T* kc, const T* vc, const int32_t* table, int64_t len,
                 int64_t window, int64_t bs, int64_t G, int64_t D, const int64_t* ks, const int64_t* vs,
                 float scale, float v_scale, float* out) {
  // q/out: [G, D] of this kv head's query heads; ks/vs: strides (block, slot) of the kv head's rows
  const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const int64_t L = len - start;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  std::vector<float> scores(G * L);
  for_rows(kc, ks, table, start, len, bs, row_bytes,
           [&](int64_t t, const T* k) { scores_heads(q, G, D, k, scores.data() + t, L, scale); });
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * L;
    const float m = *std::max_element(s, s + L);
    const float inv = 1.0f / exp_shift_sum(s, L, m);
    for (int64_t t = 0; t < L; ++t) s[t] *= inv;
  }
  auto rows = [&](auto f) { for_rows(vc, vs, table, start, len, bs, row_bytes, f); };
  int64_t g = 0;
  if (D % 16 == 0)
    for (; g + 4 <= G; g += 4)
      for (int64_t c0 = 0; c0 < D; c0 += 16) weighted_4heads<T>(scores.data() + g * L, L, rows, c0, D, out + g * D);
  for (; g < G; ++g) weighted<T>(scores.data() + g * L, rows, D, out + g * D);
  if (v_scale != 1.0f)
    for (int64_t i = 0; i < G * D; ++i) out[i] *= v_scale;
}

}  // namespace

// q [B, H, D]; k_cache / v_cache [blocks, block_size, Hkv, D]; block_tables [>=B, max_blocks];
// seq_lens [>=B]; kv_scales: empty, or float32 [2, Hkv] for an fp8 cache; out [B, H, D] (written,
// any float dtype).
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                      int64_t window, const at::Tensor& kv_scales, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "decode_attention: bad shapes");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "decode_attention: k/v dtypes differ");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "decode_attention: rows must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "decode_attention: head sizes do not match");
  TORCH_CHECK(D % 8 == 0, "decode_attention: head_dim must be a multiple of 8");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(!fp8 || (kv_scales.scalar_type() == at::kFloat && kv_scales.numel() == 2 * Hkv),
              "decode_attention: an fp8 cache needs float32 kv_scales [2, Hkv]");
  TORCH_CHECK(fp8 || kv_scales.numel() == 0, "decode_attention: kv_scales are only for an fp8 cache");
  if (B == 0) return;
  const int64_t G = H / Hkv;
  const at::Tensor sc = fp8 ? kv_scales.contiguous() : at::ones({2, Hkv}, q.options().dtype(at::kFloat));
  const float* scp = sc.const_data_ptr<float>();
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
  TORCH_CHECK(table.size(0) >= B && lens.numel() >= B, "decode_attention: fewer table rows than queries");
  for (int64_t b = 0; b < B; ++b) {  // every block read below must exist (the torch reference raises too)
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= tstride * bs, "decode_attention: seq_len ", lp[b], " does not fit the table");
    for (int64_t j = 0; j < (lp[b] + bs - 1) / bs; ++j) {
      const int32_t blk = tp[b * tstride + j];
      TORCH_CHECK(blk >= 0 && blk < k_cache.size(0), "decode_attention: block ", blk, " is outside the cache");
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND3(at::kBFloat16, at::kHalf, at::kFloat8_e4m3fn, k_cache.scalar_type(), "decode_attention", [&] {
    const scalar_t* kp = k_cache.const_data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.const_data_ptr<scalar_t>();
    at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / Hkv, h = i % Hkv;
        const int64_t offset = h * G * D + b * H * D;
        decode_pair<scalar_t>(qp + offset, kp + h * k_cache.stride(2), vp + h * v_cache.stride(2),
                              tp + b * tstride, lp[b], window, bs, G, D, ks, vs,
                              static_cast<float>(scale) * scp[h], scp[Hkv + h], rp + offset);
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
      "float scale, int window, Tensor kv_scales, Tensor(a!) out) -> ()",
      decode_attention);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", rms_norm);
}
