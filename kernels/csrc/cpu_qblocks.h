// Ember integer-dot matmul, its data: packed weight blocks and int8 activation rows (csrc/cpu_qgemm.cpp).
//
// The layouts (kernels/qgemm.py writes them), the parameters that make a group's integers weights, the
// quantization of activation rows per 32 k, and the unpacking of a step of u4 / u5 bits to bytes.
// Included by cpu_qgemm.cpp only.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>

namespace qblocks {


constexpr int kBlock = 16;          // output rows per block
constexpr int64_t kXGroup = 32;     // k per activation scale
constexpr int64_t kChunkSteps = 64;  // steps (256 k) of a block unpacked at once for many rows: 4 KiB, in L1
constexpr int64_t kSuperSteps = 64;  // steps (256 k) of a superblock (kSuper parameters)
// Rows from which many-row tiles walk two blocks at once with 512-bit vectors, so that each activation
// broadcast feeds two (on a Zen 5, 32 and 512 rows 7-28% faster; 7 rows 5-25% slower, so one below).
constexpr int64_t kPairRows = 16;
enum QFmt { kI8 = 0, kU4 = 1, kU5 = 2, kU6 = 3 };
constexpr int64_t step_bytes(int F) { return F == kU4 ? 32 : F == kU5 ? 40 : F == kU6 ? 48 : 64; }
// Where a group's planes of high bits start, after its steps' nibbles (u5: 8 steps, u6: 4).
constexpr int64_t plane_at(int F) { return F == kU5 ? 256 : 128; }

// The vector a step's products land in: with AVX-512 (BW + VNNI) one 512-bit vector holds a block's 16
// rows; otherwise two 256-bit vectors hold rows 0..7 and 8..15 (kHalves). The V* helpers are the few
// operations the kernels need, in the build's width.
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int kHalves = 1;
using VI = __m512i;
using VF = __m512;
inline VI vbcast(int32_t v) { return _mm512_set1_epi32(v); }
inline VI vzero() { return _mm512_setzero_si512(); }
inline VI vsub(VI a, VI b) { return _mm512_sub_epi32(a, b); }
inline VI vxor(VI a, VI b) { return _mm512_xor_si512(a, b); }
inline VI vload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline void vstore(uint8_t* p, VI v) { _mm512_storeu_si512(p, v); }
inline VI vdpbusd(VI acc, VI u, VI s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline VF vfloat(VI v) { return _mm512_cvtepi32_ps(v); }
inline VF vset(float v) { return _mm512_set1_ps(v); }
inline VF vfzero() { return _mm512_setzero_ps(); }
inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF vloadf(const float* p) { return _mm512_loadu_ps(p); }
inline void vstoref(float* p, VF v) { _mm512_storeu_ps(p, v); }
inline VF vhalf(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline VF vsbyte(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
#else
constexpr int kHalves = 2;
using VI = __m256i;
using VF = __m256;
inline VI vbcast(int32_t v) { return _mm256_set1_epi32(v); }
inline VI vzero() { return _mm256_setzero_si256(); }
inline VI vsub(VI a, VI b) { return _mm256_sub_epi32(a, b); }
inline VI vxor(VI a, VI b) { return _mm256_xor_si256(a, b); }
inline VI vload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void vstore(uint8_t* p, VI v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))  // see EMBER_QVNNI
inline VI vdpbusd(VI acc, VI u, VI s) { return _mm256_dpbusd_epi32(acc, u, s); }
#endif
inline VF vfloat(VI v) { return _mm256_cvtepi32_ps(v); }
inline VF vset(float v) { return _mm256_set1_ps(v); }
inline VF vfzero() { return _mm256_setzero_ps(); }
inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF vloadf(const float* p) { return _mm256_loadu_ps(p); }
inline void vstoref(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline VF vhalf(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VF vsbyte(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
#endif
constexpr int kLanes = kBlock / kHalves;  // rows per vector

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define EMBER_QVNNI 1
#else
#define EMBER_QVNNI 0
#endif
constexpr bool kVnni = EMBER_QVNNI;

// One quantized activation row: q [Kp] int8, per 32 k its scale d and d * sum(q), per 16 k d * sum(q) (h,
// for the minimums of groups of 16); u: q + 128 as bytes (q ^ 0x80, for the 512-bit i8 kernels; null
// elsewhere). For the superblock formats (cpu_qsuper.h) instead: q and d per 256 k, and b the integer
// sums of q per weight group.
struct XRow {
  const int8_t* q;
  const float* d;
  const float* s;
  const float* h;
  const uint8_t* u;
  const int16_t* b;
  // d * sum(q) over group g of G = 4 GS k
  template <int GS>
  float sum(int64_t g) const {
    if constexpr (GS == 4) return h[g];
    return s[g];
  }
};

// Where a group's parameters are: float32 or float16 values before its steps, or (kSuper, the K-quants'
// own form) signed bytes there, which a float32 per row and superblock of 256 k multiplies (its d, and for
// minimums its -dmin): scale = d * sub-scale, offset = -dmin * sub-min, exact in float32.
enum PMode { kF32 = 0, kF16 = 1, kSuper = 2 };

// How a group's integers become weights.
struct Params {
  int zero;      // w = (q - zero) * scale (when there are no offsets)
  bool offsets;  // w = q * scale + offset
  int mode;      // PMode
  bool mins() const { return offsets || zero != 0; }
};

// A packed weight: blocks of 16 rows, each `groups` units along k, so that a block is one sequential
// stream. A unit is a group of G k, [16 scales (, 16 offsets)][its steps]; with kSuper a superblock of
// 256 k, [16 d][16 -dmin (with offsets)] then its groups, [16 sub-scales (, 16 sub-mins)][steps] each.
struct Weights {
  const uint8_t* w;
  int64_t nblocks, groups, gbytes;  // units per block, bytes per unit
  Params pr;
  int64_t subs = 1;  // groups of G k per unit
  int64_t pbytes() const { return (pr.offsets ? 2 : 1) * kBlock * (pr.mode == kF32 ? 4 : pr.mode == kF16 ? 2 : 1); }
  int64_t sbytes() const { return pr.mode == kSuper ? (pr.offsets ? 2 : 1) * kBlock * 4 : 0; }  // superblock head
  int64_t bstride() const { return groups * gbytes; }
  int64_t kgroups() const { return groups * subs; }
  int64_t gstride() const { return (gbytes - sbytes()) / subs; }  // one group's bytes
};

// x rows (T = float, bf16 or half) -> int8 per 32 k, zero past K up to Kp.
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int64_t Kp, int8_t* q, float* d, float* s, float* h) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    alignas(32) float buf[kXGroup];
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t g = 0; g < Kp / kXGroup; ++g) {
        const int64_t k0 = g * kXGroup, kn = std::min<int64_t>(kXGroup, K - k0);
        if (kn == kXGroup) {
          load_row(x + m * K + k0, buf, kXGroup);
        } else {
          std::fill(buf, buf + kXGroup, 0.0f);
          load_row(x + m * K + k0, buf, kn);
        }
        __m256 v[4], amax = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int i = 0; i < 4; ++i) {
          v[i] = _mm256_load_ps(buf + 8 * i);
          amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 mx = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        mx = _mm_max_ps(mx, _mm_movehl_ps(mx, mx));
        mx = _mm_max_ss(mx, _mm_shuffle_ps(mx, mx, 1));
        const float dd = _mm_cvtss_f32(mx) / 127.0f;
        const __m256 id = _mm256_set1_ps(dd != 0.0f ? 1.0f / dd : 0.0f);
        __m256i iv[4];
        for (int i = 0; i < 4; ++i) iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));  // round to nearest even
        const __m256i lo = _mm256_add_epi32(iv[0], iv[1]), hi = _mm256_add_epi32(iv[2], iv[3]);
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
        const __m256i ordered = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + m * Kp + k0), ordered);
        alignas(32) int32_t t[16];
        _mm256_store_si256(reinterpret_cast<__m256i*>(t), lo);
        _mm256_store_si256(reinterpret_cast<__m256i*>(t + 8), hi);
        int32_t half[2] = {0, 0};
        for (int i = 0; i < 16; ++i) half[i / 8] += t[i];
        const int64_t at = m * (Kp / kXGroup) + g;
        d[at] = dd;
        s[at] = dd * static_cast<float>(half[0] + half[1]);
        h[2 * at] = dd * static_cast<float>(half[0]);
        h[2 * at + 1] = dd * static_cast<float>(half[1]);
      }
    }
  });
}

