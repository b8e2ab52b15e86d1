// Ember bf16 matmul on AVX-512 BF16 without AMX (Zen 4 / Zen 5, Cooper Lake): y[M, N] = x[M, K] @ W[N, K]^T.
//
// Built into the same library as cpu_gemm.cpp and used in its place where the build targets AVX512-BF16 and
// AMX tiles are not granted: the "pairs32" layout, whose bytes are cpu_amx.cpp's tile layout (block b holds
// output rows 16b..16b+15, each 64 bytes a pair of k for the 16 rows, k rounded up to 32 and zero-padded).
// One VDPBF16PS multiplies a pair of k of 16 rows by a broadcast pair of activations and adds both products
// into 16 float32 sums: 32 multiply-adds per instruction against the FMA kernels' 16 (which also widen every
// bf16 weight first), so the many-row products run at up to twice the FMA rate and one row streams the
// weight with a quarter of the instructions. Activations are bf16 terms (cpu_amx.cpp's bf16_terms: the
// bf16 values themselves, or three terms hi / mid / lo of float32 / float16 rows), so products are exact;
// every output is one float32 chain over the pairs of k in order, the terms of a pair in order, whatever M
// and however the threads split the blocks: batch invariance, as for the other kernels.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define EMBER_DPBF16 1
#endif

namespace {

constexpr int64_t kBlock = 16;   // output rows per block
constexpr int kWalk = 4;         // blocks a thread walks at once
constexpr int kRows = 6;         // rows per tile: 6 x 4 sums, 4 weight vectors and a broadcast in 32 registers
constexpr int64_t kPairs = 256;  // pairs of k per pass: 4 blocks' 32 KiB slice stays in L1/L2 for every tile

#ifdef EMBER_DPBF16
// c[R][G] (+)= R activation rows (bf16 terms at a, row stride Kp, term stride ts) . G blocks (block j at
// w + j * Kp * 16) over pairs [p0, p1).
template <int R, int G, int T>
inline void tile(const uint16_t* a, int64_t Kp, int64_t ts, const uint16_t* w, int64_t p0, int64_t p1,
                 __m512 (&c)[R][G]) {
  for (int64_t p = p0; p < p1; ++p) {
    __m512bh wv[G];
    for (int j = 0; j < G; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * Kp * kBlock + p * 2 * kBlock);
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) {
        int32_t two;
        std::memcpy(&two, a + t * ts + r * Kp + 2 * p, 4);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(two);
        for (int j = 0; j < G; ++j) c[r][j] = _mm512_dpbf16_ps(c[r][j], wv[j], xb);
      }
  }
}

// Rows [m, m + R) against G blocks over one pass of pairs, their sums parked in acc [G][M][16] between
// passes (exact: a float32 stored and loaded back is the same float32).
template <int R, int G, int T>
void pass_rows(const uint16_t* a, int64_t m, int64_t M, int64_t Kp, int64_t ts, const uint16_t* w, int64_t p0,
               int64_t p1, float* acc) {
  __m512 c[R][G];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < G; ++j)
      c[r][j] = p0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + (j * M + m + r) * kBlock);
  tile<R, G, T>(a + m * Kp, Kp, ts, w, p0, p1, c);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < G; ++j) _mm512_storeu_ps(acc + (j * M + m + r) * kBlock, c[r][j]);
}

template <int G, int T>
void pass_all(const uint16_t* a, int64_t M, int64_t Kp, int64_t ts, const uint16_t* w, int64_t p0, int64_t p1,
              float* acc) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) pass_rows<kRows, G, T>(a, m, M, Kp, ts, w, p0, p1, acc);
  switch (M - m) {
    case 5: pass_rows<5, G, T>(a, m, M, Kp, ts, w, p0, p1, acc); break;
    case 4: pass_rows<4, G, T>(a, m, M, Kp, ts, w, p0, p1, acc); break;
    case 3: pass_rows<3, G, T>(a, m, M, Kp, ts, w, p0, p1, acc); break;
    case 2: pass_rows<2, G, T>(a, m, M, Kp, ts, w, p0, p1, acc); break;
    case 1: pass_rows<1, G, T>(a, m, M, Kp, ts, w, p0, p1, acc); break;
    default: break;
  }
}

