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

#if !EMBER_QVNNI
// acc += per 32-bit lane, the 4-byte dot product of u (unsigned) and x (signed).
inline __m256i dot4(__m256i acc, __m256i u, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
}
#endif

// Steps whose byte products are summed in int16 before widening to int32 (u4: 8 x 2 x 15 x 127 < 2^15; u5: 4;
// u6: 2).
constexpr int run_of(int F) { return F == kU4 ? 8 : F == kU5 ? 4 : 2; }

// f(std::integral_constant<int, I>{}) for I = 0 .. N - 1, unrolled: every index is a constant.
template <int N, class Fn>
inline __attribute__((always_inline)) void unrolled(Fn&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (f(std::integral_constant<int, I>{}), ...);
  }(std::make_integer_sequence<int, N>{});
}

// Parameters i .. i + kLanes (of 16 scales, then 16 offsets) of a group stored as float32 / float16.
template <bool HALF>
inline VF vparam(const uint8_t* pg, int i) {
  if constexpr (HALF) return vhalf(pg + 2 * i);
  return vloadf(reinterpret_cast<const float*>(pg) + i);
}

// The group of G = 4 GS k that is tile group g of a block whose tile starts at blk (a unit's start): where
// its parameters are, and with kSuper its superblock's head.
template <int PM, int GS>
struct GroupAt {
  const uint8_t* params;
  const uint8_t* head;
  GroupAt(const uint8_t* blk, const Weights& wt, int64_t g) {
    if constexpr (PM == kSuper) {
      constexpr int64_t subs = kSuperSteps / GS;
      head = blk + (g / subs) * wt.gbytes;
      params = head + wt.sbytes() + (g % subs) * wt.gstride();
    } else {
      head = params = blk + g * wt.gbytes;
    }
  }
};

// Lanes h of a group's scales and offsets (pg: its parameters, head: its superblock's; zero: -zero as a
// vector, for formats with a zero point instead of offsets).
template <int PM, bool MINS>
inline void group_params(const uint8_t* pg, const uint8_t* head, const Params& pr, int h, VF zero, VF& scale,
                         VF& off) {
  const int i = kLanes * h;
  if constexpr (PM == kSuper) {
    const float* d = reinterpret_cast<const float*>(head);
    scale = vmul(vloadf(d + i), vsbyte(pg + i));
    if constexpr (MINS) off = pr.offsets ? vmul(vloadf(d + kBlock + i), vsbyte(pg + kBlock + i)) : vmul(scale, zero);
  } else {
    scale = vparam<PM == kF16>(pg, i);
    if constexpr (MINS) off = pr.offsets ? vparam<PM == kF16>(pg, kBlock + i) : vmul(scale, zero);
  }
}

// u5 prefetches each group's bytes this far ahead: with it, a Q5_0 weight that does not fit the caches
// streams ~1.6x faster on a 2-core Zen machine (8 -> 13 GB/s); the i8 and u4 formats' walks of 2-4 blocks
// were as fast or slower with it.
constexpr int64_t kAhead = 1536;

