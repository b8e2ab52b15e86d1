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
// 2^-8 times the fp8 value) and then fp32 with F16C. Accumulation is fp32; activations are read as fp32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int kBlock = 16;   // output rows per packed block
constexpr int kMaxRows = 6;  // rows of x per micro-kernel call
constexpr int64_t kRowChunk = 96;  // rows of x kept hot (L2) while a thread walks its weight blocks

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

// x row r at step k into c<r>a / c<r>b. Named accumulators (not an array) so that GCC keeps all
// twelve in registers.
#define EMBER_FMA(r)                                            \
  if constexpr ((r) < R) {                                      \
    const __m256 xb = _mm256_broadcast_ss(x + (r) * ldx + k);   \
    c##r##a = _mm256_fmadd_ps(lo, xb, c##r##a);                 \
    c##r##b = _mm256_fmadd_ps(hi, xb, c##r##b);                 \
  }

// out[r, 0:nvalid] = sum_k x[r, k] * W[block, k] for R rows of x (R <= 6). Each output is one FMA
// chain over k in order whatever R, so a row's result does not depend on the rows beside it (batch
// invariance: speculative verification and batched decode give bit-identical logits). One chain per
// lane still outruns DRAM here (~20 GB/s of weights per thread); no software prefetch either (it
// slowed the weight streams ~15% here).
// w is the block in format F: packed, or (kF32) already widened, which spares the conversion ops per
// k when many rows reuse the block. Results are multiplied by `scale` once, at the end.
template <int R, int F>
void micro(const float* x, int64_t ldx, const uint8_t* w, int64_t K, float scale, float* out,
           int64_t ldo, int nvalid) {
  static_assert(R <= kMaxRows, "twelve accumulators at most");
  __m256 c0a = _mm256_setzero_ps(), c0b = c0a, c1a = c0a, c1b = c0a, c2a = c0a, c2b = c0a;
  __m256 c3a = c0a, c3b = c0a, c4a = c0a, c4b = c0a, c5a = c0a, c5b = c0a;
  for (int64_t k = 0; k < K; ++k) {
    __m256 lo, hi;
    unpack<F>(w + k * block_bytes(F), lo, hi);
    EMBER_FMA(0) EMBER_FMA(1) EMBER_FMA(2) EMBER_FMA(3) EMBER_FMA(4) EMBER_FMA(5)
  }
  alignas(32) float acc[kMaxRows][kBlock];
  const __m256 all[kMaxRows][2] = {{c0a, c0b}, {c1a, c1b}, {c2a, c2b}, {c3a, c3b}, {c4a, c4b}, {c5a, c5b}};
  const __m256 s = _mm256_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(acc[r], _mm256_mul_ps(all[r][0], s));
    _mm256_store_ps(acc[r] + 8, _mm256_mul_ps(all[r][1], s));
    std::copy(acc[r], acc[r] + nvalid, out + r * ldo);
  }
}
#undef EMBER_FMA

