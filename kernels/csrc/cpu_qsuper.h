// Ember integer-dot matmul for the K-quants' superblocks (u4 / u5 / u6 with kSuper parameters: Q4_K, Q5_K,
// Q6_K): integer sums over a whole superblock of 256 k, one float step per superblock.
//
// A superblock's groups (32 k, 16 for u6) each carry a signed-byte sub-scale and, with offsets, a sub-min;
// one float32 d (and -dmin) per row scales them all. With the activations quantized per 256 k (one scale D
// per row and superblock, as GGUF's Q8_K), every product inside a superblock is an integer:
//   y += D d (sum_s sc_s dot_s) + D (-dmin) (sum_s min_s bsum_s)           (offsets: Q4_K, Q5_K)
//   y += D d (sum_s sc_s dot_s - zero sum_s sc_s bsum_s)                    (zero point: Q6_K)
// where dot_s is a group's exact int32 dot product (vpdpbusd, or the AVX2 pairs of vpmaddubsw) and bsum_s
// the sum of the row's int8 activations over the group. Per group that is one integer multiply-add per
// output vector, instead of the per-group float steps of few_tile(); the minimums are one vpmaddwd
// (vpdpwssd) per pair of groups. All sums are exact (|sum| < 2^31 for 6-bit scales and 8-bit activations),
// and the few-row and many-row paths run the same float operations in the same order: batch invariance.
// Included by cpu_qgemm.cpp only.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_qblocks.h"
#include "cpu_qfew.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

namespace qblocks {

// Before a tile's loops over rows, blocks and halves: they unroll completely before GCC's scalar
// replacement of arrays, so the tile's int32 sums stay in registers (left to GCC's later unrolling they
// lived on the stack, and 32-row products took 1.1-1.4x as long).
#define EMBER_TILE _Pragma("GCC unroll 16")

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
inline VI vadd(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VI vmullo(VI a, VI b) { return _mm512_mullo_epi32(a, b); }
inline VI vdpwssd(VI acc, VI a, VI b) { return _mm512_dpwssd_epi32(acc, a, b); }
inline VI vbytes32(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VI vpair(VI lo, VI hi) {
  return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(hi, 16));
}
#else
inline VI vadd(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VI vmullo(VI a, VI b) { return _mm256_mullo_epi32(a, b); }
inline VI vdpwssd(VI acc, VI a, VI b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
inline VI vbytes32(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline VI vpair(VI lo, VI hi) {
  return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(hi, 16));
}
#endif

// x rows (T = float, bf16 or half; K a multiple of 256) -> int8 per 256 k: d [K / 256] per row, and b [K / G]
// the integer sums of q per group of G (16 or 32) k, as int16.
template <typename T>
void quantize_rows_super(const T* x, int64_t M, int64_t K, int64_t G, int8_t* q, float* d, int16_t* b) {
  constexpr int64_t S = kSuperSteps * 4;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    alignas(32) float buf[S];
    alignas(32) int32_t t[S];
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t u = 0; u < K / S; ++u) {
        load_row(x + m * K + u * S, buf, S);
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 amax = _mm256_setzero_ps();
        for (int64_t i = 0; i < S; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_load_ps(buf + i)));
        __m128 mx = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        mx = _mm_max_ps(mx, _mm_movehl_ps(mx, mx));
        mx = _mm_max_ss(mx, _mm_shuffle_ps(mx, mx, 1));
        const float dd = _mm_cvtss_f32(mx) / 127.0f;
        const __m256 id = _mm256_set1_ps(dd != 0.0f ? 1.0f / dd : 0.0f);
        int8_t* qu = q + m * K + u * S;
        for (int64_t i = 0; i < S; i += 32) {
          __m256i iv[4];
          for (int j = 0; j < 4; ++j) {
            iv[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(buf + i + 8 * j), id));  // nearest even
            _mm256_store_si256(reinterpret_cast<__m256i*>(t + i + 8 * j), iv[j]);
          }
          const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
          const __m256i ordered = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(qu + i), ordered);
        }
        d[m * (K / S) + u] = dd;
        for (int64_t g = 0; g < S / G; ++g) {
          int32_t sum = 0;
          for (int64_t i = 0; i < G; ++i) sum += t[g * G + i];
          b[m * (K / G) + u * (S / G) + g] = static_cast<int16_t>(sum);
        }
      }
  });
}

