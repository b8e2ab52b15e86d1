// Ember CPU fast path for group-quantized weights: y[M, N] = x[M, K] @ W[N, K]^T with integer dot products.
//
// Built with the other native ops (kernels/native.py) and registered as torch.ops.ember.qgemm. The rows of
// x are quantized per 32 k to int8 (d = max |x| / 127, q = round(x / d), as GGUF's Q8_0), so each 4 k of a
// weight row meet their 4 activations in one multiply-add of bytes (AVX2: vpmaddubsw + vpmaddwd; AVX-VNNI /
// AVX-512-VNNI: vpdpbusd, chosen at build time by -march=native). The integer sums are exact; each weight
// group then adds sum * scale * d (+ offset * d * sum(q) for formats with a minimum) to a float32
// accumulator, one fixed sequence per output whatever the number of rows: batch invariance. The K-quants'
// superblocks (u4 / u5 / u6 with kSuper parameters) take their own path, cpu_qsuper.h: activations per
// 256 k and integer sums over each superblock, one float step per 256 k.
//
// Weights come in blocks of 16 output rows, and within a block in steps of 4 k (see kernels/qgemm.py):
//   i8: signed bytes, 64 per step: rows 0..7 then rows 8..15, each its 4 k together (Q8_0, Q6_K, int8);
//   u4: 32 bytes per step, byte 4 i + j = row i (low nibble) and row i + 8 (high nibble) at k j;
//   u5: per 8 steps their u4 bytes, then two 32-byte planes with the fifth bits (Q5_0 / Q5_1 / Q5_K);
//   u6: per 4 steps their u4 bytes, then a 64-byte plane with the two high bits of each step (Q6_K).
// Each group of G k (32; 16 for i8) of a block starts with its parameters, 16 scales and (formats with
// mins) 16 offsets, float32 or float16, so a block is one sequential stream: w = (q - zero) * scale, or
// q * scale + offset.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "cpu_qamx.h"
#include "cpu_qblocks.h"
#include "cpu_qfew.h"
#include "cpu_qsuper.h"
#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

namespace {

using namespace qblocks;

// Rows m .. m + R of one block over gn groups from g0, from and back into acc [M, 16]: the many-row
// micro-kernel of u4 / u5 with 256-bit vectors. blk: group g0's parameters and its steps unpacked to bytes,
// groups cw.gbytes apart. The steps of a run are a plain loop, so that the R x 2 int16 sums and the step's
// two weight vectors stay in registers (unrolled, the compiler hoisted the products of several steps and
// spilled the sums). The integer sums of a group are exact, and each output then takes the float
// operations of few_tile() in its order: the result is that of the few-row path.
template <int R, int F, int GS>
void chunk_rows_u(const XRow* x, int64_t m, const uint8_t* blk, const Weights& cw, int64_t g0, int64_t gn,
                  float* acc) {
  constexpr int H = kHalves;
  const XRow* xr = x + m;
  for (int64_t gi = 0; gi < gn; ++gi) {
    const int64_t t = (g0 + gi) * GS, xg = t / (kXGroup / 4);
    const uint8_t* pg = blk + gi * cw.gbytes;
    const uint8_t* gw = pg + cw.pbytes();
    VI is[R][H];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) is[r][h] = vzero();
#if EMBER_QVNNI
    auto step = [&](int i) {
      VI a[H];
      for (int h = 0; h < H; ++h) a[h] = vload(gw + 64 * i + 4 * kLanes * h);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xr[r].q + 4 * (t + i), 4);
        const VI xb = vbcast(four);
        for (int h = 0; h < H; ++h) is[r][h] = vdpbusd(is[r][h], a[h], xb);
      }
    };
#pragma GCC unroll 1
    for (int i = 0; i < GS; ++i) step(i);
