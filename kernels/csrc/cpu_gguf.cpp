// Ember's load-time conversion of GGUF blocks into the integer-dot matmul's packed layout, natively.
//
// Built with the other native ops (kernels/native.py); registered as torch.ops.ember.gguf_decode and
// torch.ops.ember.qpack. They do what workers/gguf_repack.repack and kernels/qgemm.pack_qweight do with
// whole-tensor torch ops (those stay the references, and the tests compare them byte for byte): a GGUF
// tensor's blocks -> integers q [N, K] and per-group float32 scales (and offsets), then q and the
// parameters -> blocks of 16 rows, each a sequence of groups [parameters][steps of 4 k]. Loops over
// rows instead of a dozen passes over the tensor: the start-up of a quantized file is seconds shorter.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <cstdint>
#include <cstring>
#include <algorithm>
#include <tuple>
#include <vector>

namespace {

enum GType { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

struct TypeInfo {
  int block, bytes, group;  // weights and bytes per block, weights per group of parameters
  bool offsets;
  bool super() const { return block == 256; }  // the K-quants: sub-scales (and mins) times d (and -dmin)
};

TypeInfo type_info(int64_t t) {
  switch (t) {
    case kQ4_0: return {32, 18, 32, false};
    case kQ4_1: return {32, 20, 32, true};
    case kQ5_0: return {32, 22, 32, false};
    case kQ5_1: return {32, 24, 32, true};
    case kQ8_0: return {32, 34, 32, false};
    case kQ4_K: return {256, 144, 32, true};
    case kQ5_K: return {256, 176, 32, true};
    case kQ6_K: return {256, 210, 16, false};
    default: TORCH_CHECK(false, "gguf_decode: GGUF type ", t, " is not repacked");
  }
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes.
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 0x3F;
    mn = s[j + 4] & 0x3F;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

// One block at b -> its weights' integers q[0 .. block) and parameters: sc / of [block / group], or for the
// K-quants the sub-scales ss (and sub-mins sm) [block / group] and the superblock's d (and -dmin) in sup.
void decode_block(int64_t t, const uint8_t* b, uint8_t* q, float* sc, float* of, int8_t* ss, int8_t* sm,
                  float* sup) {
  switch (t) {
    case kQ8_0:
      sc[0] = f16(b);
      std::memcpy(q, b + 2, 32);
      return;
    case kQ4_0:
    case kQ4_1: {
      const uint8_t* qs = b + (t == kQ4_0 ? 2 : 4);
      sc[0] = f16(b);
      if (t == kQ4_1) of[0] = f16(b + 2);
      for (int j = 0; j < 16; ++j) q[j] = qs[j] & 0x0F, q[j + 16] = qs[j] >> 4;
      return;
    }
    case kQ5_0:
    case kQ5_1: {
      const int h = t == kQ5_0 ? 2 : 4;
      uint32_t qh;
      std::memcpy(&qh, b + h, 4);
      const uint8_t* qs = b + h + 4;
      sc[0] = f16(b);
      if (t == kQ5_1) of[0] = f16(b + 2);
      for (int j = 0; j < 16; ++j) {
        q[j] = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
        q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      }
      return;
    }
    case kQ4_K:
    case kQ5_K: {
      sup[0] = f16(b);
      sup[1] = -f16(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;  // Q5_K only
      const uint8_t* qs = b + (t == kQ4_K ? 16 : 48);
      for (int j = 0; j < 8; ++j) {
        int s, m;
        k_scale_min(scales, j, s, m);
        ss[j] = static_cast<int8_t>(s);
        sm[j] = static_cast<int8_t>(m);
        const uint8_t* src = qs + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        uint8_t* o = q + 32 * j;
        if (t == kQ5_K)
          for (int w = 0; w < 32; ++w) o[w] = static_cast<uint8_t>(((src[w] >> shift) & 0x0F) | (((qh[w] >> j) & 1) << 4));
        else
          for (int w = 0; w < 32; ++w) o[w] = static_cast<uint8_t>((src[w] >> shift) & 0x0F);
      }
      return;
    }
    case kQ6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      std::memcpy(ss, b + 192, 16);
      sup[0] = f16(b + 208);
      // weight 128 c + 32 s + w of the block: low nibble (s < 2) or high (s >= 2) of ql[64 c + 32 (s % 2) + w],
      // high bits 2 s, 2 s + 1 of qh[32 c + w]; u6 with zero point 32
      for (int c = 0; c < 2; ++c)
        for (int s = 0; s < 4; ++s) {
          const uint8_t *l = ql + 64 * c + 32 * (s % 2), *h = qh + 32 * c;
          uint8_t* o = q + 128 * c + 32 * s;
          const int shift = s < 2 ? 0 : 4;
          for (int w = 0; w < 32; ++w) o[w] = static_cast<uint8_t>(((l[w] >> shift) & 0x0F) | (((h[w] >> (2 * s)) & 3) << 4));
        }
      return;
    }
    default: TORCH_CHECK(false, "gguf_decode: GGUF type ", t, " is not repacked");
  }
}

}  // namespace

// raw: the tensor's stored bytes (uint8, n * k / block * bytes), type: its GGUF type id, [n, k] its
// shape. Returns q [n, k] (int8 for Q8_0, else uint8: Q6_K's 0..63), scales [n, k / group] and offsets (same,
// or empty for types without), and the superblocks' parameters: for the 32-wide types float32 scales and
// offsets and an empty last tensor; for the K-quants int8 sub-scales and sub-mins and float32
// [n, k / 256, 2] (d, -dmin; Q6_K: [n, k / 256, 1], d).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gguf_decode(const at::Tensor& raw, int64_t type,
                                                                      int64_t n, int64_t k) {
  const TypeInfo ti = type_info(type);
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte, "gguf_decode: uint8 CPU bytes");
  TORCH_CHECK(k % ti.block == 0 && raw.numel() == n * (k / ti.block) * ti.bytes, "gguf_decode: whole blocks");
  const at::Tensor rc = raw.contiguous();
  const bool signed_q = type == kQ8_0;
  const auto opts = at::TensorOptions().device(at::kCPU);
  const auto pdtype = ti.super() ? at::kChar : at::kFloat;
  at::Tensor q = at::empty({n, k}, opts.dtype(signed_q ? at::kChar : at::kByte));
  at::Tensor scales = at::empty({n, k / ti.group}, opts.dtype(pdtype));
  at::Tensor offsets = at::empty({ti.offsets ? n : 0, k / ti.group}, opts.dtype(pdtype));
  at::Tensor supers = at::empty({ti.super() ? n : 0, k / 256, ti.offsets ? 2 : 1}, opts.dtype(at::kFloat));
  const uint8_t* src = rc.const_data_ptr<uint8_t>();
  auto* qp = static_cast<uint8_t*>(q.mutable_data_ptr());
  auto* sp = static_cast<uint8_t*>(scales.mutable_data_ptr());
  auto* op = static_cast<uint8_t*>(offsets.mutable_data_ptr());
  float* up = supers.mutable_data_ptr<float>();
  const int64_t per_row = k / ti.block, params = ti.block / ti.group, psize = ti.super() ? 1 : 4;
  at::parallel_for(0, n * per_row, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      uint8_t* s = sp + blk * params * psize;
      uint8_t* o = ti.offsets ? op + blk * params * psize : nullptr;
      decode_block(type, src + blk * ti.bytes, qp + blk * ti.block, reinterpret_cast<float*>(s),
                   reinterpret_cast<float*>(o), reinterpret_cast<int8_t*>(s), reinterpret_cast<int8_t*>(o),
                   ti.super() ? up + blk * (ti.offsets ? 2 : 1) : nullptr);
    }
  });
  return {q, scales, offsets, supers};
}

