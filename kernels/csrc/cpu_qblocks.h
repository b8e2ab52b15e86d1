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
enum QFmt { kI8 = 0, kU4 = 1, kU5 = 2 };
constexpr int64_t step_bytes(int F) { return F == kU4 ? 32 : F == kU5 ? 40 : 64; }

// One quantized activation row: q [Kp] int8, per 32 k its scale d and d * sum(q).
struct XRow {
  const int8_t* q;
  const float* d;
  const float* s;
};

// How a group's integers become weights.
struct Params {
  int zero;      // w = (q - zero) * scale (when there are no offsets)
  bool offsets;  // w = q * scale + offset
  bool half;     // parameters stored as float16 (GGUF's own scales and mins, exactly)
  bool mins() const { return offsets || zero != 0; }
};

// A packed weight: blocks of 16 rows, each `groups` groups of G k stored as [16 scales (, 16 offsets)]
// [the group's steps], so that a block is one sequential stream.
struct Weights {
  const uint8_t* w;
  int64_t nblocks, groups, gbytes;
  Params pr;
  int64_t pbytes() const { return (pr.offsets ? 2 : 1) * kBlock * (pr.half ? 2 : 4); }
  int64_t bstride() const { return groups * gbytes; }
};

// x rows (T = float, bf16 or half) -> int8 per 32 k, zero past K up to Kp.
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int64_t Kp, int8_t* q, float* d, float* s) {
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
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float dd = _mm_cvtss_f32(h) / 127.0f;
        const __m256 id = _mm256_set1_ps(dd != 0.0f ? 1.0f / dd : 0.0f);
        __m256i iv[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i) {
          iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));  // round to nearest even
          sum = _mm256_add_epi32(sum, iv[i]);
        }
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
        const __m256i ordered = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + m * Kp + k0), ordered);
        alignas(32) int32_t t[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(t), sum);
        int32_t total = 0;
        for (int i = 0; i < 8; ++i) total += t[i];
        d[m * (Kp / kXGroup) + g] = dd;
        s[m * (Kp / kXGroup) + g] = dd * static_cast<float>(total);
      }
    }
  });
}

// The fifth bits of step i (0..7) of a plane, as 0x10 per byte: bit i of each byte moved to bit 4 by one
// 16-bit shift (the neighbour byte's bits that cross over are masked off).
inline __m256i fifth_bits(__m256i plane, int i) {
  const __m256i moved = i <= 4 ? _mm256_slli_epi16(plane, 4 - i) : _mm256_srli_epi16(plane, i - 4);
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}

// Step i of a group of 8 (or 4) steps starting at g -> rows 0..7 (a) and 8..15 (b), each 32-bit lane one
// row's 4 k. i is a constant once the group's loop unrolls, so every address is g plus an immediate.
template <int F>
inline void unpack(const uint8_t* g, int i, __m256i& a, __m256i& b) {
  const uint8_t* w = g + i * (F == kU5 ? 32 : step_bytes(F));
  if constexpr (F == kI8) {
    a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i nib = _mm256_set1_epi8(0x0F);
    a = _mm256_and_si256(v, nib);
    b = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    if constexpr (F == kU5) {
      a = _mm256_or_si256(a, fifth_bits(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 256)), i));
      b = _mm256_or_si256(b, fifth_bits(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 288)), i));
    }
  }
}

}  // namespace qblocks
