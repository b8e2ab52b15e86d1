// Ember CPU fast path on AMX (Intel's tile matrix unit): y[M, N] = x[M, K] @ W[N, K]^T, W in bf16.
//
// Built into the same library as cpu_gemm.cpp; used in place of its bf16 kernels where the build targets
// AMX-BF16 (e.g. -march=native on a Sapphire Rapids Xeon) and the kernel grants this process the tile
// state (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+): `amx_ready`. The FMA kernels are bound by the
// core's FMA rate past a few rows (a 17920x1536 product took 2.5 ms at 8 rows, 9.3 ms at 32); one
// TDPBF16PS does 16x16x32 multiply-adds, so batched decode, speculative verification and prefill
// stay near the weights' streaming time.
//
// Layout ([NB, Kp, 16] bf16, Kp = K rounded up to 32, zero-padded): block b holds output rows
// 16b..16b+15 as AMX "B" tiles, one per 32 k: element (k, j) of the block sits at (k / 2) * 32 + 2j +
// k % 2, i.e. each 64-byte tile row holds a pair of k for the 16 rows. Activations are copied into
// 16-row, Kp-wide bf16 tiles (zero-padded); float32 / float16 activations as three bf16 terms (hi, mid,
// lo: float32's 24 significant bits), each multiplied and accumulated in turn. Every output is one
// float32 accumulation over the k chunks in order, whatever M and however the threads split the
// blocks: rows alone equal rows in any batch (batch invariance), as for the FMA kernels.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_ops.h"
#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define EMBER_AMX 1
#endif

namespace {

constexpr int64_t kBlock = 16;  // output rows per block (a tile's 16 float32 columns)
constexpr int64_t kChunk = 32;  // k per tile (64 bytes of bf16)
constexpr int64_t kTileRows = 16;
constexpr int kGroup = 4;  // blocks per A tile: 4 accumulator tiles, one A, one B of the 8 tiles
// rows whose activation tiles stay in L2 while a thread walks its weight groups (a 512-row lm_head
// product: 496 ms walking all rows per group, 191 ms in chunks of 256)
constexpr int64_t kRowChunk = 256;

int64_t round_k(int64_t K) { return (K + kChunk - 1) / kChunk * kChunk; }

uint16_t bf16_bits(float v) { return c10::BFloat16(v).x; }  // round to nearest even

float bf16_value(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Row of activations -> `terms` bf16 rows (hi, mid, lo; one term for bf16 input), Kp wide.
template <typename T>
void split_row(const T* x, int64_t K, int terms, int64_t term_stride, uint16_t* dst) {
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      dst[k] = x[k].x;
    } else {
      float v = static_cast<float>(x[k]);
      for (int t = 0; t < terms; ++t) {
        const uint16_t b = bf16_bits(v);
        dst[t * term_stride + k] = b;
        if (!std::isfinite(v)) break;  // inf / NaN in the first term only
        v -= bf16_value(b);
      }
    }
  }
}

#ifdef EMBER_AMX
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: float32 accumulators (16 x 16); 4: activations (16 rows x 32 k); 5: one weight block's k chunk.
void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 6; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = kTileRows;
  }
  _tile_loadconfig(&c);
}

#define EMBER_DP(j)                                                             \
  if constexpr (G > (j)) {                                                      \
    _tile_loadd(5, w + (j) * Kp * kBlock + k0 * kBlock, 64);                    \
    if constexpr (T == 1) {                                                     \
      _tile_dpbf16ps(j, 4, 5);                                                  \
    } else {                                                                    \
      for (int t = 0; t < T; ++t) {                                             \
        _tile_loadd(4, a + t * term_stride + k0, Kp * 2);                       \
        _tile_dpbf16ps(j, 4, 5);                                                \
      }                                                                         \
    }                                                                           \
  }
#define EMBER_ZERO(j) \
  if constexpr (G > (j)) _tile_zero(j);
#define EMBER_STORE(j) \
  if constexpr (G > (j)) _tile_stored(j, c + (j) * kBlock, kGroup * kBlock * 4);

// c[16, G * 16] = a (16 rows, T terms) @ G blocks of w, over Kp.
template <int G, int T>
void group_tile(const uint16_t* a, int64_t term_stride, const uint16_t* w, int64_t Kp, float* c) {
  EMBER_ZERO(0) EMBER_ZERO(1) EMBER_ZERO(2) EMBER_ZERO(3)
  for (int64_t k0 = 0; k0 < Kp; k0 += kChunk) {
    if constexpr (T == 1) _tile_loadd(4, a + k0, Kp * 2);
    EMBER_DP(0) EMBER_DP(1) EMBER_DP(2) EMBER_DP(3)
  }
  EMBER_STORE(0) EMBER_STORE(1) EMBER_STORE(2) EMBER_STORE(3)
}
#undef EMBER_DP
#undef EMBER_ZERO
#undef EMBER_STORE

template <int T>
void run_group(int G, const uint16_t* a, int64_t term_stride, const uint16_t* w, int64_t Kp, float* c) {
  switch (G) {
    case 1: return group_tile<1, T>(a, term_stride, w, Kp, c);
    case 2: return group_tile<2, T>(a, term_stride, w, Kp, c);
    case 3: return group_tile<3, T>(a, term_stride, w, Kp, c);
    default: return group_tile<4, T>(a, term_stride, w, Kp, c);
  }
}