// Where a superblock's parts are, for block j: the packed unit as stored (BYTES false: [16 d][16 -dmin]
// then per group [16 int8 sub-scales][16 int8 sub-mins][steps]) or the many-row path's unpacked copy
// (BYTES: [16 d][16 -dmin][per pair of groups: 16 int32, the two groups' min coefficients as int16 halves]
// then per group [16 int32 sub-scales][steps as bytes, 64 each]). js: one block's unit to the next.
template <int F, int GS, bool OFFS, bool BYTES>
struct SuperAt {
  static constexpr int kSubs = kSuperSteps / GS, kPairs = kSubs / 2;
  static constexpr int64_t kHead = (OFFS ? 2 : 1) * kBlock * 4;
  static constexpr int64_t kGroup = kBlock * 4 + GS * 64;  // an unpacked group
  static constexpr int64_t kBytes = kHead + kPairs * 64 + kSubs * kGroup;  // an unpacked unit
  const uint8_t* unit;
  int64_t js, gs, pb;  // block stride, packed group stride and parameter bytes
  int zero;
  SuperAt(const uint8_t* u, const Weights& wt, int64_t jstride)
      : unit(u), js(jstride), gs(wt.gstride()), pb(wt.pbytes()), zero(wt.pr.zero) {}
  VF d(int j, int h) const { return vloadf(reinterpret_cast<const float*>(unit + j * js) + kLanes * h); }
  VF nd(int j, int h) const { return vloadf(reinterpret_cast<const float*>(unit + j * js) + kBlock + kLanes * h); }
  const uint8_t* group(int j, int s) const {
    return unit + j * js + (BYTES ? kHead + kPairs * 64 + s * kGroup : kHead + s * gs);
  }
  const uint8_t* steps(int j, int s) const { return group(j, s) + (BYTES ? kBlock * 4 : pb); }
  VI scale(int j, int s, int h) const {
    if constexpr (BYTES) return vload(group(j, s) + 4 * kLanes * h);
    return vbytes32(group(j, s) + kLanes * h);
  }
  // lanes h of the min coefficients of groups 2p, 2p + 1 (sub-mins, or -zero x sub-scales), as int16 pairs
  VI pair(int j, int p, int h) const {
    if constexpr (BYTES) return vload(unit + j * js + kHead + 64 * p + 4 * kLanes * h);
    auto coef = [&](int s) {
      const VI c = vbytes32(group(j, s) + (OFFS ? kBlock : 0) + kLanes * h);
      return OFFS ? c : vmullo(c, vbcast(-zero));
    };
    return vpair(coef(2 * p), coef(2 * p + 1));
  }
};

// is[R][NB][H] = the exact int32 dot products of R rows with NB blocks' group of GS steps (block j's steps
// at at.steps(j, s)), x's steps from t. The steps unroll (constant indices) unless they are unpacked bytes
// in 256-bit vectors, where a plain loop keeps the sums in the 16 registers.
template <int R, int NB, int F, int GS, bool OFFS, bool BYTES>
inline __attribute__((always_inline)) void super_dots(const XRow* x, const SuperAt<F, GS, OFFS, BYTES>& at, int s,
                                                      int64_t t, VI (&is)[R][NB][kHalves]) {
  constexpr int H = kHalves;
  EMBER_TILE for (int r = 0; r < R; ++r)
    EMBER_TILE for (int j = 0; j < NB; ++j)
      EMBER_TILE for (int h = 0; h < H; ++h) is[r][j][h] = vzero();
#if !EMBER_QVNNI
  constexpr int RUN = std::min(run_of(F), GS);
  __m256i ps[R][NB][H];  // int16 sums of runs of steps
#endif
  auto step = [&](int i) {
    VI xb[R];
    EMBER_TILE for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, x[r].q + 4 * (t + i), 4);
      xb[r] = vbcast(four);
    }
    EMBER_TILE for (int j = 0; j < NB; ++j) {
      VI w[H];
      unpack<F, BYTES>(at.steps(j, s), i, w);
      EMBER_TILE for (int h = 0; h < H; ++h)
        EMBER_TILE for (int r = 0; r < R; ++r)
#if EMBER_QVNNI
          is[r][j][h] = vdpbusd(is[r][j][h], w[h], xb[r]);
#else
          ps[r][j][h] = _mm256_add_epi16(ps[r][j][h], _mm256_maddubs_epi16(w[h], xb[r]));
#endif
    }
  };
#if EMBER_QVNNI
  if constexpr (BYTES && H == 2) {
#pragma GCC unroll 1
    for (int i = 0; i < GS; ++i) step(i);
  } else {
    unrolled<GS>([&](auto I) { step(I); });
  }
