// Ember CPU fast path: paged decode attention (one query token per request) and RMSNorm.
//
// Built with cpu_gemm.cpp into one library by kernels/cpu_gemm.py and registered as
// torch.ops.ember.decode_attention / torch.ops.ember.rms_norm. Same contract as the torch references
// in kernels/decode_attention.py and workers/models/layers.py (RMSNorm): float32 math, keys
// 0 .. seq_len - 1 (the last `window` of them when window > 0), GQA head h -> kv head h / (H / Hkv).
// An fp8 (e4m3) cache holds k / k_scale[h] and v / v_scale[h]: the key scale is folded into the score
// scale and the value scale applied to each head's output. softcap > 0 caps each scaled score to
// softcap * tanh(score / softcap) before the softmax (Gemma 2's attention logit soft-capping).
// Work is split over (request, kv head) pairs on torch's OpenMP pool; each pair reads its keys and
// values once, a tile at a time, for all the query heads that share them (decode_pair).

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

constexpr int64_t kTile = 64;  // key positions per step of the online softmax (its rows stay in L1)
constexpr int kMaxGroup = 8;   // query heads per kv head whose accumulators sit in registers at once

// Row pointers of one kv head for positions p0 .. p0 + n - 1 (n <= kTile), walking the block table
// without a division per position; `prefetch` also asks for their cache lines.
template <typename T>
inline void tile_rows(const T* cache, const int64_t* strides, const int32_t* table, int64_t bs, int64_t p0,
                      int64_t n, int64_t row_bytes, bool prefetch, const T** rows) {
  int64_t blk = p0 / bs, off = p0 % bs;
  const T* base = cache + table[blk] * strides[0];
  for (int64_t i = 0; i < n; ++i) {
    rows[i] = base + off * strides[1];
    if (prefetch)
      for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(rows[i]) + b, _MM_HINT_T0);
    if (++off == bs && i + 1 < n) {
      off = 0;
      base = cache + table[++blk] * strides[0];
    }
  }
}

// The next tile's key and value rows, requested one row at a time while this tile's scores are
// computed (a burst of a whole tile's requests fills the core's miss buffers and stalls it).
template <typename T>
struct Ahead {
  const T* const* k;
  const T* const* v;
  int64_t n, row_bytes;
  void fetch(int64_t i) const {
    for (int64_t b = 0; b < row_bytes; b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(k[i]) + b, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v[i]) + b, _MM_HINT_T0);
    }
  }
};

// s[g * kTile + i] = scale * (q_g . k_i) for GB query heads (q: [GB, D]) over a tile's key rows: each
// key row is widened once for all GB heads, whose accumulators stay in registers.
template <typename T, int GB>
__attribute__((noinline)) void scores_tile(const float* q, int64_t D, const T* const* rows, int64_t n, float* s,
                                           float scale, const Ahead<T>* ahead) {
  for (int64_t i = 0; i < n; ++i) {
    if (ahead != nullptr && i < ahead->n) ahead->fetch(i);
    __m256 acc[GB];
#pragma GCC unroll 8
    for (int g = 0; g < GB; ++g) acc[g] = _mm256_setzero_ps();
    const T* k = rows[i];
    for (int64_t c = 0; c < D; c += 8) {
      const __m256 kv = load8(k + c);
#pragma GCC unroll 8
      for (int g = 0; g < GB; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + c), kv, acc[g]);
    }
#pragma GCC unroll 8
    for (int g = 0; g < GB; ++g) s[g * kTile + i] = hsum(acc[g]) * scale;
  }
}

// acc[g, :] += sum_i p[g * kTile + i] * v_i for GB query heads over a tile's value rows, 8 dims at a
// time: the GB partial sums of one chunk stay in registers across the tile's rows (in L1).
template <typename T, int GB>
__attribute__((noinline)) void values_tile(const float* p, const T* const* rows, int64_t n, int64_t D, float* acc) {
  for (int64_t c = 0; c < D; c += 8) {
    __m256 a[GB];
#pragma GCC unroll 8
    for (int g = 0; g < GB; ++g) a[g] = _mm256_loadu_ps(acc + g * D + c);
    for (int64_t i = 0; i < n; ++i) {
      const __m256 v = load8(rows[i] + c);
#pragma GCC unroll 8
      for (int g = 0; g < GB; ++g) a[g] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * kTile + i]), v, a[g]);
    }
#pragma GCC unroll 8
    for (int g = 0; g < GB; ++g) _mm256_storeu_ps(acc + g * D + c, a[g]);
  }
}

