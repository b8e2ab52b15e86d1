// Ember integer-dot matmul of the K-quants' superblocks (Q4_K, Q5_K, Q6_K) on AMX tiles (TDPBSUD /
// TDPBSSD), for many rows, where the build targets AMX-INT8 and the OS grants the tile state. The same
// integers and float steps as super_tile() (cpu_qsuper.h), so every output is bit-identical to the VNNI
// path's: batch invariance holds across the switch between them.
//
// A tile product sums over k with no per-group weighting, but each group (32 k; 16 for Q6_K) has its own
// sub-scale. So the sub-scales are written in base 8, sc = 8 hi + lo (Q4_K / Q5_K: 6-bit, digits 0..7) or
// 64 d2 + 8 d1 + d0 (Q6_K: signed bytes, digits -3..4), and each unpacked weight byte is multiplied by
// each digit into a plane of bytes (q d <= 217 for u4 / u5; (q - 32) d in -128..124 for u6). Then
//   sum_s sc_s dot_s = 8 (x . q hi) + (x . q lo)    (and likewise with three planes)
// over a whole superblock: an accumulator tile per plane, block and superblock instead of an integer step
// per group. A digit's products are one 16-bit multiply per 64 bytes (a 16-bit lane holds two bytes of one
// row; u6's low bytes are masked, the signed product borrowing from its neighbour). Q4_K / Q5_K's minimums
// (sum_s min_s bsum_s) stay on the vector units (vpdpwssd, as super_tile), beside the tile unit.
//
// Tiles: two sets of P accumulators (int32 sums of one block's planes for 16 rows), the rows' int8
// activations (64 k), and weight tiles (a plane's 64 k of 16 rows: 16 steps of 64 bytes, the unpacked
// layout's order); see amx_issue. Activation rows are read 16 at a time, so the caller pads them to a
// multiple of 16 rows. Included by cpu_qgemm.cpp only.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_ops.h"
#include "cpu_qsuper.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define EMBER_QAMX 1
#else
#define EMBER_QAMX 0
#endif

namespace qblocks {

// Rows from which the tile path runs (below, the VNNI tiles: unpacking the planes costs more than the tile
// unit saves). Sapphire Rapids class Xeon, 2 threads, ms per product at 8 / 16 / 32 rows, VNNI -> tiles:
// Q4_K 8960 x 1536 0.47 / 0.71 / 1.29 -> 0.39 / 0.47 / 0.80; Q6_K 1536 x 8960 0.62 / 0.95 / 1.55 -> 0.67 /
// 0.72 / 1.03.
template <int F>
constexpr int64_t amx_rows() {
  return F == kU6 ? 16 : 8;
}

// This build has the tile path and the OS granted it.
inline bool qamx_ready() {
#if EMBER_QAMX
  static const bool ready = amx_claim();
  return ready;
#else
  return false;
#endif
}

#if EMBER_QAMX
// One block's superblock for the tiles: [16 d (, 16 -dmin)][with offsets: 4 x 16 int32 min pairs] then P
// planes of 64 steps (64 bytes each) of weight bytes times a digit of each group's sub-scale.
//   u4 / u5 (Q4_K, Q5_K; offsets; sub-scales 0..63): q hi and q lo, sc = 8 hi + lo, unsigned bytes.
//   u6 (Q6_K; zero 32; sub-scales -128..127): (q - 32) d2, d1, d0 with sc = 64 d2 + 8 d1 + d0, digits in
//   -3..4, so that (q - 32) d (q - 32 in -32..31) is a signed byte; the zero point is inside the planes, so
//   no minimums.
template <int F>
struct AmxUnit {
  static constexpr bool kOffs = F != kU6, kSigned = F == kU6;
  static constexpr int GS = F == kU6 ? 4 : 8, kSubs = 64 / GS, P = F == kU6 ? 3 : 2;
  static constexpr int64_t kPairs = (kOffs ? 2 : 1) * kBlock * 4, kPlanes = kPairs + (kOffs ? 4 * 64 : 0);
  static constexpr int64_t kBytes = kPlanes + P * 64 * 64;

