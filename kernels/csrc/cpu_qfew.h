// Ember integer-dot matmul for 1-3 activation rows (decode, verification): csrc/cpu_qgemm.cpp's few-row path.
//
// The packed bits stream through once, so this path is bound by how fast a step of 4 k x 16 rows becomes
// integer sums. Everything the hot loop decides is a template parameter: the format, the group's steps
// (unrolled with constant indices, so that u5's bit selections and the int16 runs' widening points are
// fixed), and whether parameters are float16 and groups have minimums. Included by cpu_qgemm.cpp only.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_qblocks.h"

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace qblocks {

// acc += per 32-bit lane, the 4-byte dot product of u (unsigned) and x (signed).
inline __m256i dot4(__m256i acc, __m256i u, __m256i x) {
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
  return _mm256_dpbusd_epi32(acc, u, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// Steps whose byte products are summed in int16 before widening to int32 (u4: 8 x 2 x 15 x 127 < 2^15; u5: 4).
constexpr int run_of(int F) { return F == kU4 ? 8 : 4; }

// f(std::integral_constant<int, I>{}) for I = 0 .. N - 1, unrolled: every index is a constant.
template <int N, class Fn>
inline __attribute__((always_inline)) void unrolled(Fn&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (f(std::integral_constant<int, I>{}), ...);
  }(std::make_integer_sequence<int, N>{});
}

// Parameter i (of 16 scales, then 16 offsets) of a group, 8 of them from i.
template <bool HALF>
inline __m256 param8(const uint8_t* pg, int i) {
  if constexpr (HALF) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pg + 2 * i)));
  return _mm256_loadu_ps(reinterpret_cast<const float*>(pg) + i);
}

// u5 prefetches each group's bytes this far ahead: with it, a Q5_0 weight that does not fit the caches
// streams ~1.6x faster on a 2-core Zen machine (8 -> 13 GB/s); the i8 and u4 formats' walks of 2-4 blocks
// were as fast or slower with it.
constexpr int64_t kAhead = 1536;

// acc[R][NB][2] += R rows . NB blocks (block j at blk + j * bstride) over gn groups from group g0, whose
// bytes start at blk (block 0's group g0). Per group: exact integer sums, then per output acc = fma(sum,
// scale * d, acc) and, with minimums, acc = fma(offset, d * sum(q), acc): the float operations and order
// of the many-row path (batch invariance). Also the many-row path's i8 tile.
template <int R, int NB, int F, int GS, bool HALF, bool MINS>
void few_tile(const XRow* x, const uint8_t* blk, const Weights& wt, int64_t g0, int64_t gn,
              __m256 (&acc)[R][NB][2]) {
  constexpr int RUN = F == kI8 || kVnni ? 1 : run_of(F);
  const int64_t bs = wt.bstride(), pb = wt.pbytes();
  const __m256 zero = _mm256_set1_ps(static_cast<float>(-wt.pr.zero));
  for (int64_t g = 0; g < gn; ++g) {
    const uint8_t* pg = blk + g * wt.gbytes;
    const uint8_t* gw = pg + pb;
    const int64_t t = (g0 + g) * GS, xg = t / (kXGroup / 4);
    if constexpr (F == kU5)  // u5 is slow enough per byte that the next groups must be asked for early
      for (int64_t o = 0; o < wt.gbytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(pg + o) + kAhead, _MM_HINT_T0);
    __m256i is[R][NB][2], ps[R][NB][2];
    unrolled<GS>([&](auto I) {
      constexpr int i = I;
      __m256i xb[R];
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, x[r].q + 4 * (t + i), 4);
        xb[r] = _mm256_set1_epi32(four);
      }
      for (int j = 0; j < NB; ++j) {
        __m256i a, b;
        unpack<F>(gw + j * bs, i, a, b);
        for (int r = 0; r < R; ++r) {
          if constexpr (F == kI8 || kVnni) {
            __m256i ua = a, ub = b, xa = xb[r], xbb = xb[r];
            if constexpr (F == kI8) {
              ua = _mm256_sign_epi8(a, a), ub = _mm256_sign_epi8(b, b);
              xa = _mm256_sign_epi8(xb[r], a), xbb = _mm256_sign_epi8(xb[r], b);
            }
            const __m256i z = _mm256_setzero_si256();
            is[r][j][0] = dot4(i == 0 ? z : is[r][j][0], ua, xa);
            is[r][j][1] = dot4(i == 0 ? z : is[r][j][1], ub, xbb);
          } else {
            const __m256i pa = _mm256_maddubs_epi16(a, xb[r]), pbb = _mm256_maddubs_epi16(b, xb[r]);
            ps[r][j][0] = i % RUN == 0 ? pa : _mm256_add_epi16(ps[r][j][0], pa);
            ps[r][j][1] = i % RUN == 0 ? pbb : _mm256_add_epi16(ps[r][j][1], pbb);
          }
        }
      }
      if constexpr (F != kI8 && !kVnni && (i + 1) % RUN == 0) {
        const __m256i ones = _mm256_set1_epi16(1);
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < NB; ++j)
            for (int h = 0; h < 2; ++h) {
              const __m256i w = _mm256_madd_epi16(ps[r][j][h], ones);
              is[r][j][h] = i + 1 == RUN ? w : _mm256_add_epi32(is[r][j][h], w);
            }
      }
    });
    for (int j = 0; j < NB; ++j) {
      const uint8_t* pj = pg + j * bs;
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = param8<HALF>(pj, 8 * h);
        __m256 off = _mm256_setzero_ps();
        if constexpr (MINS) off = wt.pr.offsets ? param8<HALF>(pj, kBlock + 8 * h) : _mm256_mul_ps(scale, zero);
        for (int r = 0; r < R; ++r) {
          const __m256 f = _mm256_cvtepi32_ps(is[r][j][h]);
          acc[r][j][h] = _mm256_fmadd_ps(f, _mm256_mul_ps(scale, _mm256_set1_ps(x[r].d[xg])), acc[r][j][h]);
          if constexpr (MINS) acc[r][j][h] = _mm256_fmadd_ps(off, _mm256_set1_ps(x[r].s[xg]), acc[r][j][h]);
        }
      }
    }
  }
}