#else
    constexpr int RUN = run_of(F);
    __m256i ps[R][2];
    auto step = [&](int i) {
      const __m256i a = vload(gw + 64 * i), b = vload(gw + 64 * i + 32);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xr[r].q + 4 * (t + i), 4);
        const __m256i xb = _mm256_set1_epi32(four);
        const __m256i pa = _mm256_maddubs_epi16(a, xb), pb = _mm256_maddubs_epi16(b, xb);
        ps[r][0] = _mm256_add_epi16(ps[r][0], pa);
        ps[r][1] = _mm256_add_epi16(ps[r][1], pb);
      }
    };
    for (int i0 = 0; i0 < GS; i0 += RUN) {
      for (int r = 0; r < R; ++r) ps[r][0] = ps[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
      for (int i = i0; i < i0 + RUN; ++i) step(i);
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h)
          is[r][h] = _mm256_add_epi32(is[r][h], _mm256_madd_epi16(ps[r][h], _mm256_set1_epi16(1)));
    }
#endif
    const Params& pr = cw.pr;
    auto param = [&](int i) { return pr.mode == kF16 ? vparam<true>(pg, i) : vparam<false>(pg, i); };
    for (int h = 0; h < H; ++h) {
      const VF scale = param(kLanes * h);
      VF off = vfzero();
      if (pr.offsets)
        off = param(kBlock + kLanes * h);
      else if (pr.zero)
        off = vmul(scale, vset(static_cast<float>(-pr.zero)));
      for (int r = 0; r < R; ++r) {
        float* o = acc + (m + r) * kBlock + kLanes * h;
        VF v = vfma(vfloat(is[r][h]), vmul(scale, vset(xr[r].d[xg])), vloadf(o));
        if (pr.mins()) v = vfma(off, vset(xr[r].template sum<GS>(g0 + gi)), v);
        vstoref(o, v);
      }
    }
  }
}

// The same as few_tile() (int32 and float sums in registers, measured faster than sums in memory): i8
// (steps as stored), and with 512-bit vectors, whose 32 registers hold them, u4 / u5 (unpacked to bytes).
// NB blocks at once (block j cw.bstride() after blk, its sums at acc + j * M * 16).
template <int R, int NB, int F, int GS, int PM, bool MINS>
void chunk_rows(const XRow* x, int64_t m, const uint8_t* blk, const Weights& cw, int64_t g0, int64_t gn,
                float* acc, int64_t M) {
  if constexpr (F == kI8 || kHalves == 1) {
    VF a[R][NB][kHalves];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j)
        for (int h = 0; h < kHalves; ++h) a[r][j][h] = vloadf(acc + (j * M + m + r) * kBlock + kLanes * h);
    few_tile<R, NB, F, GS, PM, MINS, F != kI8>(x + m, blk, cw, g0, gn, a);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j)
        for (int h = 0; h < kHalves; ++h) vstoref(acc + (j * M + m + r) * kBlock + kLanes * h, a[r][j][h]);
  } else {
    static_assert(NB == 1, "the 256-bit u4 / u5 tile walks one block");
    chunk_rows_u<R, F, GS>(x, m, blk, cw, g0, gn, acc);
  }
}

// Rows per many-row tile: 4 x 2 sums in registers (u5's int32 sums between its runs too). With 512-bit
// vectors 6 or 8 rows measured within noise of 4 (i8 too, where the bias is shared by the tile's rows).
constexpr int kTileRows = 4;

// All M rows of a chunk against NB blocks: tiles of 4 rows, the last rest (1-3) rows one smaller tile.
template <int NB, int F, int GS, int PM, bool MINS>
void chunk_all(const XRow* x, int64_t M, const uint8_t* blk, const Weights& cw, int64_t g0, int64_t gn,
               float* acc) {
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows)
    chunk_rows<kTileRows, NB, F, GS, PM, MINS>(x, m, blk, cw, g0, gn, acc, M);
  const int64_t rest = M - m;
  if (rest == 3) chunk_rows<3, NB, F, GS, PM, MINS>(x, m, blk, cw, g0, gn, acc, M);
  if (rest == 2) chunk_rows<2, NB, F, GS, PM, MINS>(x, m, blk, cw, g0, gn, acc, M);
  if (rest == 1) chunk_rows<1, NB, F, GS, PM, MINS>(x, m, blk, cw, g0, gn, acc, M);
}