  static void unpack(const uint8_t* unit, const Weights& wt, uint8_t* dst) {
    const SuperAt<F, GS, kOffs, false> at(unit, wt, 0);
    std::memcpy(dst, unit, kPairs);
    if constexpr (kOffs)
      for (int p = 0; p < 4; ++p) vstore(dst + kPairs + 64 * p, at.pair(0, p, 0));
    const VI low = _mm512_set1_epi32(0x00FF00FF), high = _mm512_set1_epi32(static_cast<int32_t>(0xFF00FF00u));
    for (int s = 0; s < kSubs; ++s) {
      VI c[P];
      digits(at.scale(0, s, 0), c);
      unrolled<GS>([&](auto I) {
        VI v[1];
        qblocks::unpack<F>(at.steps(0, s), I, v);
        uint8_t* out = dst + kPlanes + 64 * (GS * s + I);
        if constexpr (kSigned) {  // (q - 32) d per byte: the low bytes' products masked, the high ones' exact
          const VI w = _mm512_sub_epi8(v[0], _mm512_set1_epi8(32));
          const VI lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(w, high);
          for (int p = 0; p < P; ++p)
            vstore(out + 4096 * p, _mm512_or_si512(_mm512_and_si512(_mm512_mullo_epi16(lo, c[p]), low),
                                                   _mm512_mullo_epi16(hi, c[p])));
        } else {  // q d < 256: a 16-bit product carries nothing into the neighbour byte
          for (int p = 0; p < P; ++p) vstore(out + 4096 * p, _mm512_mullo_epi16(v[0], c[p]));
        }
      });
    }
  }

  // A group's sub-scales (16 int32 lanes) -> the digits of each plane, each in both 16-bit halves.
  static void digits(VI sc, VI (&c)[P]) {
    auto twice = [](VI d) { return _mm512_or_si512(_mm512_and_si512(d, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(d, 16)); };
    if constexpr (!kSigned) {
      c[0] = twice(_mm512_srli_epi32(sc, 3));
      c[1] = twice(_mm512_and_si512(sc, _mm512_set1_epi32(7)));
    } else {  // base 8, digits -3..4: d = ((r + 3) & 7) - 3, then r = (r - d) / 8 (exact)
      VI r = sc;
      for (int p = 2; p > 0; --p) {
        const VI d = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r, _mm512_set1_epi32(3)), _mm512_set1_epi32(7)),
                                      _mm512_set1_epi32(3));
        c[p] = twice(d);
        r = _mm512_srai_epi32(_mm512_sub_epi32(r, d), 3);
      }
      c[0] = twice(r);
    }
  }
};

