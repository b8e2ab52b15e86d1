// Ember CPU fast path: y[M, N] = x[M, K] @ W[N, K]^T with W in bf16 or fp8 (e4m3), packed for AVX2 + FMA.
//
// Built on first use by kernels/native.py through torch.utils.cpp_extension (only light ATen
// headers) and registered as torch.ops.ember.gemm_bf16 / gemm_fp8; threads come from torch's own
// OpenMP pool (at::parallel_for). Both layouts cut W into blocks of 16 output rows (see pack_bf16 /
// pack_fp8 in cpu_gemm.py). bf16: block b stores, for every k, 8 32-bit lanes where lane i holds
// W[16b + i, k] in its low half and W[16b + 8 + i, k] in its high half; one 256-bit load then gives
// both halves as fp32 with one shift and one mask. fp8: block b stores, for every k, the 16 bytes
// W[16b + i, k]; they become fp16 bit patterns with one sign extension, one shift and one mask (e4m3's
// 4 exponent and 3 mantissa bits sit under fp16's, so every value, subnormals included, is exactly
// 2^-8 times the fp8 value) and then fp32 with F16C. Accumulation is fp32; activations are read as fp32:
// 1-3 rows row-major against several blocks at once (decode: bandwidth-bound), 4 or more rows as
// panels of up to 6 rows, each k's values together, against one block at a time in passes of 256 k
// (prefill and batched decode: a GotoBLAS-style blocking of the 6x16 FMA micro-kernel).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr int kBlock = 16;   // output rows per packed block
constexpr int kMaxRows = 6;  // rows of x per micro-kernel call
constexpr int64_t kRowChunk = 96;  // rows of x kept hot (L2) while a thread walks its weight blocks
constexpr int64_t kChunkK = 256;   // k steps per pass over a block: its widened slice (16 KiB) stays in L1
#if defined(__AVX512F__)
constexpr int64_t kFewRows = 8;  // rows that take the row-major few-row tiles (AVX-512: 32 registers)
#else
constexpr int64_t kFewRows = 3;
#endif

// Weight formats of a block: already widened to float32 [K, 16], packed bf16, packed fp8.
enum Fmt { kF32 = 0, kBf16 = 1, kFp8 = 2 };
constexpr int64_t block_bytes(int fmt) { return fmt == kFp8 ? kBlock : fmt == kBf16 ? 2 * kBlock : 4 * kBlock; }
// e4m3 -> fp16 patterns are 2^-8 times the fp8 values: the matmul's scale takes the 2^8 back
constexpr float kFp8Unit = 256.0f;

// One k of a block -> rows 0..7 (lo) and 8..15 (hi) as float32.
template <int F>
inline void unpack(const uint8_t* w, __m256& lo, __m256& hi) {
  if constexpr (F == kF32) {
    lo = _mm256_loadu_ps(reinterpret_cast<const float*>(w));
    hi = _mm256_loadu_ps(reinterpret_cast<const float*>(w) + 8);
  } else if constexpr (F == kBf16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else {
    // sign-extended byte << 7: sign lands in bit 15 (bit 14 gets a copy, masked off), exponent and
    // mantissa in bits 13..7
    const __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m256i f = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(f));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(f, 1));
  }
}

// Panel row r at step k into c<r>a / c<r>b. Named accumulators (not an array) so that GCC keeps all
// twelve in registers.
#define EMBER_FMA(r)                                           \
  if constexpr ((r) < R) {                                     \
    const __m256 xb = _mm256_broadcast_ss(x + k * R + (r));    \
    c##r##a = _mm256_fmadd_ps(lo, xb, c##r##a);                \
    c##r##b = _mm256_fmadd_ps(hi, xb, c##r##b);                \
  }
#define EMBER_LOAD(r)                               \
  if constexpr ((r) < R) {                          \
    c##r##a = _mm256_loadu_ps(acc + (r) * kBlock);      \
    c##r##b = _mm256_loadu_ps(acc + (r) * kBlock + 8);  \
  }