template <int F>
void rows(int R, const float* x, int64_t ldx, const uint8_t* w, int64_t K, float scale, float* out,
          int64_t ldo, int nvalid) {
  switch (R) {
    case 1: return micro<1, F>(x, ldx, w, K, scale, out, ldo, nvalid);
    case 2: return micro<2, F>(x, ldx, w, K, scale, out, ldo, nvalid);
    case 3: return micro<3, F>(x, ldx, w, K, scale, out, ldo, nvalid);
    case 4: return micro<4, F>(x, ldx, w, K, scale, out, ldo, nvalid);
    case 5: return micro<5, F>(x, ldx, w, K, scale, out, ldo, nvalid);
    default: return micro<6, F>(x, ldx, w, K, scale, out, ldo, nvalid);
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

// R (1..3) rows: groups of G = 4 / 3 / 2 blocks, the last few blocks one at a time.
template <int R, int F>
void few_rows(const float* x, int64_t ldx, const uint8_t* wp, int64_t K, int64_t NB, float scale, float* out,
              int64_t ldo, int64_t n) {
  constexpr int G = R == 1 ? 4 : R == 2 ? 3 : 2;
  const int64_t groups = (NB + G - 1) / G;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g * G;
      if (b + G <= NB) {
        tile<R, G, F>(x, ldx, wp + b * K * block_bytes(F), K, scale, out, ldo, b * kBlock, n);
        continue;
      }
      for (int64_t t = b; t < NB; ++t) {
        const int nvalid = static_cast<int>(std::min<int64_t>(kBlock, n - t * kBlock));
        rows<F>(R, x, ldx, wp + t * K * block_bytes(F), K, scale, out + t * kBlock, ldo, nvalid);
      }
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
  const bool f32 = xc.scalar_type() == at::kFloat;
  TORCH_CHECK(f32 || xc.scalar_type() == at::kBFloat16 || xc.scalar_type() == at::kHalf,
              "gemm: activations must be float32, bfloat16 or float16");
  // Rows of x a multiple of 4 KiB apart (K = 1024, 2048, ...) share L1 sets, and the six rows a
  // micro-kernel broadcasts from then compete with the weights there (0-6% slower here): copies of
  // more than three rows are padded by one cache line per row.
  const bool pad = M > 3 && (K * 4) % 4096 == 0;
  const int64_t ldx = pad ? K + 16 : K;
  const bool copy = !f32 || pad;
  std::vector<float> xbuf(copy ? M * ldx : 0), obuf(f32 ? 0 : M * n);
  for (int64_t m = 0; copy && m < M; ++m) {
    if (xc.scalar_type() == at::kBFloat16)
      load_row(xc.const_data_ptr<c10::BFloat16>() + m * K, xbuf.data() + m * ldx, K);
    else if (xc.scalar_type() == at::kHalf)
      load_row(xc.const_data_ptr<c10::Half>() + m * K, xbuf.data() + m * ldx, K);
    else
      std::copy_n(xc.const_data_ptr<float>() + m * K, K, xbuf.data() + m * ldx);
  }
  at::Tensor out = at::empty({M, n}, xc.options());
  const float* xp = copy ? xbuf.data() : xc.const_data_ptr<float>();
  float* op = f32 ? out.mutable_data_ptr<float>() : obuf.data();
  const uint8_t* wp = static_cast<const uint8_t*>(packed.const_data_ptr());
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t mc = std::min(kRowChunk, M - m0);
    if (mc <= 3) {
      const float* x0 = xp + m0 * ldx;
      float* o0 = op + m0 * n;
      if (mc == 1) few_rows<1, F>(x0, ldx, wp, K, NB, scale, o0, n, n);
      if (mc == 2) few_rows<2, F>(x0, ldx, wp, K, NB, scale, o0, n, n);
      if (mc == 3) few_rows<3, F>(x0, ldx, wp, K, NB, scale, o0, n, n);
      continue;
    }
    const bool widen = mc >= 2 * kMaxRows;  // the block serves several row tiles: widen it once
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> wide(widen ? K * kBlock : 0);
      const uint8_t* wide_bytes = reinterpret_cast<const uint8_t*>(wide.data());
      for (int64_t b = b0; b < b1; ++b) {
        const int nvalid = static_cast<int>(std::min<int64_t>(kBlock, n - b * kBlock));
        const uint8_t* wb = wp + b * K * block_bytes(F);
        if (widen) widen_block<F>(wb, K, wide.data());
        // tiles as even as possible (32 rows: 6 6 5 5 5 5, not 6 6 6 6 6 2): a tile's time per k is
        // bounded below by the FMA latency, so a 2-row tile costs nearly what a 6-row one does
        for (int64_t r = 0, R = 0; r < mc; r += R) {
          const int64_t tiles = (mc - r + kMaxRows - 1) / kMaxRows;
          R = (mc - r + tiles - 1) / tiles;
          float* o = op + (m0 + r) * n + b * kBlock;
          if (widen)
            rows<kF32>(R, xp + (m0 + r) * ldx, ldx, wide_bytes, K, scale, o, n, nvalid);
          else
            rows<F>(R, xp + (m0 + r) * ldx, ldx, wb, K, scale, o, n, nvalid);
        }
      }
    });
  }
  if (xc.scalar_type() == at::kBFloat16)
    store_row(obuf.data(), out.mutable_data_ptr<c10::BFloat16>(), M * n);
  else if (xc.scalar_type() == at::kHalf)
    store_row(obuf.data(), out.mutable_data_ptr<c10::Half>(), M * n);
  return out;
}

}  // namespace

// x [M, K] (fp32 or bf16, rows contiguous), packed [NB, K, 16] bf16, n = true output count.
at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16, "gemm_bf16: the packed weight must be bf16");
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
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1);
  at::Tensor out = at::empty({(N + kBlock - 1) / kBlock, K, kBlock}, wc.options());
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
  m.def("gemm_bf16(Tensor x, Tensor packed, int n) -> Tensor", gemm_bf16);
  m.def("gemm_fp8(Tensor x, Tensor packed, Tensor scale, int n) -> Tensor", gemm_fp8);
}