// 4 or more rows: threads split the blocks, NB at a time; each block is walked in chunks of kChunkSteps
// steps against tiles of 4 rows; float sums park in acc [NB][M, 16] between chunks. u4 / u5 chunks are
// unpacked to bytes first, each group after its parameters (~4 KiB a block, in L1); kSuper chunks (i8
// too) are copied with float32 parameters, so that the tiles do not remake them (i8 Q6_K at 32 rows: 14%
// slower without).
template <int NB, int F, int GS, int PM, bool MINS>
void many_rows(const XRow* x, int64_t M, const Weights& wt, float* out, int64_t ldo, int64_t n) {
  static_assert(kChunkSteps == kSuperSteps, "a chunk is a superblock");
  constexpr int64_t chunk = kChunkSteps / GS;  // groups per chunk
  constexpr bool COPY = F != kI8 || PM == kSuper;  // the tiles read a copy of the chunk
  constexpr int CPM = PM == kSuper ? kF32 : PM;  // its parameters
  const int64_t pb = wt.pbytes(), cpb = (wt.pr.offsets ? 2 : 1) * kBlock * (CPM == kF16 ? 2 : 4);
  const int64_t wbytes = cpb + GS * 64;  // an unpacked group
  at::parallel_for(0, (wt.nblocks + NB - 1) / NB, 1, [&](int64_t t0, int64_t t1) {
    std::unique_ptr<float[]> acc(new float[NB * M * kBlock]);
    std::unique_ptr<uint8_t[]> wide(COPY ? new uint8_t[NB * chunk * wbytes] : nullptr);
    const VF zero = vset(static_cast<float>(-wt.pr.zero));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t * NB, nb = std::min<int64_t>(NB, wt.nblocks - b);
      std::fill(acc.get(), acc.get() + nb * M * kBlock, 0.0f);
      for (int64_t c0 = 0; c0 < wt.kgroups(); c0 += chunk) {
        const int64_t gn = std::min(chunk, wt.kgroups() - c0);
        const uint8_t* blk = wt.w + b * wt.bstride() + c0 / wt.subs * wt.gbytes;
        Weights cw = wt;
        if constexpr (COPY) {
          for (int64_t j = 0; j < nb; ++j)
            for (int64_t g = 0; g < gn; ++g) {
              const GroupAt<PM, GS> at(blk + j * wt.bstride(), wt, g);
              uint8_t* dst = wide.get() + (j * chunk + g) * wbytes;
              if constexpr (PM == kSuper) {
                for (int h = 0; h < kHalves; ++h) {
                  VF scale, off = vfzero();
                  group_params<PM, MINS>(at.params, at.head, wt.pr, h, zero, scale, off);
                  vstoref(reinterpret_cast<float*>(dst) + kLanes * h, scale);
                  if constexpr (MINS) vstoref(reinterpret_cast<float*>(dst) + kBlock + kLanes * h, off);
                }
              } else {
                std::memcpy(dst, at.params, pb);
              }
              for (int i = 0; i < GS; ++i) {
                VI v[kHalves];
                unpack<F>(at.params + pb, i, v);
                for (int h = 0; h < kHalves; ++h) vstore(dst + cpb + 64 * i + 4 * kLanes * h, v[h]);
              }
            }
          blk = wide.get();
          cw.gbytes = wbytes;
          cw.groups = chunk;  // bstride(): one block's unpacked chunk to the next
          cw.subs = 1;
          cw.pr.mode = CPM;
        }
        if (nb == NB)
          chunk_all<NB, F, GS, CPM, MINS>(x, M, blk, cw, c0, gn, acc.get());
        else
          chunk_all<1, F, GS, CPM, MINS>(x, M, blk, cw, c0, gn, acc.get());
      }
      store_blocks(acc.get(), M, b, nb, out, ldo, n);
    }
  });
}

}  // namespace

namespace qblocks {

const Walk& few_walk() {
  static const Walk walk = [] {
    if (const char* v = std::getenv("EMBER_QWALK")) {
      int blocks = 0;
      long long ahead = -1;
      TORCH_CHECK(std::sscanf(v, "%d:%lld", &blocks, &ahead) == 2 && blocks >= 1 && ahead >= 0,
                  "EMBER_QWALK must be BLOCKS:AHEAD (e.g. 1:0 or 4:16), not ", v);
      return Walk{blocks == 1 ? 1 : kWidestWalk, ahead};
    }
    __builtin_cpu_init();
    if (__builtin_cpu_is("amd")) return Walk{1, 0};
    return Walk{kWidestWalk, 16};
  }();
  return walk;
}

}  // namespace qblocks