#define EMBER_STORE(r)                                    \
  if constexpr ((r) < R) {                                \
    _mm256_storeu_ps(acc + (r) * kBlock, c##r##a);        \
    _mm256_storeu_ps(acc + (r) * kBlock + 8, c##r##b);    \
  }

// acc[r, 0:16] (+)= sum over kn steps of x[r, k] * W[block, k] for an R-row panel x (x[k * R + r], one
// contiguous stream for the broadcasts; R <= 6), starting from zero when `first`. Each output is one
// FMA chain over k in order whatever R and however K is cut into passes (the partial sums park in
// float32), so a row's result does not depend on the rows beside it (batch invariance: speculative
// verification and batched decode give bit-identical logits).
// w is the block in format F: packed, or (kF32) already widened, which spares the conversion ops per
// k when many rows reuse the block.
template <int R, int F>
void micro(const float* x, const uint8_t* w, int64_t kn, float* acc, bool first) {
  static_assert(R <= kMaxRows, "twelve accumulators at most");
  __m256 c0a = _mm256_setzero_ps(), c0b = c0a, c1a = c0a, c1b = c0a, c2a = c0a, c2b = c0a;
  __m256 c3a = c0a, c3b = c0a, c4a = c0a, c4b = c0a, c5a = c0a, c5b = c0a;
  if (!first) {
    EMBER_LOAD(0) EMBER_LOAD(1) EMBER_LOAD(2) EMBER_LOAD(3) EMBER_LOAD(4) EMBER_LOAD(5)
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < kn; ++k) {
    __m256 lo, hi;
    unpack<F>(w + k * block_bytes(F), lo, hi);
    EMBER_FMA(0) EMBER_FMA(1) EMBER_FMA(2) EMBER_FMA(3) EMBER_FMA(4) EMBER_FMA(5)
  }
  EMBER_STORE(0) EMBER_STORE(1) EMBER_STORE(2) EMBER_STORE(3) EMBER_STORE(4) EMBER_STORE(5)
}
#undef EMBER_FMA
#undef EMBER_LOAD
#undef EMBER_STORE

#include "cpu_gemm512.h"

template <int F>
void rows(int R, const float* x, const uint8_t* w, int64_t kn, float* acc, bool first) {
#if defined(__AVX512F__)
  switch (R) {
    case 1: return micro16<1, F>(x, w, kn, acc, first);
    case 2: return micro16<2, F>(x, w, kn, acc, first);
    case 3: return micro16<3, F>(x, w, kn, acc, first);
    case 4: return micro16<4, F>(x, w, kn, acc, first);
    case 5: return micro16<5, F>(x, w, kn, acc, first);
    default: return micro16<6, F>(x, w, kn, acc, first);
  }
#endif
  switch (R) {
    case 1: return micro<1, F>(x, w, kn, acc, first);
    case 2: return micro<2, F>(x, w, kn, acc, first);
    case 3: return micro<3, F>(x, w, kn, acc, first);
    case 4: return micro<4, F>(x, w, kn, acc, first);
    case 5: return micro<5, F>(x, w, kn, acc, first);
    default: return micro<6, F>(x, w, kn, acc, first);
  }
}

// A packed block widened to float32 [K, 16], same lane order.
template <int F>
void widen_block(const uint8_t* w, int64_t K, float* dst) {
  for (int64_t k = 0; k < K; ++k) {
    __m256 lo, hi;
    unpack<F>(w + k * block_bytes(F), lo, hi);
    _mm256_storeu_ps(dst + k * kBlock, lo);
    _mm256_storeu_ps(dst + k * kBlock + 8, hi);
  }
}

// R rows of x against G consecutive blocks at once, for the few-row products of decode steps and
// speculative verification: 2RG independent FMA chains (at most 12) keep more weight streams in flight
// than one block's (~1.4x the bandwidth on the larger matrices here). Each output is still one FMA chain
// over k in order, as in micro(), so results do not depend on R or G.
template <int R, int G, int F>
void tile(const float* x, int64_t ldx, const uint8_t* w, int64_t K, float scale, float* out, int64_t ldo,
          int64_t first_col, int64_t n) {
  static_assert(R * G <= kMaxRows, "twelve accumulators at most");
  const int64_t stride = K * block_bytes(F);
  __m256 lo[R][G], hi[R][G];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < G; ++j) lo[r][j] = hi[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 xb[R];
    for (int r = 0; r < R; ++r) xb[r] = _mm256_broadcast_ss(x + r * ldx + k);
    for (int j = 0; j < G; ++j) {
      __m256 wl, wh;
      unpack<F>(w + j * stride + k * block_bytes(F), wl, wh);
      for (int r = 0; r < R; ++r) {
        lo[r][j] = _mm256_fmadd_ps(wl, xb[r], lo[r][j]);
        hi[r][j] = _mm256_fmadd_ps(wh, xb[r], hi[r][j]);
      }
    }
  }
  const __m256 s = _mm256_set1_ps(scale);
  alignas(32) float acc[kBlock];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < G; ++j) {
      _mm256_store_ps(acc, _mm256_mul_ps(lo[r][j], s));
      _mm256_store_ps(acc + 8, _mm256_mul_ps(hi[r][j], s));
      const int64_t col = first_col + j * kBlock;
      std::copy(acc, acc + std::min<int64_t>(kBlock, n - col), out + r * ldo + col);
    }
  }
}