namespace {

// A packed layout's sizes (kernels/qgemm.pack_qweight): kind 0 i8 / 1 u4 / 2 u5 / 3 u6; params 0 / 1:
// float32 scales and offsets stored as float32 / float16; 2: int8 sub-scales and sub-mins with float32 d
// (and -dmin) per row and 256 k.
struct Layout {
  int64_t kind, group, params, K, Kp, groups, G, steps, P, subs, units, psize, pbytes, data, sbytes, gstride,
      ubytes;
  bool sup, has_off;
};

Layout layout(int64_t kind, int64_t group, int64_t params, int64_t K, bool has_off) {
  TORCH_CHECK(kind >= 0 && kind <= 3 && (group == 32 ? kind != 3 : group == 16 && (kind == 0 || kind == 3)),
              "qpack: bad format");
  TORCH_CHECK(params >= 0 && params <= 2, "qpack: params must be 0, 1 or 2");
  Layout f{};
  f.kind = kind, f.group = group, f.params = params, f.K = K, f.has_off = has_off, f.sup = params == 2;
  f.Kp = (K + 31) / 32 * 32, f.groups = f.Kp / group, f.G = (K + group - 1) / group, f.steps = group / 4;
  f.P = has_off ? 2 : 1, f.subs = f.sup ? 256 / group : 1, f.units = f.groups / f.subs;
  TORCH_CHECK(!f.sup || K % 256 == 0, "qpack: superblocks need K a multiple of 256");
  f.psize = params == 0 ? 4 : params == 1 ? 2 : 1, f.pbytes = f.P * 16 * f.psize;
  f.data = f.steps * (kind == 0 ? 64 : 32) + (kind >= 2 ? 64 : 0);
  f.sbytes = f.sup ? f.P * 64 : 0, f.gstride = f.pbytes + f.data, f.ubytes = f.sbytes + f.subs * f.gstride;
  return f;
}

// One block's sources, row r at: q + r * qstride (K bytes), its G parameters at sp / op + r * G (float32)
// or ss / sm + r * G (int8 with superblocks, and then its supers at up + r * units * P).
struct BlockSrc {
  const uint8_t* q;
  int64_t qstride;
  const float *sp, *op;
  const uint8_t *ss, *sm;
  const float* up;
  int rows;
};

inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline void store32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

// A group's steps of 4 k for 16 rows from their bytes (row r at src + r * stride), STEPS of them (a
// constant, so the loops unroll): i8 words as they are (step st, row r at st * 64 + 4 r); u4 and up,
// rows r and r + 8 in one byte (low and high nibble), then for u5 / u6 a plane of their high bits
// (u5: bit st of each byte the fifth bit; u6: bits 2 st, 2 st + 1 the high two).
template <int STEPS>
inline void pack_steps(int64_t kind, const uint8_t* src, int64_t stride, uint8_t* d) {
  if (kind == 0) {
    for (int st = 0; st < STEPS; ++st)
      for (int r = 0; r < 16; ++r) std::memcpy(d + st * 64 + 4 * r, src + r * stride + 4 * st, 4);
    return;
  }
  for (int st = 0; st < STEPS; ++st)
    for (int i = 0; i < 8; ++i) {
      const uint32_t lo = load32(src + i * stride + 4 * st), hi = load32(src + (i + 8) * stride + 4 * st);
      store32(d + st * 32 + 4 * i, (lo & 0x0F0F0F0Fu) | ((hi & 0x0F0F0F0Fu) << 4));
    }
  if (kind < 2) return;
  const int bits = kind == 2 ? 1 : 2;
  const uint32_t mask = kind == 2 ? 0x01010101u : 0x03030303u;
  for (int r = 0; r < 16; ++r) {
    uint32_t w = 0;
    for (int st = 0; st < STEPS; ++st) w |= ((load32(src + r * stride + 4 * st) >> 4) & mask) << (bits * st);
    store32(d + STEPS * 32 + 4 * r, w);  // 32 h + 4 i with r = 8 h + i
  }
}

// Pack one block of up to 16 rows into dst (units * ubytes bytes, zeroed by the caller); buf: 16 * Kp
// bytes. Walks the output in order: each 4-k step of a group takes 4 bytes of each of the 16 rows (u4 and
// up: rows r and r + 8 share a byte, low and high nibble; the fifth / high bits of each byte gather in a
// plane after the nibbles), so every output word is written once.
void pack_block(const Layout& f, const BlockSrc& s, uint8_t* dst, uint8_t* buf) {
  auto put = [&](uint8_t* p, float v) {
    if (f.params == 1) {
      const uint16_t bits = c10::Half(v).x;
      std::memcpy(p, &bits, 2);
    } else {
      std::memcpy(p, &v, 4);
    }
  };
  // the 16 rows' bytes, zero past K and past the block's rows (read in place when there is no padding)
  const uint8_t* rows = s.q;
  int64_t stride = s.qstride;
  if (s.rows < 16 || f.K != f.Kp) {
    for (int r = 0; r < 16; ++r) {
      uint8_t* row = buf + r * f.Kp;
      const int64_t have = r < s.rows ? f.K : 0;
      if (have) std::memcpy(row, s.q + r * s.qstride, have);
      std::fill(row + have, row + f.Kp, 0);
    }
    rows = buf, stride = f.Kp;
  }
  const int64_t G = f.G, steps = f.steps;
  for (int64_t g = 0; g < f.groups; ++g) {
    uint8_t* head = dst + (g / f.subs) * f.ubytes;
    uint8_t* o = head + f.sbytes + (g % f.subs) * f.gstride;
    if (f.sup) {  // int8 sub-parameters, and at a superblock's first group its rows' d (and -dmin)
      for (int r = 0; r < s.rows; ++r) o[r] = s.ss[r * G + g];
      if (f.has_off)
        for (int r = 0; r < s.rows; ++r) o[16 + r] = s.sm[r * G + g];
      if (g % f.subs == 0)
        for (int64_t p = 0; p < f.P; ++p)
          for (int r = 0; r < s.rows; ++r)
            std::memcpy(head + 64 * p + 4 * r, s.up + (r * f.units + g / f.subs) * f.P + p, 4);
    } else if (g < G) {
      for (int r = 0; r < s.rows; ++r) {
        put(o + r * f.psize, s.sp[r * G + g]);
        if (f.has_off) put(o + (16 + r) * f.psize, s.op[r * G + g]);
      }
    }
    uint8_t* d = o + f.pbytes;
    const uint8_t* src = rows + g * f.group;
    if (steps == 8) pack_steps<8>(f.kind, src, stride, d);
    else pack_steps<4>(f.kind, src, stride, d);
  }
}

}  // namespace

