// AVX-512 micro-kernels of cpu_gemm.cpp: one 512-bit register holds a packed block's 16 output rows.
//
// Included by cpu_gemm.cpp after its formats and block constants, and used in place of the 256-bit
// micro-kernels where the build targets AVX-512F (-march=native on such a CPU). Every output is the
// same single FMA chain over k in order as in the 256-bit kernels (same widening, same fused
// multiply-adds, same partial sums between passes), so the results are bit-identical to theirs: only
// half as many FMAs (and twice the registers) do the work, which doubles the arithmetic rate of the
// products that are not bound by memory (speculative verification, batched decode, prefill).
#pragma once

#if defined(__AVX512F__)

constexpr int64_t kAhead = 64;  // k steps ahead that tile16 prefetches when it walks few blocks

// One k of a block in format F as 16 floats. kBf16 blocks widen in their stored lane order (rows 0,
// 8, 1, 9, ..., 7, 15: the (low, high) halves of each 32-bit lane); `natural<F>` puts rows in order.
template <int F>
inline __m512 unpack16(const uint8_t* w) {
  if constexpr (F == kF32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(w));
  } else if constexpr (F == kBf16) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  } else {  // as unpack<kFp8>: the 16 bytes as fp16 patterns 2^-8 times their values
    const __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<short>(0xBF80))));
  }
}

// Register lanes in unpack16's order -> rows 0..15 in order (and `stored<F>` the way back).
template <int F>
inline __m512 natural(__m512 v) {
  if constexpr (F != kBf16) return v;
  const __m512i idx = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  return _mm512_permutexvar_ps(idx, v);
}
template <int F>
inline __m512 stored(__m512 v) {
  if constexpr (F != kBf16) return v;
  const __m512i idx = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  return _mm512_permutexvar_ps(idx, v);
}

// micro() of cpu_gemm.cpp with one register per row: acc[r, 0:16] (+)= the R-row panel x (x[k * R + r])
// times block w over kn steps, from zero when `first`.
template <int R, int F>
void micro16(const float* x, const uint8_t* w, int64_t kn, float* acc, bool first) {
  static_assert(R <= kMaxRows, "the panels of cpu_gemm.cpp");
  __m512 c[R];
  for (int r = 0; r < R; ++r) c[r] = first ? _mm512_setzero_ps() : stored<F>(_mm512_loadu_ps(acc + r * kBlock));
#pragma GCC unroll 4
  for (int64_t k = 0; k < kn; ++k) {
    // packed blocks stream from memory: ask for the slice ahead (the next pass's, near the end)
    if (F != kF32 && (k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (k + kAhead) * block_bytes(F)), _MM_HINT_T0);
    const __m512 wv = unpack16<F>(w + k * block_bytes(F));
    for (int r = 0; r < R; ++r) c[r] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[k * R + r]), c[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * kBlock, natural<F>(c[r]));
}

// tile() of cpu_gemm.cpp: R rows of x (row stride ldx) against G consecutive blocks, R * G chains.
template <int R, int G, int F>
void tile16(const float* x, int64_t ldx, const uint8_t* w, int64_t K, float scale, float* out, int64_t ldo,
            int64_t first_col, int64_t n) {
  static_assert(R * G <= 16, "sixteen accumulators at most");
  const int64_t stride = K * block_bytes(F);
  __m512 c[R][G];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < G; ++j) c[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 xb[R];
    for (int r = 0; r < R; ++r) xb[r] = _mm512_set1_ps(x[r * ldx + k]);
    for (int j = 0; j < G; ++j) {
      // with few blocks in flight the hardware prefetchers alone leave bandwidth unused
      if ((k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + j * stride + (k + kAhead) * block_bytes(F)), _MM_HINT_T0);
      const __m512 wv = unpack16<F>(w + j * stride + k * block_bytes(F));
      for (int r = 0; r < R; ++r) c[r][j] = _mm512_fmadd_ps(wv, xb[r], c[r][j]);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  alignas(64) float acc[kBlock];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < G; ++j) {
      _mm512_store_ps(acc, natural<F>(_mm512_mul_ps(c[r][j], s)));
      const int64_t col = first_col + j * kBlock;
      std::copy(acc, acc + std::min<int64_t>(kBlock, n - col), out + r * ldo + col);
    }
  }
}

#endif  // __AVX512F__