// R (1..kFewRows) rows: groups of G = 4 / 3 / 2 blocks (AVX-512: 8 for one row, 4 up to four, else
// 2), the last few blocks one at a time.
template <int R, int F>
void few_rows(const float* x, int64_t ldx, const uint8_t* wp, int64_t K, int64_t NB, float scale, float* out,
              int64_t ldo, int64_t n) {
#if defined(__AVX512F__)
  constexpr int G = R == 1 ? 8 : R <= 4 ? 4 : 2;
#define EMBER_TILE tile16
#else
  constexpr int G = R == 1 ? 4 : R == 2 ? 3 : 2;
#define EMBER_TILE tile
#endif
  const int64_t groups = (NB + G - 1) / G;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g * G;
      if (b + G <= NB) {
        EMBER_TILE<R, G, F>(x, ldx, wp + b * K * block_bytes(F), K, scale, out, ldo, b * kBlock, n);
        continue;
      }
      for (int64_t t = b; t < NB; ++t)
        EMBER_TILE<R, 1, F>(x, ldx, wp + t * K * block_bytes(F), K, scale, out, ldo, t * kBlock, n);
    }
  });
#undef EMBER_TILE
}

// Row tiles of a chunk of mc rows (4..kRowChunk), as even as possible (32 rows: 6 6 5 5 5 5, not
// 6 6 6 6 6 2): a tile's time per k is bounded below by the FMA latency, so a 2-row tile costs nearly
// what a 6-row one does. (first row, rows) pairs, rows relative to the chunk.
std::vector<std::pair<int64_t, int>> row_tiles(int64_t mc) {
  std::vector<std::pair<int64_t, int>> tiles;
  for (int64_t r = 0, R = 0; r < mc; r += R) {
    const int64_t left = (mc - r + kMaxRows - 1) / kMaxRows;
    R = (mc - r + left - 1) / left;
    tiles.emplace_back(r, static_cast<int>(R));
  }
  return tiles;
}

// R rows of x (row stride ldx) as a panel pan[k * R + r], in float32.
template <typename T>
void pack_panel(const T* x, int64_t ldx, int R, int64_t K, float* pan) {
  alignas(32) float t[kMaxRows][8];
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    for (int r = 0; r < R; ++r) _mm256_store_ps(t[r], load8(x + r * ldx + k));
    for (int i = 0; i < 8; ++i)
      for (int r = 0; r < R; ++r) pan[(k + i) * R + r] = t[r][i];
  }
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r) pan[k * R + r] = static_cast<float>(x[r * ldx + k]);
}

// out[0:mc] = x @ W^T * scale for a chunk of mc >= 4 rows whose tiles are panels at pan + row * K.
// Threads split the weight blocks; each block is walked in passes of kChunkK steps so that its slice
// (widened to float32 once per pass when the chunk has 12 rows or more) stays in L1 while every
// tile's panel slice streams past it; partial sums park in a per-thread float32 buffer.
template <int F>
void many_rows(const float* pan, int64_t mc, int64_t K, const uint8_t* wp, int64_t NB, float scale, float* out,
               int64_t ldo, int64_t n) {
  const auto tiles = row_tiles(mc);
#if defined(__AVX512F__)
  const bool widen = false;  // one unpack per 16 outputs of a row tile costs less than the widened pass
#else
  const bool widen = mc >= 2 * kMaxRows;
#endif
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> wide(widen ? kChunkK * kBlock : 0), acc(mc * kBlock);
    const uint8_t* wide_bytes = reinterpret_cast<const uint8_t*>(wide.data());
    const __m256 s = _mm256_set1_ps(scale);
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t k0 = 0; k0 < K; k0 += kChunkK) {
        const int64_t kn = std::min(kChunkK, K - k0);
        const uint8_t* wb = wp + (b * K + k0) * block_bytes(F);
        if (widen) widen_block<F>(wb, kn, wide.data());
        for (const auto& [r, R] : tiles) {
          const float* xt = pan + r * K + k0 * R;
          if (widen)
            rows<kF32>(R, xt, wide_bytes, kn, acc.data() + r * kBlock, k0 == 0);
          else
            rows<F>(R, xt, wb, kn, acc.data() + r * kBlock, k0 == 0);
        }
      }
      const int64_t nvalid = std::min<int64_t>(kBlock, n - b * kBlock);
      for (int64_t r = 0; r < mc; ++r) {
        float* o = out + r * ldo + b * kBlock;
        const __m256 lo = _mm256_mul_ps(_mm256_loadu_ps(acc.data() + r * kBlock), s);
        const __m256 hi = _mm256_mul_ps(_mm256_loadu_ps(acc.data() + r * kBlock + 8), s);
        if (nvalid == kBlock) {
          _mm256_storeu_ps(o, lo);
          _mm256_storeu_ps(o + 8, hi);
        } else {
          alignas(32) float t[kBlock];
          _mm256_store_ps(t, lo);
          _mm256_store_ps(t + 8, hi);
          std::copy(t, t + nvalid, o);
        }
      }
    }
  });
}