#else
  auto widen = [&]() {
    EMBER_TILE for (int r = 0; r < R; ++r)
      EMBER_TILE for (int j = 0; j < NB; ++j)
        EMBER_TILE for (int h = 0; h < H; ++h) is[r][j][h] = vdpwssd(is[r][j][h], ps[r][j][h], _mm256_set1_epi16(1));
  };
  auto clear = [&]() {
    EMBER_TILE for (int r = 0; r < R; ++r)
      EMBER_TILE for (int j = 0; j < NB; ++j)
        EMBER_TILE for (int h = 0; h < H; ++h) ps[r][j][h] = vzero();
  };
  if constexpr (BYTES) {
    for (int i0 = 0; i0 < GS; i0 += RUN) {
      clear();
#pragma GCC unroll 1
      for (int i = i0; i < i0 + RUN; ++i) step(i);
      widen();
    }
  } else {
    unrolled<GS>([&](auto I) {
      if constexpr (I % RUN == 0) clear();
      step(I);
      if constexpr ((I + 1) % RUN == 0) widen();
    });
  }
#endif
}

// How the few-row paths walk a packed weight on this CPU: blocks at once (several streams in flight) and
// superblocks of software prefetch ahead (0: none). The two CPU families want opposite walks. On a Sapphire
// Rapids class Xeon one row of Q4_K 8960 x 1536 streamed 15.5 GB/s one block at a time, 18.3 four at a
// time 16 superblocks ahead (Q6_K 1536 x 8960: 15.5-17.5 without the prefetch, 18.4-18.9 with it). On a
// 2-core Zen 4 (weights beyond the L3, 2 threads) that walk streamed Q4_K 1536 x 8960 at 19 GB/s and Q6_K
// at 17, one block with the hardware prefetcher alone at 28-32 and 23 (35 GB/s the read ceiling), the
// 256-bit build alike (14 -> 30, 12 -> 21): software prefetches of four streams filled the core's miss
// buffers and stalled it. Chosen once per process (cpu_qgemm.cpp): AMD one block and no prefetch, others
// the widest walk (super_few) and 16 ahead; $EMBER_QWALK="blocks:ahead" overrides for benchmarks.
constexpr int kWidestWalk = kHalves == 1 ? 4 : 2;  // blocks at once for one row (fewer for two or three)
struct Walk {
  int blocks;     // 1, or kWidestWalk
  int64_t ahead;  // superblocks; 0: the hardware prefetcher alone
};
const Walk& few_walk();

// acc[R][NB][H] += R rows . NB blocks over un superblocks from u0 (unit u of block j at unit0 + u * us +
// j * js). Per superblock: the minimums' integer sums (with offsets their own float step, first), then the
// groups' scaled integer sums, then one float step: acc = fma(sum, d * D, acc).
template <int R, int NB, int F, int GS, bool OFFS, bool BYTES>
void super_tile(const XRow* x, const uint8_t* unit0, const Weights& wt, int64_t js, int64_t us, int64_t u0,
                int64_t un, VF (&acc)[R][NB][kHalves], int64_t ahead = 0) {
  using At = SuperAt<F, GS, OFFS, BYTES>;
  constexpr int H = kHalves;
  for (int64_t u = 0; u < un; ++u) {
    const At at(unit0 + u * us, wt, js);
    const int64_t ug = u0 + u;
    if constexpr (!BYTES)  // the packed streams, `ahead` superblocks ahead (a prefetch never faults)
      for (int j = 0; ahead && j < NB; ++j)
        for (int64_t o = 0; o < us; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(unit0) + (u + ahead) * us + j * js + o),
                       _MM_HINT_T0);
    VI sum[R][NB][H];
    EMBER_TILE for (int r = 0; r < R; ++r)
      EMBER_TILE for (int j = 0; j < NB; ++j)
        EMBER_TILE for (int h = 0; h < H; ++h) sum[r][j][h] = vzero();
    for (int p = 0; p < At::kPairs; ++p) {
      VI bp[R];
      EMBER_TILE for (int r = 0; r < R; ++r) {
        int32_t two;
        std::memcpy(&two, x[r].b + ug * At::kSubs + 2 * p, 4);
        bp[r] = vbcast(two);
      }
      EMBER_TILE for (int j = 0; j < NB; ++j)
        EMBER_TILE for (int h = 0; h < H; ++h) {
          const VI c = at.pair(j, p, h);
          EMBER_TILE for (int r = 0; r < R; ++r) sum[r][j][h] = vdpwssd(sum[r][j][h], c, bp[r]);
        }
    }
    if constexpr (OFFS)
      EMBER_TILE for (int j = 0; j < NB; ++j)
        EMBER_TILE for (int h = 0; h < H; ++h) {
          const VF nd = at.nd(j, h);
          EMBER_TILE for (int r = 0; r < R; ++r) {
            acc[r][j][h] = vfma(vfloat(sum[r][j][h]), vmul(nd, vset(x[r].d[ug])), acc[r][j][h]);
            sum[r][j][h] = vzero();
          }
        }
#pragma GCC unroll 1
    for (int s = 0; s < At::kSubs; ++s) {
      VI is[R][NB][H];
      super_dots<R, NB, F, GS, OFFS, BYTES>(x, at, s, (ug * At::kSubs + s) * GS, is);
      EMBER_TILE for (int j = 0; j < NB; ++j)
        EMBER_TILE for (int h = 0; h < H; ++h) {
          const VI sc = at.scale(j, s, h);
          EMBER_TILE for (int r = 0; r < R; ++r) sum[r][j][h] = vadd(sum[r][j][h], vmullo(is[r][j][h], sc));
        }
    }
    EMBER_TILE for (int j = 0; j < NB; ++j)
      EMBER_TILE for (int h = 0; h < H; ++h) {
        const VF d = at.d(j, h);
        EMBER_TILE for (int r = 0; r < R; ++r)
          acc[r][j][h] = vfma(vfloat(sum[r][j][h]), vmul(d, vset(x[r].d[ug])), acc[r][j][h]);
      }
  }
}