namespace {

template <int F, int GS>
void run_format(const XRow* x, int64_t M, const Weights& wt, float* out, int64_t n) {
  if (M == 1) return few_rows<1, F, GS>(x, wt, out, n, n);
  if (M == 2) return few_rows<2, F, GS>(x, wt, out, n, n);
  if (M == 3) return few_rows<3, F, GS>(x, wt, out, n, n);
  with_params(wt.pr, [&](auto pm, auto mins) {
    if constexpr (kHalves == 1)
      if (M >= kPairRows) return many_rows<2, F, GS, pm(), mins()>(x, M, wt, out, n, n);
    many_rows<1, F, GS, pm(), mins()>(x, M, wt, out, n, n);
  });
}

}  // namespace

// x [M, K] (float32, bf16 or half), packed uint8 [NB, units, unit bytes] (see Weights), fmt 0 i8 / 1 u4 /
// 2 u5 / 3 u6, params a PMode; n output rows (<= 16 NB). Returns [M, n] in x's dtype.
at::Tensor qgemm(const at::Tensor& x, const at::Tensor& packed, int64_t fmt, int64_t group, int64_t zero,
                 bool offsets, int64_t params, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "qgemm: x must be a 2-D CPU tensor");
  TORCH_CHECK(fmt >= kI8 && fmt <= kU6, "qgemm: fmt must be 0 (i8), 1 (u4), 2 (u5) or 3 (u6)");
  TORCH_CHECK((group == 32 && fmt != kU6) || (group == 16 && ((fmt == kI8 && !offsets && zero == 0) || fmt == kU6)),
              "qgemm: groups are 32 k (16 for i8 without minimums, and for u6)");
  TORCH_CHECK(params >= kF32 && params <= kSuper, "qgemm: params must be 0 (float32), 1 (float16) or 2 (superblocks)");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.device().is_cpu(),
              "qgemm: the packed weight must be contiguous uint8 [NB, units, unit bytes] on the CPU");
  const Params pr{static_cast<int>(zero), offsets, static_cast<int>(params)};
  const int64_t steps = group / 4, subs = params == kSuper ? kSuperSteps / steps : 1;
  Weights probe{nullptr, 0, 0, 0, pr, subs};
  const int64_t gbytes = probe.sbytes() + subs * (probe.pbytes() + steps * step_bytes(static_cast<int>(fmt)));
  const int64_t M = x.size(0), K = x.size(1), NBlk = packed.size(0), Kp = packed.size(1) * subs * group;
  TORCH_CHECK(packed.size(2) == gbytes, "qgemm: unit bytes do not match the format");
  TORCH_CHECK(K <= Kp && Kp - K < (params == kSuper ? 1 : kXGroup), "qgemm: weight/input size mismatch");
  TORCH_CHECK(n <= NBlk * kBlock && n > (NBlk - 1) * kBlock, "qgemm: n does not match the blocks");
  const at::Tensor xc = x.contiguous();
  const auto dtype = xc.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "qgemm: activations must be float32, bfloat16 or float16");
  const int64_t ng = Kp / kXGroup;
  // the superblock formats' own path: activations per 256 k, integer sums over each superblock
  const bool super = params == kSuper && fmt != kI8;
  const int64_t Mq = super && qamx_pads(M) ? (M + 15) / 16 * 16 : M;  // AMX tiles read 16 rows at a time
  const std::unique_ptr<int8_t[]> xq(new int8_t[Mq * Kp]);
  std::fill(xq.get() + M * Kp, xq.get() + Mq * Kp, int8_t{0});
  const std::unique_ptr<float[]> xd(new float[M * ng * 4]), obuf(new float[M * n]);
  float *xs = xd.get() + M * ng, *xh = xs + M * ng;
  std::unique_ptr<int16_t[]> xb(super ? new int16_t[M * (Kp / group)] : nullptr);
  if (super && dtype == at::kBFloat16)
    quantize_rows_super(xc.const_data_ptr<c10::BFloat16>(), M, K, group, xq.get(), xd.get(), xb.get());
  else if (super && dtype == at::kHalf)
    quantize_rows_super(xc.const_data_ptr<c10::Half>(), M, K, group, xq.get(), xd.get(), xb.get());
  else if (super)
    quantize_rows_super(xc.const_data_ptr<float>(), M, K, group, xq.get(), xd.get(), xb.get());
  else if (dtype == at::kBFloat16)
    quantize_rows(xc.const_data_ptr<c10::BFloat16>(), M, K, Kp, xq.get(), xd.get(), xs, xh);
  else if (dtype == at::kHalf)
    quantize_rows(xc.const_data_ptr<c10::Half>(), M, K, Kp, xq.get(), xd.get(), xs, xh);
  else
    quantize_rows(xc.const_data_ptr<float>(), M, K, Kp, xq.get(), xd.get(), xs, xh);
  std::unique_ptr<uint8_t[]> xu;
  if (kHalves == 1 && fmt == kI8) {  // the 512-bit i8 kernels' unsigned activations
    xu.reset(new uint8_t[M * Kp]);
    const VI flip = vbcast(static_cast<int32_t>(0x80808080u));
    const auto* q = reinterpret_cast<const uint8_t*>(xq.get());
    at::parallel_for(0, M * Kp / 64, 64, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) vstore(xu.get() + 64 * i, vxor(vload(q + 64 * i), flip));
    });
    for (int64_t i = M * Kp / 64 * 64; i < M * Kp; ++i) xu[i] = static_cast<uint8_t>(xq[i] ^ 0x80);
  }
  std::unique_ptr<XRow[]> rows(new XRow[M]);
  for (int64_t m = 0; m < M; ++m)
    rows[m] = super ? XRow{xq.get() + m * Kp, xd.get() + m * (Kp / 256), nullptr, nullptr, nullptr,
                           xb.get() + m * (Kp / group)}
                    : XRow{xq.get() + m * Kp, xd.get() + m * ng, xs + m * ng, xh + 2 * m * ng,
                           xu ? xu.get() + m * Kp : nullptr, nullptr};
  const Weights wt{packed.const_data_ptr<uint8_t>(), NBlk, packed.size(1), gbytes, pr, subs};
  at::Tensor out = at::empty({M, n}, xc.options());
  float* o = dtype == at::kFloat ? out.mutable_data_ptr<float>() : obuf.get();
  if (M > 0) {
    if (fmt == kI8 && group == 16) run_format<kI8, 4>(rows.get(), M, wt, o, n);
    if (fmt == kI8 && group == 32) run_format<kI8, 8>(rows.get(), M, wt, o, n);
    if (fmt == kU4) super ? super_matmul<kU4, 8>(rows.get(), xq.get(), M, Kp, wt, o, n) : run_format<kU4, 8>(rows.get(), M, wt, o, n);
    if (fmt == kU5) super ? super_matmul<kU5, 8>(rows.get(), xq.get(), M, Kp, wt, o, n) : run_format<kU5, 8>(rows.get(), M, wt, o, n);
    if (fmt == kU6) super ? super_matmul<kU6, 4>(rows.get(), xq.get(), M, Kp, wt, o, n) : run_format<kU6, 4>(rows.get(), M, wt, o, n);
  }
  if (dtype == at::kBFloat16) store_row(o, out.mutable_data_ptr<c10::BFloat16>(), M * n);
  if (dtype == at::kHalf) store_row(o, out.mutable_data_ptr<c10::Half>(), M * n);
  return out;
}

TORCH_LIBRARY_FRAGMENT(ember, m) {
  // whether the K-quants' many-row products run on AMX tiles here (cpu_qamx.h): tests and benchmarks
  m.def("qgemm_tiles() -> bool", [] { return qamx_ready(); });
  // how the K-quants' one-row products walk a weight here: [blocks at once (1, or the build's widest),
  // superblocks of software prefetch ahead, the build's widest walk (4 with 512-bit vectors, 2 with 256-bit)]
  m.def("qgemm_walk() -> int[]",
        [] { return std::vector<int64_t>{few_walk().blocks, few_walk().ahead, kWidestWalk}; });
  m.def("qgemm(Tensor x, Tensor packed, int fmt, int group, int zero, bool offsets, int params, int n) -> Tensor",
        qgemm);
}