// The rows of x as float32: chunks of 1-3 rows stay row-major (few_rows), the rest become panels.
template <typename T>
void prepare_rows(const T* x, int64_t M, int64_t K, float* rowbuf, float* pan) {
  std::vector<std::pair<int64_t, int>> panels;
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t mc = std::min(kRowChunk, M - m0);
    if (mc <= kFewRows) {
      for (int64_t m = m0; m < m0 + mc && rowbuf != nullptr; ++m) load_row(x + m * K, rowbuf + m * K, K);
      continue;
    }
    for (const auto& [r, R] : row_tiles(mc)) panels.emplace_back(m0 + r, R);
  }
  at::parallel_for(0, static_cast<int64_t>(panels.size()), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const auto& [row, R] = panels[t];
      pack_panel(x + row * K, K, R, K, pan + row * K);
    }
  });
}

// out = x @ W^T * scale for W packed in format F ([NB, K, 16]); x [M, K] as float32.
template <int F>
at::Tensor gemm_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n, float scale) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kBlock, "gemm: bad shapes");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "gemm: CPU tensors only");
  TORCH_CHECK(packed.is_contiguous(), "gemm: the packed weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && n <= NB * kBlock && n > (NB - 1) * kBlock, "gemm: weight/input mismatch");
  // activations widened here and a float32 result kept here for other dtypes: two ATen conversions
  // cost ~8 us per call, a fifth of a small decode matmul
  const at::Tensor xc = x.contiguous();
  const auto dtype = xc.scalar_type();
  const bool f32 = dtype == at::kFloat;
  TORCH_CHECK(f32 || dtype == at::kBFloat16 || dtype == at::kHalf,
              "gemm: activations must be float32, bfloat16 or float16");
  if (K == 0) return at::zeros({M, n}, xc.options());  // the k passes below would not start
  // uninitialised buffers (every element used is written first)
  const std::unique_ptr<float[]> rowbuf(f32 ? nullptr : new float[M * K]), pan(M > kFewRows ? new float[M * K] : nullptr),
      obuf(f32 ? nullptr : new float[M * n]);
  if (dtype == at::kBFloat16)
    prepare_rows(xc.const_data_ptr<c10::BFloat16>(), M, K, rowbuf.get(), pan.get());
  else if (dtype == at::kHalf)
    prepare_rows(xc.const_data_ptr<c10::Half>(), M, K, rowbuf.get(), pan.get());
  else
    prepare_rows(xc.const_data_ptr<float>(), M, K, rowbuf.get(), pan.get());
  at::Tensor out = at::empty({M, n}, xc.options());
  const float* xrows = f32 ? xc.const_data_ptr<float>() : rowbuf.get();
  float* op = f32 ? out.mutable_data_ptr<float>() : obuf.get();
  const uint8_t* wp = static_cast<const uint8_t*>(packed.const_data_ptr());
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t mc = std::min(kRowChunk, M - m0);
    const float* x0 = xrows + m0 * K;
    float* o0 = op + m0 * n;
    switch (mc <= kFewRows ? mc : 0) {
      case 1: few_rows<1, F>(x0, K, wp, K, NB, scale, o0, n, n); break;
      case 2: few_rows<2, F>(x0, K, wp, K, NB, scale, o0, n, n); break;
      case 3: few_rows<3, F>(x0, K, wp, K, NB, scale, o0, n, n); break;
#if defined(__AVX512F__)
      case 4: few_rows<4, F>(x0, K, wp, K, NB, scale, o0, n, n); break;
      case 5: few_rows<5, F>(x0, K, wp, K, NB, scale, o0, n, n); break;
      case 6: few_rows<6, F>(x0, K, wp, K, NB, scale, o0, n, n); break;
      case 7: few_rows<7, F>(x0, K, wp, K, NB, scale, o0, n, n); break;
      case 8: few_rows<8, F>(x0, K, wp, K, NB, scale, o0, n, n); break;
#endif
      default: many_rows<F>(pan.get() + m0 * K, mc, K, wp, NB, scale, o0, n, n);
    }
  }
  if (dtype == at::kBFloat16)
    store_row(obuf.get(), out.mutable_data_ptr<c10::BFloat16>(), M * n);
  else if (dtype == at::kHalf)
    store_row(obuf.get(), out.mutable_data_ptr<c10::Half>(), M * n);
  return out;
}

}  // namespace