// q [N, K] (int8 or uint8: i8 bytes, or u4 / u5 / u6 values), scales [N, ceil(K / group)] and offsets (the
// same or empty), supers float32 [N, K / 256, 1 or 2] (d, -dmin) with params 2 (see Layout). The layout of
// kernels/qgemm.pack_qweight: uint8 [NB, units, unit bytes], zero past N and K.
at::Tensor qpack(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& supers,
                 int64_t kind, int64_t group, int64_t params) {
  TORCH_CHECK(q.dim() == 2 && q.device().is_cpu() && q.element_size() == 1, "qpack: q is [N, K] bytes");
  const int64_t N = q.size(0), NB = (N + 15) / 16;
  const bool has_off = offsets.numel() > 0;
  const Layout f = layout(kind, group, params, q.size(1), has_off);
  TORCH_CHECK(scales.size(0) == N && scales.size(1) == f.G, "qpack: one scale per row and group");
  TORCH_CHECK(!has_off || offsets.sizes() == scales.sizes(), "qpack: offsets shaped as the scales");
  TORCH_CHECK(!f.sup || (scales.scalar_type() == at::kChar && (!has_off || offsets.scalar_type() == at::kChar) &&
                         supers.sizes() == at::IntArrayRef({N, f.K / 256, f.P}) &&
                         supers.scalar_type() == at::kFloat),
              "qpack: superblocks need int8 sub-parameters and float32 supers [N, K / 256, P]");
  const at::Tensor qc = q.contiguous(), sc = f.sup ? scales.contiguous() : scales.contiguous().to(at::kFloat);
  const at::Tensor oc = has_off ? (f.sup ? offsets.contiguous() : offsets.contiguous().to(at::kFloat)) : offsets;
  const at::Tensor uc = supers.contiguous();
  at::Tensor out = weight_empty({NB, f.units, f.ubytes}, at::kByte).zero_();
  const auto* qp = static_cast<const uint8_t*>(qc.const_data_ptr());
  const float* sp = f.sup ? nullptr : sc.const_data_ptr<float>();
  const float* op = has_off && !f.sup ? oc.const_data_ptr<float>() : nullptr;
  const auto* ss = f.sup ? static_cast<const uint8_t*>(sc.const_data_ptr()) : nullptr;
  const auto* sm = f.sup && has_off ? static_cast<const uint8_t*>(oc.const_data_ptr()) : nullptr;
  const float* up = f.sup ? uc.const_data_ptr<float>() : nullptr;
  uint8_t* dst = out.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint8_t> row_buf(16 * f.Kp);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * 16, G = f.G;
      BlockSrc s{qp + r0 * f.K,
                 f.K,
                 sp ? sp + r0 * G : nullptr,
                 op ? op + r0 * G : nullptr,
                 ss ? ss + r0 * G : nullptr,
                 sm ? sm + r0 * G : nullptr,
                 up ? up + r0 * f.units * f.P : nullptr,
                 static_cast<int>(std::min<int64_t>(16, N - r0))};
      pack_block(f, s, dst + b * f.units * f.ubytes, row_buf.data());
    }
  });
  return out;
}