// out[M, n] (dtype O) from the padded activation tiles; threads split groups of kGroup blocks.
template <typename O>
void amx_matmul(const uint16_t* a, int terms, int64_t M, int64_t Mp, int64_t Kp, const uint16_t* w, int64_t NB,
                int64_t n, O* out) {
  const int64_t groups = (NB + kGroup - 1) / kGroup;
  const int64_t term_stride = Mp * Kp;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    configure_tiles();
    alignas(64) float c[kTileRows * kGroup * kBlock];
    for (int64_t mc = 0; mc < M; mc += kRowChunk) {
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t b = g * kGroup;
        const int G = static_cast<int>(std::min<int64_t>(kGroup, NB - b));
        const int64_t col = b * kBlock, cols = std::min<int64_t>(G * kBlock, n - col);
        for (int64_t m0 = mc; m0 < std::min(M, mc + kRowChunk); m0 += kTileRows) {
          const uint16_t* at = a + m0 * Kp;
          if (terms == 1)
            run_group<1>(G, at, term_stride, w + b * Kp * kBlock, Kp, c);
          else
            run_group<3>(G, at, term_stride, w + b * Kp * kBlock, Kp, c);
          for (int64_t r = 0; r < std::min(kTileRows, M - m0); ++r) {
            const float* src = c + r * kGroup * kBlock;
            O* dst = out + (m0 + r) * n + col;
            if constexpr (std::is_same_v<O, float>)
              std::copy(src, src + cols, dst);
            else
              store_row(src, dst, cols);
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

}  // namespace

// Ask the kernel for the tile state (again: the grant is process state that a CRIU restore does not
// carry back, so workers call this before each step; one cheap syscall).
bool amx_claim() {
#ifdef EMBER_AMX
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
#else
  return false;
#endif
}

bool amx_ready() {
  static const bool ready = amx_claim();
  return ready;
}

// W [N, K] bf16 -> [ceil(N/16), Kp, 16] bf16 in the tile layout above (pack_amx_torch in cpu_gemm.py).
at::Tensor pack_amx(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu() && w.scalar_type() == at::kBFloat16, "pack_amx: 2-D bf16 on CPU");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), Kp = round_k(K), NB = (N + kBlock - 1) / kBlock;
  at::Tensor out = weight_empty({NB, Kp, kBlock}, at::kBFloat16).zero_();
  const uint16_t* src = static_cast<const uint16_t*>(wc.const_data_ptr());
  uint16_t* dst = static_cast<uint16_t*>(out.mutable_data_ptr());
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      uint16_t* d = dst + b * Kp * kBlock;
      for (int64_t j = 0; j < kBlock && b * kBlock + j < N; ++j) {
        const uint16_t* s = src + (b * kBlock + j) * K;
        for (int64_t k = 0; k < K; ++k) d[(k / 2) * 2 * kBlock + 2 * j + (k & 1)] = s[k];
      }
    }
  });
  return out;
}

// Rows of x [M, K] -> `terms` bf16 copies [terms][Mp][Kp] at dst (zeros past K and M already there).
void bf16_terms(const at::Tensor& xc, int terms, int64_t Mp, int64_t Kp, uint16_t* dst) {
  const int64_t M = xc.size(0), K = xc.size(1);
  const auto dtype = xc.scalar_type();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      uint16_t* row = dst + m * Kp;
      if (dtype == at::kBFloat16)
        split_row(xc.const_data_ptr<c10::BFloat16>() + m * K, K, 1, Mp * Kp, row);
      else if (dtype == at::kHalf)
        split_row(xc.const_data_ptr<c10::Half>() + m * K, K, terms, Mp * Kp, row);
      else
        split_row(xc.const_data_ptr<float>() + m * K, K, terms, Mp * Kp, row);
    }
  });
}

// The checks of the pair layouts' matmuls (gemm_amx, gemm_dpbf16): xc = x made contiguous, and the output
// [M, n] in x's dtype (zeros where K is 0).
at::Tensor pairs_output(const at::Tensor& x, const at::Tensor& packed, int64_t n, at::Tensor& xc) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kBlock, "gemm: bad shapes");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && packed.is_contiguous(),
              "gemm: contiguous CPU tensors only");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16, "gemm_bf16: the packed weight must be bf16");
  xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), NB = packed.size(0);
  TORCH_CHECK(packed.size(1) == round_k(K) && n <= NB * kBlock && n > (NB - 1) * kBlock,
              "gemm: weight/input mismatch");
  const auto dtype = xc.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "gemm: activations must be float32, bfloat16 or float16");
  return K == 0 ? at::zeros({M, n}, xc.options()) : at::empty({M, n}, xc.options());
}

// x [M, K] (float32, bf16 or fp16), packed from pack_amx, n = true output count.
at::Tensor gemm_amx(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(amx_ready(), "gemm_amx: this build or CPU has no AMX-BF16");
  at::Tensor xc;
  at::Tensor out = pairs_output(x, packed, n, xc);
  const int64_t M = xc.size(0), K = xc.size(1), Kp = round_k(K), NB = packed.size(0);
  const auto dtype = xc.scalar_type();
  if (M == 0 || K == 0) return out;
#ifdef EMBER_AMX
  const int terms = dtype == at::kBFloat16 ? 1 : 3;
  const int64_t Mp = (M + kTileRows - 1) / kTileRows * kTileRows;
  const std::unique_ptr<uint16_t[]> a(new uint16_t[terms * Mp * Kp]());  // zero padding
  bf16_terms(xc, terms, Mp, Kp, a.get());
  const uint16_t* w = static_cast<const uint16_t*>(packed.const_data_ptr());
  if (dtype == at::kBFloat16)
    amx_matmul(a.get(), terms, M, Mp, Kp, w, NB, n, out.mutable_data_ptr<c10::BFloat16>());
  else if (dtype == at::kHalf)
    amx_matmul(a.get(), terms, M, Mp, Kp, w, NB, n, out.mutable_data_ptr<c10::Half>());
  else
    amx_matmul(a.get(), terms, M, Mp, Kp, w, NB, n, out.mutable_data_ptr<float>());
#endif
  return out;
}