// acc[R][NB][kHalves] += R rows . NB blocks (block j at blk + j * bstride) over gn groups from group g0,
// whose bytes start at blk (block 0's group g0). Per group: exact integer sums, then per output acc =
// fma(sum, scale * d, acc) and, with minimums, acc = fma(offset, d * sum(q), acc): the float operations and
// order of the many-row path (batch invariance). Also the many-row path's i8 tile. Signed i8 weights meet
// the signed activations by the sign trick (|w| . sign(x, w)) in 256-bit vectors; AVX-512 has no byte
// sign, so there x + 128 (unsigned) . w is taken, less 128 * sum(w), once per block for all R rows.
template <int R, int NB, int F, int GS, int PM, bool MINS, bool BYTES = false>
void few_tile(const XRow* x, const uint8_t* blk, const Weights& wt, int64_t g0, int64_t gn,
              VF (&acc)[R][NB][kHalves]) {
  constexpr int H = kHalves, RUN = F == kI8 || kVnni ? 1 : run_of(F);
  constexpr bool BIAS = F == kI8 && H == 1;  // the + 128 form
  const int64_t bs = wt.bstride(), pb = wt.pbytes();
  const VF zero = vset(static_cast<float>(-wt.pr.zero));
  for (int64_t g = 0; g < gn; ++g) {
    const GroupAt<PM, GS> at(blk, wt, g);
    const uint8_t* pg = at.params;
    const uint8_t* gw = pg + pb;
    const int64_t t = (g0 + g) * GS, xg = t / (kXGroup / 4);
    if constexpr (F == kU5 && !BYTES)  // u5 is slow enough per byte that the next groups must be asked for early
      for (int64_t o = 0; o < wt.gstride(); o += 64) _mm_prefetch(reinterpret_cast<const char*>(pg + o) + kAhead, _MM_HINT_T0);
    VI is[R][NB][H], bias[NB][H];
#if !EMBER_QVNNI
    VI ps[R][NB][H];
#endif
    unrolled<GS>([&](auto I) {
      constexpr int i = I;
      VI xb[R];
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, BIAS ? static_cast<const void*>(x[r].u + 4 * (t + i)) : x[r].q + 4 * (t + i), 4);
        xb[r] = vbcast(four);
      }
      for (int j = 0; j < NB; ++j) {
        VI w[H];
        unpack<F, BYTES>(gw + j * bs, i, w);
        for (int h = 0; h < H; ++h) {
#if EMBER_QVNNI && defined(__AVX512BW__)
          if constexpr (BIAS) bias[j][h] = vdpbusd(i == 0 ? vzero() : bias[j][h], vbcast(0x80808080), w[h]);
          for (int r = 0; r < R; ++r) {
            const VI prev = i == 0 ? vzero() : is[r][j][h];
            is[r][j][h] = BIAS ? vdpbusd(prev, xb[r], w[h]) : vdpbusd(prev, w[h], xb[r]);
          }
#elif EMBER_QVNNI
          for (int r = 0; r < R; ++r) {
            const VI prev = i == 0 ? vzero() : is[r][j][h];
            if constexpr (F == kI8)
              is[r][j][h] = vdpbusd(prev, _mm256_sign_epi8(w[h], w[h]), _mm256_sign_epi8(xb[r], w[h]));
            else
              is[r][j][h] = vdpbusd(prev, w[h], xb[r]);
          }
#else
          for (int r = 0; r < R; ++r) {
            if constexpr (F == kI8) {
              const VI prev = i == 0 ? vzero() : is[r][j][h];
              is[r][j][h] = dot4(prev, _mm256_sign_epi8(w[h], w[h]), _mm256_sign_epi8(xb[r], w[h]));
            } else {
              const __m256i p = _mm256_maddubs_epi16(w[h], xb[r]);
              ps[r][j][h] = i % RUN == 0 ? p : _mm256_add_epi16(ps[r][j][h], p);
            }
          }
#endif
        }
      }
#if !EMBER_QVNNI
      if constexpr (F != kI8 && (i + 1) % RUN == 0) {
        const __m256i ones = _mm256_set1_epi16(1);
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < NB; ++j)
            for (int h = 0; h < H; ++h) {
              const __m256i w = _mm256_madd_epi16(ps[r][j][h], ones);
              is[r][j][h] = i + 1 == RUN ? w : _mm256_add_epi32(is[r][j][h], w);
            }
      }
#endif
    });
    for (int j = 0; j < NB; ++j) {
      for (int h = 0; h < H; ++h) {
        VF scale, off = vfzero();
        group_params<PM, MINS>(pg + j * bs, at.head + j * bs, wt.pr, h, zero, scale, off);
        for (int r = 0; r < R; ++r) {
          const VF f = vfloat(BIAS ? vsub(is[r][j][h], bias[j][h]) : is[r][j][h]);
          acc[r][j][h] = vfma(f, vmul(scale, vset(x[r].d[xg])), acc[r][j][h]);
          if constexpr (MINS) acc[r][j][h] = vfma(off, vset(x[r].template sum<GS>(g0 + g)), acc[r][j][h]);
        }
      }
    }
  }
}