// A GGUF tensor's rows straight into the packed layout, 16 rows at a time (no [N, K] integers in between):
// raw uint8 [n, row bytes] (rows may be strided: a column slice at block boundaries), its GGUF type and
// shape, the format (kind, group, params as for qpack; they must be the type's), and out uint8
// [ceil(n / 16), units, unit bytes] (contiguous: a range of blocks of a layer's packed weight), which
// is overwritten: the same bytes as qpack of gguf_decode's tensors.
void gguf_pack(const at::Tensor& raw, int64_t type, int64_t n, int64_t k, const at::Tensor& out, int64_t kind,
               int64_t group, int64_t params) {
  const TypeInfo ti = type_info(type);
  const int64_t per_row = k / ti.block;
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.stride(1) == 1,
              "gguf_pack: raw is uint8 CPU rows");
  TORCH_CHECK(k % ti.block == 0 && raw.size(0) == n && raw.size(1) == per_row * ti.bytes,
              "gguf_pack: whole blocks");
  TORCH_CHECK(group == ti.group && (params == 2) == ti.super() && (params == 1) == !ti.super(),
              "gguf_pack: the format is not the type's");
  const Layout f = layout(kind, group, params, k, ti.offsets);
  const int64_t NB = (n + 15) / 16, G = f.G, pper = ti.block / ti.group, psize = ti.super() ? 1 : 4;
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kByte &&
                  out.sizes() == at::IntArrayRef({NB, f.units, f.ubytes}),
              "gguf_pack: out is uint8 [blocks, units, unit bytes]");
  const uint8_t* src = raw.const_data_ptr<uint8_t>();
  const int64_t rstride = raw.stride(0);
  uint8_t* dst = out.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint8_t> q(16 * k), row_buf(16 * f.Kp), sc(16 * G * psize), of(16 * G * psize);
    std::vector<float> up(16 * f.units * f.P);
    for (int64_t b = b0; b < b1; ++b) {
      const int rows = static_cast<int>(std::min<int64_t>(16, n - b * 16));
      for (int r = 0; r < rows; ++r) {
        const uint8_t* row = src + (b * 16 + r) * rstride;
        for (int64_t j = 0; j < per_row; ++j) {
          uint8_t* s = sc.data() + (r * G + j * pper) * psize;
          uint8_t* o = of.data() + (r * G + j * pper) * psize;
          decode_block(type, row + j * ti.bytes, q.data() + r * k + j * ti.block, reinterpret_cast<float*>(s),
                       reinterpret_cast<float*>(o), reinterpret_cast<int8_t*>(s), reinterpret_cast<int8_t*>(o),
                       up.data() + (r * f.units + j) * f.P);
        }
      }
      const bool sup = f.sup;
      BlockSrc s{q.data(),
                 k,
                 sup ? nullptr : reinterpret_cast<const float*>(sc.data()),
                 sup ? nullptr : reinterpret_cast<const float*>(of.data()),
                 sup ? sc.data() : nullptr,
                 sup ? of.data() : nullptr,
                 up.data(),
                 rows};
      uint8_t* block = dst + b * f.units * f.ubytes;
      std::memset(block, 0, f.units * f.ubytes);
      pack_block(f, s, block, row_buf.data());
    }
  });
}