// The fifth bits of step i (0..7) of a plane, as 0x10 per byte: bit i of each byte moved to bit 4 by one
// 16-bit shift (the neighbour byte's bits that cross over are masked off).
inline VI fifth_bits(VI plane, int i) {
#if defined(__AVX512BW__)
  const VI moved = i <= 4 ? _mm512_slli_epi16(plane, 4 - i) : _mm512_srli_epi16(plane, i - 4);
  return _mm512_and_si512(moved, _mm512_set1_epi8(0x10));
#else
  const VI moved = i <= 4 ? _mm256_slli_epi16(plane, 4 - i) : _mm256_srli_epi16(plane, i - 4);
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
#endif
}

// The sixth and fifth bits of step i (0..3) of a u6 plane, as bits 4 and 5 of each byte (bits 2 i, 2 i + 1
// moved by one 16-bit shift, the neighbour byte's bits masked off).
inline VI high_bits(VI plane, int i) {
#if defined(__AVX512BW__)
  const VI moved = i <= 2 ? _mm512_slli_epi16(plane, 4 - 2 * i) : _mm512_srli_epi16(plane, 2 * i - 4);
  return _mm512_and_si512(moved, _mm512_set1_epi8(0x30));
#else
  const VI moved = i <= 2 ? _mm256_slli_epi16(plane, 4 - 2 * i) : _mm256_srli_epi16(plane, 2 * i - 4);
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x30));
#endif
}