// A packed superblock of one block -> its unpacked copy (SuperAt's BYTES layout) at dst.
template <int F, int GS, bool OFFS>
void unpack_super(const uint8_t* unit, const Weights& wt, uint8_t* dst) {
  using Packed = SuperAt<F, GS, OFFS, false>;
  using Wide = SuperAt<F, GS, OFFS, true>;
  const Packed at(unit, wt, 0);
  std::memcpy(dst, unit, Wide::kHead);
  for (int h = 0; h < kHalves; ++h) {
    for (int p = 0; p < Wide::kPairs; ++p) vstore(dst + Wide::kHead + 64 * p + 4 * kLanes * h, at.pair(0, p, h));
    for (int s = 0; s < Wide::kSubs; ++s)
      vstore(dst + Wide::kHead + Wide::kPairs * 64 + s * Wide::kGroup + 4 * kLanes * h, at.scale(0, s, h));
  }
  for (int s = 0; s < Wide::kSubs; ++s) {
    uint8_t* g = dst + Wide::kHead + Wide::kPairs * 64 + s * Wide::kGroup + kBlock * 4;
    unrolled<GS>([&](auto I) {
      VI v[kHalves];
      unpack<F>(at.steps(0, s), I, v);
      for (int h = 0; h < kHalves; ++h) vstore(g + 64 * I + 4 * kLanes * h, v[h]);
    });
  }
}

// Rows per many-row tile: 4 with 512-bit vectors' 32 registers, 2 with 256-bit ones' 16.
constexpr int kSuperRows = kHalves == 1 ? 4 : 2;

// R rows of the many-row path: their float sums from and back into acc [NB][M, 16].
template <int R, int NB, int F, int GS, bool OFFS, bool BYTES>
void super_rows(const XRow* x, int64_t m, int64_t M, const uint8_t* wide, int64_t js, const Weights& wt, int64_t u,
                float* acc) {
  VF a[R][NB][kHalves];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < kHalves; ++h) a[r][j][h] = vloadf(acc + (j * M + m + r) * kBlock + kLanes * h);
  super_tile<R, NB, F, GS, OFFS, BYTES>(x + m, wide, wt, js, 0, u, 1, a);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < kHalves; ++h) vstoref(acc + (j * M + m + r) * kBlock + kLanes * h, a[r][j][h]);
}

template <int NB, int F, int GS, bool OFFS, bool BYTES>
void super_all(const XRow* x, int64_t M, const uint8_t* wide, int64_t js, const Weights& wt, int64_t u, float* acc) {
  constexpr int T = kSuperRows;
  int64_t m = 0;
  for (; m + T <= M; m += T) super_rows<T, NB, F, GS, OFFS, BYTES>(x, m, M, wide, js, wt, u, acc);
  const int64_t rest = M - m;
  if (T > 3 && rest == 3) super_rows<3, NB, F, GS, OFFS, BYTES>(x, m, M, wide, js, wt, u, acc);
  if (T > 2 && rest == 2) super_rows<2, NB, F, GS, OFFS, BYTES>(x, m, M, wide, js, wt, u, acc);
  if (rest == 1) super_rows<1, NB, F, GS, OFFS, BYTES>(x, m, M, wide, js, wt, u, acc);
}