template <typename T, int GB>
void tile_heads(const float* q, int64_t D, const T* const* krows, const T* const* vrows, int64_t n, float* s,
                float scale, float softcap, float* m, float* l, float* acc, const Ahead<T>* ahead) {
  scores_tile<T, GB>(q, D, krows, n, s, scale, ahead);
  for (int g = 0; g < GB; ++g) {  // online softmax: rescale what the earlier tiles left
    float* sg = s + g * kTile;
    if (softcap > 0.0f)
      for (int64_t i = 0; i < n; ++i) sg[i] = softcap * std::tanh(sg[i] / softcap);
    const float m_new = std::max(m[g], *std::max_element(sg, sg + n));
    const float alpha = std::exp(m[g] - m_new);
    l[g] = l[g] * alpha + exp_shift_sum(sg, n, m_new);
    m[g] = m_new;
    if (alpha != 1.0f)
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= alpha;
  }
  values_tile<T, GB>(s, vrows, n, D, acc);
}

template <typename T>
void tile_group(int64_t gb, const float* q, int64_t D, const T* const* krows, const T* const* vrows, int64_t n,
                float* s, float scale, float softcap, float* m, float* l, float* acc, const Ahead<T>* ahead) {
  switch (gb) {
    case 1: return tile_heads<T, 1>(q, D, krows, vrows, n, s, scale, softcap, m, l, acc, ahead);
    case 2: return tile_heads<T, 2>(q, D, krows, vrows, n, s, scale, softcap, m, l, acc, ahead);
    case 3: return tile_heads<T, 3>(q, D, krows, vrows, n, s, scale, softcap, m, l, acc, ahead);
    case 4: return tile_heads<T, 4>(q, D, krows, vrows, n, s, scale, softcap, m, l, acc, ahead);
    case 5: return tile_heads<T, 5>(q, D, krows, vrows, n, s, scale, softcap, m, l, acc, ahead);
    case 6: return tile_heads<T, 6>(q, D, krows, vrows, n, s, scale, softcap, m, l, acc, ahead);
    case 7: return tile_heads<T, 7>(q, D, krows, vrows, n, s, scale, softcap, m, l, acc, ahead);
    default: return tile_heads<T, 8>(q, D, krows, vrows, n, s, scale, softcap, m, l, acc, ahead);
  }
}

// One (request, kv head) pair: its G query heads (q, out: [G, D]) against keys start .. len - 1, a tile
// of kTile positions at a time with an online softmax, so each key and value row is read once for all
// G heads (in groups of up to kMaxGroup) while the tile sits in L1; the next tile's rows are requested
// row by row as this tile's scores are computed (one kv head's rows sit Hkv rows apart in blocks
// anywhere in memory, which the hardware prefetcher does not follow). ks/vs: strides (block, slot) of
// the kv head's rows.
template <typename T>
void decode_pair(const float* q, const T* kc, const T* vc, const int32_t* table, int64_t len,
                 int64_t window, int64_t bs, int64_t G, int64_t D, const int64_t* ks, const int64_t* vs,
                 float scale, float softcap, float v_scale, float* out) {
  const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  const T* krows[2][kTile];
  const T* vrows[2][kTile];
  float s[kMaxGroup * kTile];
  std::vector<float> m(G, -INFINITY), l(G, 0.0f);
  std::fill(out, out + G * D, 0.0f);
  auto rows = [&](int64_t p0, int slot, bool prefetch) {
    const int64_t n = std::min(kTile, len - p0);
    tile_rows(kc, ks, table, bs, p0, n, row_bytes, prefetch, krows[slot]);
    tile_rows(vc, vs, table, bs, p0, n, row_bytes, prefetch, vrows[slot]);
    return n;
  };
  rows(start, 0, true);
  for (int64_t p0 = start, slot = 0; p0 < len; p0 += kTile, slot ^= 1) {
    const int64_t n = std::min(kTile, len - p0);
    const int64_t next = p0 + kTile < len ? rows(p0 + kTile, static_cast<int>(slot ^ 1), false) : 0;
    const Ahead<T> ahead{krows[slot ^ 1], vrows[slot ^ 1], next, row_bytes};
    for (int64_t g0 = 0; g0 < G; g0 += kMaxGroup)
      tile_group<T>(std::min<int64_t>(kMaxGroup, G - g0), q + g0 * D, D, krows[slot], vrows[slot], n, s, scale,
                    softcap, m.data() + g0, l.data() + g0, out + g0 * D, g0 == 0 && next ? &ahead : nullptr);
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = v_scale / l[g];
    for (int64_t d = 0; d < D; ++d) out[g * D + d] *= inv;
  }
}

}  // namespace