// Step i of a group of 8 (or 4) steps starting at g -> the block's 16 rows (v[0]: rows 0..7, v[1]: 8..15
// with 256-bit vectors), each 32-bit lane one row's 4 k. i is a constant once the group's loop unrolls,
// so every address is g plus an immediate. BYTES: u4 / u5 steps already unpacked, 64 bytes each.
template <int F, bool BYTES = false>
inline void unpack(const uint8_t* g, int i, VI (&v)[kHalves]) {
  const uint8_t* w = g + i * (BYTES ? 64 : F == kU5 || F == kU6 ? 32 : step_bytes(F));
#if defined(__AVX512BW__)
  if constexpr (F == kI8 || BYTES) {
    v[0] = vload(w);
  } else {  // both halves get the step's 32 bytes; the upper one takes their high nibbles
    const VI both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
    const VI shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    v[0] = _mm512_and_si512(_mm512_srlv_epi16(both, shift), _mm512_set1_epi8(0x0F));
    if constexpr (F == kU5) v[0] = _mm512_or_si512(v[0], fifth_bits(vload(g + 256), i));
    if constexpr (F == kU6) v[0] = _mm512_or_si512(v[0], high_bits(vload(g + 128), i));
  }
#else
  if constexpr (F == kI8 || BYTES) {
    v[0] = vload(w);
    v[1] = vload(w + 32);
  } else {
    const __m256i b = vload(w), nib = _mm256_set1_epi8(0x0F);
    v[0] = _mm256_and_si256(b, nib);
    v[1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
    if constexpr (F == kU5) {
      v[0] = _mm256_or_si256(v[0], fifth_bits(vload(g + 256), i));
      v[1] = _mm256_or_si256(v[1], fifth_bits(vload(g + 288), i));
    }
    if constexpr (F == kU6) {
      v[0] = _mm256_or_si256(v[0], high_bits(vload(g + 128), i));
      v[1] = _mm256_or_si256(v[1], high_bits(vload(g + 160), i));
    }
  }
#endif
}

}  // namespace qblocks