// 4 or more rows: threads split the blocks, NB at a time; per superblock the NB blocks are unpacked (~5
// KiB each, in L1) and every tile of rows walks them, its float sums parked in acc between superblocks.
template <int NB, int F, int GS, bool OFFS>
void super_many(const XRow* x, int64_t M, const Weights& wt, float* out, int64_t ldo, int64_t n) {
  constexpr int64_t ub = SuperAt<F, GS, OFFS, true>::kBytes;
  at::parallel_for(0, (wt.nblocks + NB - 1) / NB, 1, [&](int64_t t0, int64_t t1) {
    std::unique_ptr<float[]> acc(new float[NB * M * kBlock]);
    alignas(64) uint8_t wide[NB * ub];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t * NB, nb = std::min<int64_t>(NB, wt.nblocks - b);
      std::fill(acc.get(), acc.get() + nb * M * kBlock, 0.0f);
      for (int64_t u = 0; u < wt.groups; ++u) {
        const uint8_t* unit = wt.w + b * wt.bstride() + u * wt.gbytes;
        for (int64_t j = 0; j < nb; ++j) unpack_super<F, GS, OFFS>(unit + j * wt.bstride(), wt, wide + j * ub);
        if (nb == NB)
          super_all<NB, F, GS, OFFS, true>(x, M, wide, ub, wt, u, acc.get());
        else
          super_all<1, F, GS, OFFS, true>(x, M, wide, ub, wt, u, acc.get());
      }
      store_blocks(acc.get(), M, b, nb, out, ldo, n);
    }
  });
}

// 1-3 rows: the packed bits stream once, blocks split among threads, G at a time (few_walk()).
template <int R, int F, int GS, bool OFFS, int G>
void super_few_walk(const XRow* x, const Weights& wt, float* out, int64_t ldo, int64_t n, int64_t ahead) {
  auto blocks = [&]<int NB>(std::integral_constant<int, NB>, int64_t b) {
    VF acc[R][NB][kHalves];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j)
        for (int h = 0; h < kHalves; ++h) acc[r][j][h] = vfzero();
    super_tile<R, NB, F, GS, OFFS, false>(x, wt.w + b * wt.bstride(), wt, wt.bstride(), wt.gbytes, 0, wt.groups, acc,
                                          ahead);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) store_block(acc[r][j], out + r * ldo, (b + j) * kBlock, n);
  };
  at::parallel_for(0, (wt.nblocks + G - 1) / G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g * G;
      if (b + G <= wt.nblocks) {
        blocks(std::integral_constant<int, G>{}, b);
        continue;
      }
      for (int64_t t = b; t < wt.nblocks; ++t) blocks(std::integral_constant<int, 1>{}, t);
    }
  });
}

// The widest walk (several blocks at once: 4 for one row with 512-bit vectors, 2 for two or three; with
// 256-bit ones, whose 16 registers hold fewer sums, 2 for one row, else 1; 8 spilled) or one block.
template <int R, int F, int GS, bool OFFS>
void super_few(const XRow* x, const Weights& wt, float* out, int64_t ldo, int64_t n) {
  constexpr int G = R == 1 ? kWidestWalk : kHalves == 1 ? 2 : 1;
  const Walk& walk = few_walk();
  if (walk.blocks == 1) return super_few_walk<R, F, GS, OFFS, 1>(x, wt, out, ldo, n, walk.ahead);
  super_few_walk<R, F, GS, OFFS, G>(x, wt, out, ldo, n, walk.ahead);
}

// The superblock formats' matmul: M rows of x (quantized by quantize_rows_super) against wt.
template <int F, int GS>
void super_format(const XRow* x, int64_t M, const Weights& wt, float* out, int64_t n) {
  auto run = [&]<bool OFFS>(std::bool_constant<OFFS>) {
    if (M == 1) return super_few<1, F, GS, OFFS>(x, wt, out, n, n);
    if (M == 2) return super_few<2, F, GS, OFFS>(x, wt, out, n, n);
    if (M == 3) return super_few<3, F, GS, OFFS>(x, wt, out, n, n);
    if constexpr (kHalves == 1)
      if (M >= kPairRows) return super_many<2, F, GS, OFFS>(x, M, wt, out, n, n);
    super_many<1, F, GS, OFFS>(x, M, wt, out, n, n);
  };
  if (wt.pr.offsets) return run(std::true_type{});
  run(std::false_type{});
}

}  // namespace qblocks