// Block results (16 floats: rows 0..15) -> out[col .. col + 16) (fewer at the edge).
inline void store_block(const VF (&v)[kHalves], float* out, int64_t col, int64_t n) {
  if (n - col >= kBlock) {  // a whole block: no call to memmove per 16 floats
    for (int h = 0; h < kHalves; ++h) vstoref(out + col + kLanes * h, v[h]);
    return;
  }
  alignas(64) float t[kBlock];
  for (int h = 0; h < kHalves; ++h) vstoref(t + kLanes * h, v[h]);
  std::copy(t, t + std::min<int64_t>(kBlock, n - col), out + col);
}

// The many-row paths' float sums acc [nb][M, 16] of blocks b .. b + nb -> out.
inline void store_blocks(const float* acc, int64_t M, int64_t b, int64_t nb, float* out, int64_t ldo, int64_t n) {
  for (int64_t j = 0; j < nb; ++j)
    for (int64_t m = 0; m < M; ++m) {
      VF v[kHalves];
      for (int h = 0; h < kHalves; ++h) v[h] = vloadf(acc + (j * M + m) * kBlock + kLanes * h);
      store_block(v, out + m * ldo, (b + j) * kBlock, n);
    }
}

// R rows against NB blocks from block b, over all groups, into out.
template <int R, int NB, int F, int GS, int PM, bool MINS>
void few_blocks(const XRow* x, const Weights& wt, int64_t b, float* out, int64_t ldo, int64_t n) {
  VF acc[R][NB][kHalves];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < kHalves; ++h) acc[r][j][h] = vfzero();
  few_tile<R, NB, F, GS, PM, MINS>(x, wt.w + b * wt.bstride(), wt, 0, wt.kgroups(), acc);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) store_block(acc[r][j], out + r * ldo, (b + j) * kBlock, n);
}

// Blocks walked at once (256-bit vectors: their sums fit the 16 registers).
template <int R, int F>
constexpr int few_group() {
  if constexpr (kHalves == 1) return 1;  // a 2-core Zen 5: walks of 2 or 4 blocks streamed 10-50% slower
  if constexpr (F == kU5) return 1;
  return R == 1 ? 4 : R == 2 ? 2 : 1;
}

template <int R, int F, int GS, int PM, bool MINS>
void few_rows_p(const XRow* x, const Weights& wt, float* out, int64_t ldo, int64_t n) {
  constexpr int G = few_group<R, F>();
  const int64_t groups = (wt.nblocks + G - 1) / G;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g * G;
      if (b + G <= wt.nblocks) {
        few_blocks<R, G, F, GS, PM, MINS>(x, wt, b, out, ldo, n);
        continue;
      }
      for (int64_t t = b; t < wt.nblocks; ++t) few_blocks<R, 1, F, GS, PM, MINS>(x, wt, t, out, ldo, n);
    }
  });
}

// f(std::integral_constant<int, PM>, std::bool_constant<MINS>) for the weight's parameters.
template <class Fn>
inline void with_params(const Params& pr, Fn&& f) {
  auto mins = [&](auto pm) {
    if (pr.mins()) return f(pm, std::true_type{});
    f(pm, std::false_type{});
  };
  if (pr.mode == kSuper) return mins(std::integral_constant<int, kSuper>{});
  if (pr.mode == kF16) return mins(std::integral_constant<int, kF16>{});
  mins(std::integral_constant<int, kF32>{});
}

// R (1..3) rows: the packed bits stream once, threads split the blocks.
template <int R, int F, int GS>
void few_rows(const XRow* x, const Weights& wt, float* out, int64_t ldo, int64_t n) {
  with_params(wt.pr, [&](auto pm, auto mins) { few_rows_p<R, F, GS, pm(), mins()>(x, wt, out, ldo, n); });
}

}  // namespace qblocks