// x [M, K] (fp32 or bf16, rows contiguous), packed [NB, K, 16] bf16, n = true output count.
at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16, "gemm_bf16: the packed weight must be bf16");
  if (amx_ready()) return gemm_amx(x, packed, n);  // its own layout (pack_weight below)
  if (dpbf16_built()) return gemm_dpbf16(x, packed, n);  // the same bytes
  return gemm_packed<kBf16>(x, packed, n, 1.0f);
}

// x [M, K], packed [NB, K, 16] float8_e4m3fn, scale: float32 [1] (W = packed value * scale).
at::Tensor gemm_fp8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t n) {
  TORCH_CHECK(packed.scalar_type() == at::kFloat8_e4m3fn, "gemm_fp8: the packed weight must be float8_e4m3fn");
  TORCH_CHECK(scale.numel() == 1 && scale.scalar_type() == at::kFloat && scale.device().is_cpu(),
              "gemm_fp8: scale must be one float32 on the CPU");
  return gemm_packed<kFp8>(x, packed, n, *scale.const_data_ptr<float>() * kFp8Unit);
}

// W [N, K] (2-byte or 1-byte elements, rows contiguous) -> [NB, K, 16] in the layout of pack_bf16 /
// pack_fp8 in cpu_gemm.py (rows past N are zero): the load-time packing, at memory speed.
template <typename E, bool Pairs>
void pack_blocks(const E* w, int64_t N, int64_t K, E* out) {
  const int64_t NB = (N + kBlock - 1) / kBlock;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      E* dst = out + b * K * kBlock;
      const E* src[kBlock];  // block row j lands in lane 2 (j % 8) + j / 8 (bf16 pairs) or j
      int lane[kBlock];
      int rows = 0;
      for (int j = 0; j < kBlock && b * kBlock + j < N; ++j, ++rows) {
        src[j] = w + (b * kBlock + j) * K;
        lane[j] = Pairs ? 2 * (j % 8) + j / 8 : j;
      }
      for (int64_t k = 0; k < K; ++k) {
        E* d = dst + k * kBlock;
        if (rows < kBlock) std::fill(d, d + kBlock, E(0));
        for (int j = 0; j < rows; ++j) d[lane[j]] = src[j][k];
      }
    }
  });
}

at::Tensor pack_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu(), "pack_weight: a 2-D CPU tensor");
  if (w.scalar_type() == at::kBFloat16 && (amx_ready() || dpbf16_built())) return pack_amx(w);
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1);
  at::Tensor out = weight_empty({(N + kBlock - 1) / kBlock, K, kBlock}, wc.scalar_type());
  if (wc.scalar_type() == at::kBFloat16) {
    pack_blocks<uint16_t, true>(static_cast<const uint16_t*>(wc.const_data_ptr()), N, K,
                                static_cast<uint16_t*>(out.mutable_data_ptr()));
  } else {
    TORCH_CHECK(wc.scalar_type() == at::kFloat8_e4m3fn, "pack_weight: bf16 or float8_e4m3fn weights");
    pack_blocks<uint8_t, false>(static_cast<const uint8_t*>(wc.const_data_ptr()), N, K,
                                static_cast<uint8_t*>(out.mutable_data_ptr()));
  }
  return out;
}

TORCH_LIBRARY(ember, m) {
  m.def("pack_weight(Tensor w) -> Tensor", pack_weight);
  m.def("bf16_layout() -> str",
        [] { return std::string(amx_ready() ? "amx32" : dpbf16_built() ? "pairs32" : "packed16"); });
  m.def("amx_claim() -> bool", amx_claim);
  m.def("gemm_bf16(Tensor x, Tensor packed, int n) -> Tensor", gemm_bf16);
  m.def("gemm_fp8(Tensor x, Tensor packed, Tensor scale, int n) -> Tensor", gemm_fp8);
}