namespace {

// Whether a [B, H, D] tensor's rows can be read or written in place: float, bf16 or half with
// contiguous head dimensions.
bool readable(const at::Tensor& t) {
  const auto d = t.scalar_type();
  return t.stride(2) == 1 && (d == at::kFloat || d == at::kBFloat16 || d == at::kHalf);
}

// Row (b, h) of a readable [B, H, D] tensor: into f (read) or from f (write), in float32.
void heads_row(const at::Tensor& t, int64_t b, int64_t h, float* f, int64_t D, bool read) {
  const int64_t offset = b * t.stride(0) + h * t.stride(1);
  switch (t.scalar_type()) {
    case at::kFloat: {
      float* p = static_cast<float*>(t.data_ptr()) + offset;
      if (read) std::copy(p, p + D, f);
      else std::copy(f, f + D, p);
      return;
    }
    case at::kBFloat16: {
      auto* p = static_cast<c10::BFloat16*>(t.data_ptr()) + offset;
      if (read) load_row(p, f, D);
      else store_row(f, p, D);
      return;
    }
    default: {
      auto* p = static_cast<c10::Half*>(t.data_ptr()) + offset;
      if (read) load_row(p, f, D);
      else store_row(f, p, D);
    }
  }
}

}  // namespace

// q [B, H, D]; k_cache / v_cache [blocks, block_size, Hkv, D]; block_tables [>=B, max_blocks];
// seq_lens [>=B]; kv_scales: empty, or float32 [2, Hkv] for an fp8 cache; out [B, H, D] (written,
// any float dtype).
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                      int64_t window, double softcap, const at::Tensor& kv_scales, const at::Tensor& out) {
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
  // what a step passes is read in place where it can be (bf16 / half / float q and out with
  // contiguous heads, int32 block tables, int32 or int64 lengths): no conversion or copy per call
  std::vector<float> ones(2 * Hkv, 1.0f);
  const at::Tensor sc = fp8 ? kv_scales.contiguous() : at::Tensor();
  const float* scp = fp8 ? sc.const_data_ptr<float>() : ones.data();
  const bool q_direct = readable(q);
  const at::Tensor qc = q_direct ? q : q.to(at::kFloat).contiguous();
  const bool out_direct = readable(out);
  at::Tensor result = out_direct ? out : at::empty({B, H, D}, q.options().dtype(at::kFloat));
  const at::Tensor table = block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1
                               ? block_tables
                               : block_tables.to(at::kInt).contiguous();
  TORCH_CHECK(table.size(0) >= B && seq_lens.numel() >= B, "decode_attention: fewer table rows than queries");
  const at::Tensor lens =
      seq_lens.scalar_type() == at::kInt ? seq_lens.contiguous() : seq_lens.to(at::kLong).contiguous();
  std::vector<int64_t> lp(B);
  for (int64_t b = 0; b < B; ++b)
    lp[b] = lens.scalar_type() == at::kInt ? lens.const_data_ptr<int32_t>()[b] : lens.const_data_ptr<int64_t>()[b];
  const int64_t ks[2] = {k_cache.stride(0), k_cache.stride(1)};
  const int64_t vs[2] = {v_cache.stride(0), v_cache.stride(1)};
  const int32_t* tp = table.const_data_ptr<int32_t>();
  const int64_t tstride = table.stride(0), tcols = table.size(1);
  for (int64_t b = 0; b < B; ++b) {  // every block read below must exist (the torch reference raises too)
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= tcols * bs, "decode_attention: seq_len ", lp[b], " does not fit the table");
    for (int64_t j = 0; j < (lp[b] + bs - 1) / bs; ++j) {
      const int32_t blk = tp[b * tstride + j];
      TORCH_CHECK(blk >= 0 && blk < k_cache.size(0), "decode_attention: block ", blk, " is outside the cache");
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND3(at::kBFloat16, at::kHalf, at::kFloat8_e4m3fn, k_cache.scalar_type(), "decode_attention", [&] {
    const scalar_t* kp = k_cache.const_data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.const_data_ptr<scalar_t>();
    at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> qbuf(G * D), obuf(G * D);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / Hkv, h = i % Hkv;
        for (int64_t g = 0; g < G; ++g) heads_row(qc, b, h * G + g, qbuf.data() + g * D, D, true);
        decode_pair<scalar_t>(qbuf.data(), kp + h * k_cache.stride(2), vp + h * v_cache.stride(2),
                              tp + b * tstride, lp[b], window, bs, G, D, ks, vs,
                              static_cast<float>(scale) * scp[h], static_cast<float>(softcap), scp[Hkv + h],
                              obuf.data());
        for (int64_t g = 0; g < G; ++g) heads_row(result, b, h * G + g, obuf.data() + g * D, D, false);
      }
    });
  });
  if (!out_direct) out.copy_(result);
}

// HF's RMSNorm up to the float32 sum order: h = float(x); y = w * dtype(h * rsqrt(mean(h^2) + eps)),
// the last product in the weight's dtype (a bf16 element may differ by one rounding step). x [T, N] rows contiguous; w [N].
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
      "float scale, int window, float softcap, Tensor kv_scales, Tensor(a!) out) -> ()",
      decode_attention);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", rms_norm);
}