// Block results (16 floats: rows 0..7, 8..15) -> out[col .. col + 16) (fewer at the edge).
inline void store_block(const __m256 (&v)[2], float* out, int64_t col, int64_t n) {
  alignas(32) float t[kBlock];
  _mm256_store_ps(t, v[0]);
  _mm256_store_ps(t + 8, v[1]);
  std::copy(t, t + std::min<int64_t>(kBlock, n - col), out + col);
}

// R rows against NB blocks from block b, over all groups, into out.
template <int R, int NB, int F, int GS, bool HALF, bool MINS>
void few_blocks(const XRow* x, const Weights& wt, int64_t b, float* out, int64_t ldo, int64_t n) {
  __m256 acc[R][NB][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
  few_tile<R, NB, F, GS, HALF, MINS>(x, wt.w + b * wt.bstride(), wt, 0, wt.groups, acc);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) store_block(acc[r][j], out + r * ldo, (b + j) * kBlock, n);
}

// Blocks walked at once: their sums fit the 16 vector registers.
template <int R, int F>
constexpr int few_group() {
  if constexpr (F == kU5) return 1;
  return R == 1 ? 4 : R == 2 ? 2 : 1;
}

template <int R, int F, int GS, bool HALF, bool MINS>
void few_rows_p(const XRow* x, const Weights& wt, float* out, int64_t ldo, int64_t n) {
  constexpr int G = few_group<R, F>();
  const int64_t groups = (wt.nblocks + G - 1) / G;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g * G;
      if (b + G <= wt.nblocks) {
        few_blocks<R, G, F, GS, HALF, MINS>(x, wt, b, out, ldo, n);
        continue;
      }
      for (int64_t t = b; t < wt.nblocks; ++t) few_blocks<R, 1, F, GS, HALF, MINS>(x, wt, t, out, ldo, n);
    }
  });
}

// f(std::bool_constant<HALF>, std::bool_constant<MINS>) for the weight's parameters.
template <class Fn>
inline void with_params(const Params& pr, Fn&& f) {
  if (pr.half) {
    if (pr.mins()) return f(std::true_type{}, std::true_type{});
    return f(std::true_type{}, std::false_type{});
  }
  if (pr.mins()) return f(std::false_type{}, std::true_type{});
  f(std::false_type{}, std::false_type{});
}

// R (1..3) rows: the packed bits stream once, threads split the blocks.
template <int R, int F, int GS>
void few_rows(const XRow* x, const Weights& wt, float* out, int64_t ldo, int64_t n) {
  with_params(wt.pr, [&](auto half, auto mins) { few_rows_p<R, F, GS, half(), mins()>(x, wt, out, ldo, n); });
}

}  // namespace qblocks