// A GGUF tensor's values into out (float32 or bfloat16 [n, k]): per block, the integers and parameters of
// gguf_decode, then (q - zero) * scale, or q * scale + offset (scale = d * sub-scale, offset = -dmin *
// sub-min for the K-quants), in float32 and in that order (never fused into one rounding: the values of
// workers/gguf_repack.Repacked.dequantize bit for bit), rounded to out's dtype last. An embedding's rows.
__attribute__((optimize("fp-contract=off"))) void gguf_dequant(const at::Tensor& raw, int64_t type, int64_t n,
                                                                int64_t k, const at::Tensor& out) {
  const TypeInfo ti = type_info(type);
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte, "gguf_dequant: uint8 CPU bytes");
  TORCH_CHECK(k % ti.block == 0 && raw.numel() == n * (k / ti.block) * ti.bytes, "gguf_dequant: whole blocks");
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  TORCH_CHECK(out.is_contiguous() && out.sizes() == at::IntArrayRef({n, k}) &&
                  (bf16 || out.scalar_type() == at::kFloat),
              "gguf_dequant: out is float32 or bfloat16 [n, k]");
  const at::Tensor rc = raw.contiguous();
  const uint8_t* src = rc.const_data_ptr<uint8_t>();
  const int64_t per_row = k / ti.block, pper = ti.block / ti.group;
  const float zero = type == kQ4_0 ? 8.f : type == kQ5_0 ? 16.f : type == kQ6_K ? 32.f : 0.f;
  void* dst = out.mutable_data_ptr();
  at::parallel_for(0, n * per_row, 64, [&](int64_t b0, int64_t b1) {
    uint8_t q[256];
    float sc[16], of[16], sup[2], w[256];
    int8_t ss[16], sm[16];
    for (int64_t blk = b0; blk < b1; ++blk) {
      decode_block(type, src + blk * ti.bytes, q, sc, of, ss, sm, sup);
      for (int64_t g = 0; g < pper; ++g) {
        const float scale = ti.super() ? static_cast<float>(ss[g]) * sup[0] : sc[g];
        const float offset = ti.super() && ti.offsets ? static_cast<float>(sm[g]) * sup[1] : of[g];
        for (int j = 0; j < ti.group; ++j) {
          const int i = g * ti.group + j;
          const float v = type == kQ8_0 ? static_cast<float>(static_cast<int8_t>(q[i])) : static_cast<float>(q[i]);
          if (ti.offsets) {
            const float t = v * scale;
            w[i] = t + offset;
          } else {
            w[i] = (v - zero) * scale;
          }
        }
      }
      if (bf16) {
        auto* o = static_cast<c10::BFloat16*>(dst) + blk * ti.block;
        for (int i = 0; i < ti.block; ++i) o[i] = c10::BFloat16(w[i]);
      } else {
        std::memcpy(static_cast<float*>(dst) + blk * ti.block, w, ti.block * sizeof(float));
      }
    }
  });
}

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def("gguf_decode(Tensor raw, int type, int n, int k) -> (Tensor, Tensor, Tensor, Tensor)", gguf_decode);
  m.def("qpack(Tensor q, Tensor scales, Tensor offsets, Tensor supers, int kind, int group, int params) -> Tensor",
        qpack);
  m.def("gguf_pack(Tensor raw, int type, int n, int k, Tensor(a!) out, int kind, int group, int params) -> ()",
        gguf_pack);
  m.def("gguf_dequant(Tensor raw, int type, int n, int k, Tensor(a!) out) -> ()", gguf_dequant);
}