struct alignas(64) QTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_qtiles() {
  QTileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

// The tile instructions with tile numbers from template arguments (GCC's intrinsics take literals only).
// Loads and stores clobber memory, so the unpacked planes are written before a tile reads them.
template <int T>
inline void tile_zero() {
  asm volatile("tilezero %%tmm%c0" ::"i"(T));
}
template <int T>
inline void tile_load(const void* base, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void tile_store(void* base, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
template <int C, int A, int B, bool SIGNED>  // C += A (signed bytes) . B (signed or unsigned bytes)
inline void tile_dp() {
  if constexpr (SIGNED)
    asm volatile("tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  else
    asm volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}

// Tiles: set S (0 or 1) of accumulators is S P .. S P + P - 1 (plane p of one block for 16 rows), 2 P the
// rows' activations, the rest weight tiles in turn (a load into a tile waits for the product reading it).
// Two sets let the tile unit sum the next 16 rows while the vector units finish these (amx_drain).

// Start the products of rows m0 .. m0 + 15 with one unpacked block over superblock u into set S.
template <int F, int S>
inline void amx_issue(const int8_t* q, int64_t Kp, int64_t m0, const uint8_t* unit, int64_t u) {
  using U = AmxUnit<F>;
  constexpr int P = U::P, A = 2 * P, NW = 7 - A;
  unrolled<P>([&](auto p) { tile_zero<S * P + p>(); });
  for (int c = 0; c < 4; ++c) {
    tile_load<A>(q + m0 * Kp + u * 256 + 64 * c, Kp);
    unrolled<P>([&](auto p) {
      constexpr int B = A + 1 + p % NW;
      tile_load<B>(unit + U::kPlanes + p * 4096 + c * 1024, 64);
      tile_dp<S * P + p, A, B, U::kSigned>();
    });
  }
}

// Set S's sums of rows m0 .. m0 + 15 -> per row super_tile's float steps into acc [M, 16] (rows past M
// are padding: computed, not kept).
template <int F, int S>
inline void amx_drain(const XRow* x, int64_t m0, int64_t M, const uint8_t* unit, int64_t u, int32_t (*sums)[256],
                      float* acc) {
  using U = AmxUnit<F>;
  constexpr int P = U::P;
  unrolled<P>([&](auto p) { tile_store<S * P + p>(sums[p], 64); });
  const VF d = vloadf(reinterpret_cast<const float*>(unit));
  VF nd = vfzero();
  VI pairs[4];
  if constexpr (U::kOffs) {
    nd = vloadf(reinterpret_cast<const float*>(unit) + kBlock);
    for (int p = 0; p < 4; ++p) pairs[p] = vload(unit + U::kPairs + 64 * p);
  }
  const int64_t rows = std::min<int64_t>(16, M - m0);
  for (int64_t r = 0; r < rows; ++r) {
    const XRow& xr = x[m0 + r];
    const VF dx = vset(xr.d[u]);
    float* a = acc + (m0 + r) * kBlock;
    VF v = vloadf(a);
    if constexpr (U::kOffs) {  // the minimums' own float step first, as super_tile
      VI mins = vzero();
      for (int p = 0; p < 4; ++p) {
        int32_t two;
        std::memcpy(&two, xr.b + u * 8 + 2 * p, 4);
        mins = vdpwssd(mins, pairs[p], vbcast(two));
      }
      v = vfma(vfloat(mins), vmul(nd, dx), v);
    }
    VI sum = vzero();  // the planes' sums in base 8, most significant first
    for (int p = 0; p < P; ++p) sum = vadd(_mm512_slli_epi32(sum, 3), vload(reinterpret_cast<const uint8_t*>(sums[p] + 16 * r)));
    vstoref(a, vfma(vfloat(sum), vmul(d, dx), v));
  }
}

// Blocks of one thread walked together: for each superblock all of them take their tiles before the next,
// so the rows' activations of a superblock (M x 256 bytes) stay in L2 across the chunk (walking one block
// over all superblocks read every row's whole activations from L3 again for each block: a 512-row Q6_K
// product 8960 wide spent 58% of its time waiting for its activation tiles).
constexpr int64_t kAmxBlocks = 8;

// M rows (q: their int8 activations, padded with zeros to a multiple of 16 rows) against the superblocks
// of wt: threads split the blocks, in chunks of kAmxBlocks; per superblock each block is unpacked once
// (8.4 or 12.1 KiB, in L1) and its 16-row tiles alternate between the two sets of accumulators.
template <int F>
void super_amx(const XRow* x, const int8_t* q, int64_t M, int64_t Kp, const Weights& wt, float* out, int64_t n) {
  const int64_t tiles = (M + 15) / 16;
  at::parallel_for(0, wt.nblocks, kAmxBlocks, [&](int64_t b0, int64_t b1) {
    configure_qtiles();
    std::unique_ptr<float[]> acc(new float[kAmxBlocks * M * kBlock]);
    alignas(64) uint8_t wide[AmxUnit<F>::kBytes];
    alignas(64) int32_t sums[2][3][256];
    for (int64_t b = b0; b < b1; b += kAmxBlocks) {
      const int64_t nb = std::min(kAmxBlocks, b1 - b);
      std::fill(acc.get(), acc.get() + nb * M * kBlock, 0.0f);
      for (int64_t u = 0; u < wt.groups; ++u)
        for (int64_t j = 0; j < nb; ++j) {
          float* a = acc.get() + j * M * kBlock;
          AmxUnit<F>::unpack(wt.w + (b + j) * wt.bstride() + u * wt.gbytes, wt, wide);
          amx_issue<F, 0>(q, Kp, 0, wide, u);
          for (int64_t i = 0; i < tiles; i += 2) {
            if (i + 1 < tiles) amx_issue<F, 1>(q, Kp, 16 * (i + 1), wide, u);
            amx_drain<F, 0>(x, 16 * i, M, wide, u, sums[0], a);
            if (i + 1 >= tiles) break;
            if (i + 2 < tiles) amx_issue<F, 0>(q, Kp, 16 * (i + 2), wide, u);
            amx_drain<F, 1>(x, 16 * (i + 1), M, wide, u, sums[1], a);
          }
        }
      store_blocks(acc.get(), M, b, nb, out, n, n);
    }
    _tile_release();
  });
}
#endif

// The superblock formats' matmul: the tile path for many rows where it runs, else super_format (q: the
// activations of x's rows, padded to a multiple of 16 rows when qamx_pads(M)).
template <int F, int GS>
void super_matmul(const XRow* x, const int8_t* q, int64_t M, int64_t Kp, const Weights& wt, float* out, int64_t n) {
#if EMBER_QAMX
  if constexpr (GS == AmxUnit<F>::GS)
    if (wt.pr.offsets == AmxUnit<F>::kOffs && (AmxUnit<F>::kOffs || wt.pr.zero == 32) && M >= amx_rows<F>() &&
        qamx_ready())
      return super_amx<F>(x, q, M, Kp, wt, out, n);
#endif
  super_format<F, GS>(x, M, wt, out, n);
}

// Whether activations of M rows are read by the tile path's 16-row tiles (so padded to 16 rows).
inline bool qamx_pads(int64_t M) { return EMBER_QAMX && M >= amx_rows<kU4>() && qamx_ready(); }

}  // namespace qblocks
