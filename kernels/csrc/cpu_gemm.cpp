// Ember CPU fast path: y[M, N] = x[M, K] @ W[N, K]^T with W in bf16, packed for AVX2 + FMA.
//
// Built on first use by kernels/native.py through torch.utils.cpp_extension (only light ATen
// headers) and registered as torch.ops.ember.gemm_bf16; threads come from torch's own OpenMP
// pool (at::parallel_for). Packed layout (see pack_bf16 in cpu_gemm.py): W is cut into
// blocks of 16 output rows; block b stores, for every k, 8 32-bit lanes where lane i holds
// W[16b + i, k] in its low half and W[16b + 8 + i, k] in its high half. One 256-bit load then gives
// both halves as fp32 with one shift and one mask. Accumulation is fp32; activations are read as fp32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int kBlock = 16;   // output rows per packed block
constexpr int kMaxRows = 6;  // rows of x per micro-kernel call
constexpr int64_t kRowChunk = 96;  // rows of x kept hot (L2) while a thread walks its weight blocks

// 8 packed lanes -> rows i (low halves) and i + 8 (high halves) of a block as float32.
inline void unpack8(const uint32_t* w, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
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
// w is the packed bf16 block, or (F32) the block already widened to float32 [K, 16] in the same
// lane order, which spares the two conversion ops per k when many rows reuse the block.
template <int R, bool F32>
void micro(const float* x, int64_t ldx, const void* w, int64_t K, float* out, int64_t ldo,
           int nvalid) {
  static_assert(R <= kMaxRows, "twelve accumulators at most");
  const uint32_t* wb = static_cast<const uint32_t*>(w);
  const float* wf = static_cast<const float*>(w);
  __m256 c0a = _mm256_setzero_ps(), c0b = c0a, c1a = c0a, c1b = c0a, c2a = c0a, c2b = c0a;
  __m256 c3a = c0a, c3b = c0a, c4a = c0a, c4b = c0a, c5a = c0a, c5b = c0a;
  for (int64_t k = 0; k < K; ++k) {
    __m256 lo, hi;
    if constexpr (F32) {
      lo = _mm256_loadu_ps(wf + k * kBlock);
      hi = _mm256_loadu_ps(wf + k * kBlock + 8);
    } else {
      unpack8(wb + k * 8, lo, hi);
    }
    EMBER_FMA(0) EMBER_FMA(1) EMBER_FMA(2) EMBER_FMA(3) EMBER_FMA(4) EMBER_FMA(5)
  }
  alignas(32) float acc[kMaxRows][kBlock];
  const __m256 all[kMaxRows][2] = {{c0a, c0b}, {c1a, c1b}, {c2a, c2b}, {c3a, c3b}, {c4a, c4b}, {c5a, c5b}};
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(acc[r], all[r][0]);
    _mm256_store_ps(acc[r] + 8, all[r][1]);
    std::copy(acc[r], acc[r] + nvalid, out + r * ldo);
  }
}
#undef EMBER_FMA

template <bool F32>
void rows(int R, const float* x, int64_t ldx, const void* w, int64_t K, float* out, int64_t ldo, int nvalid) {
  switch (R) {
    case 1: return micro<1, F32>(x, ldx, w, K, out, ldo, nvalid);
    case 2: return micro<2, F32>(x, ldx, w, K, out, ldo, nvalid);
    case 3: return micro<3, F32>(x, ldx, w, K, out, ldo, nvalid);
    case 4: return micro<4, F32>(x, ldx, w, K, out, ldo, nvalid);
    case 5: return micro<5, F32>(x, ldx, w, K, out, ldo, nvalid);
    default: return micro<6, F32>(x, ldx, w, K, out, ldo, nvalid);
  }
}

// The packed block (K x 8 lanes of bf16 pairs) widened to float32 [K, 16], same lane order.
void widen_block(const uint32_t* w, int64_t K, float* dst) {
  for (int64_t k = 0; k < K; ++k) {
    __m256 lo, hi;
    unpack8(w + k * 8, lo, hi);
    _mm256_storeu_ps(dst + k * kBlock, lo);
    _mm256_storeu_ps(dst + k * kBlock + 8, hi);
  }
}

}  // namespace

// x [M, K] (fp32 or bf16, rows contiguous), packed [NB, K, 16] bf16, n = true output count.
at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kBlock, "gemm_bf16: bad shapes");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "gemm_bf16: CPU tensors only");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(), "gemm_bf16: packed must be contiguous bf16");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && n <= NB * kBlock && n > (NB - 1) * kBlock, "gemm_bf16: weight/input mismatch");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, n}, xf.options());
  const float* xp = xf.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const uint32_t* wp = static_cast<const uint32_t*>(packed.const_data_ptr());
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t mc = std::min(kRowChunk, M - m0);
    const bool widen = mc >= 2 * kMaxRows;  // the block serves several row tiles: widen it once
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> wide(widen ? K * kBlock : 0);
      for (int64_t b = b0; b < b1; ++b) {
        const int nvalid = static_cast<int>(std::min<int64_t>(kBlock, n - b * kBlock));
        const uint32_t* wb = wp + b * K * 8;
        if (widen) widen_block(wb, K, wide.data());
        for (int64_t r = 0; r < mc; r += kMaxRows) {
          const int R = static_cast<int>(std::min<int64_t>(kMaxRows, mc - r));
          float* o = op + (m0 + r) * n + b * kBlock;
          if (widen)
            rows<true>(R, xp + (m0 + r) * K, K, wide.data(), K, o, n, nvalid);
          else
            rows<false>(R, xp + (m0 + r) * K, K, wb, K, o, n, nvalid);
        }
      }
    });
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

TORCH_LIBRARY(ember, m) {
  m.def("gemm_bf16(Tensor x, Tensor packed, int n) -> Tensor", gemm_bf16);
}