// out [M, n] (dtype O): threads split the groups of kWalk blocks; each group is walked in passes of kPairs
// pairs of k against every tile of rows.
template <int T, typename O>
void dp_matmul(const uint16_t* a, int64_t M, int64_t Kp, int64_t ts, const uint16_t* w, int64_t NB, int64_t n, O* out) {
  const int64_t groups = (NB + kWalk - 1) / kWalk;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> acc(M * kWalk * kBlock);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g * kWalk;
      const int G = static_cast<int>(std::min<int64_t>(kWalk, NB - b));
      const uint16_t* wb = w + b * Kp * kBlock;
      for (int64_t p0 = 0; p0 < Kp / 2; p0 += kPairs) {
        const int64_t p1 = std::min(Kp / 2, p0 + kPairs);
        if (G == kWalk)
          pass_all<kWalk, T>(a, M, Kp, ts, wb, p0, p1, acc.data());
        else  // the last blocks one at a time, into the same places of acc
          for (int j = 0; j < G; ++j) pass_all<1, T>(a, M, Kp, ts, wb + j * Kp * kBlock, p0, p1, acc.data() + j * M * kBlock);
      }
      const int64_t col = b * kBlock, cols = std::min<int64_t>(G * kBlock, n - col);
      for (int64_t m = 0; m < M; ++m) {
        for (int j = 0; j < G && j * kBlock < cols; ++j) {
          const float* src = acc.data() + (j * M + m) * kBlock;
          const int64_t c = std::min<int64_t>(kBlock, cols - j * kBlock);
          if constexpr (std::is_same_v<O, float>)
            std::copy(src, src + c, out + m * n + col + j * kBlock);
          else
            store_row(src, out + m * n + col + j * kBlock, c);
        }
      }
    }
  });
}
#endif

}  // namespace

bool dpbf16_built() {
#ifdef EMBER_DPBF16
  return true;
#else
  return false;
#endif
}

// x [M, K] (float32, bf16 or fp16), packed [NB, Kp, 16] bf16 in the pairs32 (= amx32) layout, n outputs.
at::Tensor gemm_dpbf16(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(dpbf16_built(), "gemm_dpbf16: this build does not target AVX512-BF16");
  at::Tensor xc;
  at::Tensor out = pairs_output(x, packed, n, xc);
  const int64_t M = xc.size(0), K = xc.size(1), Kp = packed.size(1), NB = packed.size(0);  // Kp: checked
  const auto dtype = xc.scalar_type();
  if (M == 0 || K == 0) return out;
#ifdef EMBER_DPBF16
  const int terms = dtype == at::kBFloat16 ? 1 : 3;
  const std::unique_ptr<uint16_t[]> a(new uint16_t[terms * M * Kp]());  // zero padding
  bf16_terms(xc, terms, M, Kp, a.get());
  const uint16_t* w = static_cast<const uint16_t*>(packed.const_data_ptr());
  auto run = [&]<int T>(std::integral_constant<int, T>) {
    if (dtype == at::kBFloat16)
      dp_matmul<T>(a.get(), M, Kp, M * Kp, w, NB, n, out.mutable_data_ptr<c10::BFloat16>());
    else if (dtype == at::kHalf)
      dp_matmul<T>(a.get(), M, Kp, M * Kp, w, NB, n, out.mutable_data_ptr<c10::Half>());
    else
      dp_matmul<T>(a.get(), M, Kp, M * Kp, w, NB, n, out.mutable_data_ptr<float>());
  };
  if (terms == 1)
    run(std::integral_constant<int, 1>{});
  else
    run(std::integral_constant<int, 3>{});
#endif
  return out;
}
