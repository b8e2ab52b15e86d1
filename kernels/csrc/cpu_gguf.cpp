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
#include <c10/util/Half.h>
#include <torch/library.h>

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
        for (int w = 0; w < 32; ++w) {
          uint8_t v = j % 2 ? src[w] >> 4 : src[w] & 0x0F;
          if (t == kQ5_K) v |= ((qh[w] >> j) & 1) << 4;
          q[32 * j + w] = v;
        }
      }
      return;
    }
    case kQ6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      std::memcpy(ss, b + 192, 16);
      sup[0] = f16(b + 208);
      // weight i of the block: half c = i / 128; within it, quarter s = (i % 128) / 32, lane w = i % 32
      for (int i = 0; i < 256; ++i) {
        const int c = i / 128, s = (i % 128) / 32, w = i % 32;
        const int lo = s < 2 ? ql[64 * c + 32 * s + w] & 0x0F : ql[64 * c + 32 * (s - 2) + w] >> 4;
        const int hi = (qh[32 * c + w] >> (2 * s)) & 3;
        q[i] = static_cast<uint8_t>(lo | (hi << 4));  // u6, zero point 32
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

// q [N, K] (int8 or uint8: i8 bytes, or u4 / u5 values), scales [N, ceil(K / group)] and offsets (the same
// or empty); kind 0 i8 / 1 u4 / 2 u5 / 3 u6; params 0 / 1: scales and offsets float32, stored as float32 / float16;
// 2: int8 sub-scales and sub-mins, with supers float32 [N, K / 256, 1 or 2] (d, -dmin). The layout of
// kernels/qgemm.pack_qweight: uint8 [NB, units, unit bytes], zero past N and K.
at::Tensor qpack(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& offsets, const at::Tensor& supers,
                 int64_t kind, int64_t group, int64_t params) {
  TORCH_CHECK(q.dim() == 2 && q.device().is_cpu() && q.element_size() == 1, "qpack: q is [N, K] bytes");
  TORCH_CHECK(kind >= 0 && kind <= 3 && (group == 32 ? kind != 3 : group == 16 && (kind == 0 || kind == 3)),
              "qpack: bad format");
  TORCH_CHECK(params >= 0 && params <= 2, "qpack: params must be 0, 1 or 2");
  const bool sup = params == 2;
  const int64_t N = q.size(0), K = q.size(1), Kp = (K + 31) / 32 * 32, NB = (N + 15) / 16;
  const int64_t groups = Kp / group, G = scales.size(1), steps = group / 4;
  const bool has_off = offsets.numel() > 0;
  const int64_t P = has_off ? 2 : 1, subs = sup ? 256 / group : 1, units = groups / subs;
  TORCH_CHECK(scales.size(0) == N && G == (K + group - 1) / group, "qpack: one scale per row and group");
  TORCH_CHECK(!has_off || offsets.sizes() == scales.sizes(), "qpack: offsets shaped as the scales");
  TORCH_CHECK(!sup || (K % 256 == 0 && scales.scalar_type() == at::kChar &&
                       (!has_off || offsets.scalar_type() == at::kChar) &&
                       supers.sizes() == at::IntArrayRef({N, K / 256, P}) && supers.scalar_type() == at::kFloat),
              "qpack: superblocks need K a multiple of 256, int8 sub-parameters and float32 [N, K / 256, P]");
  const int64_t psize = params == 0 ? 4 : params == 1 ? 2 : 1, pbytes = P * 16 * psize;
  const int64_t step_bytes = kind == 0 ? 64 : 32, data = steps * step_bytes + (kind >= 2 ? 64 : 0);
  const int64_t sbytes = sup ? P * 64 : 0, gstride = pbytes + data, ubytes = sbytes + subs * gstride;
  const at::Tensor qc = q.contiguous(), sc = sup ? scales.contiguous() : scales.contiguous().to(at::kFloat);
  const at::Tensor oc = has_off ? (sup ? offsets.contiguous() : offsets.contiguous().to(at::kFloat)) : offsets;
  const at::Tensor uc = supers.contiguous();
  at::Tensor out = at::zeros({NB, units, ubytes}, q.options().dtype(at::kByte));
  const auto* qp = static_cast<const uint8_t*>(qc.const_data_ptr());
  const float *sp = sup ? nullptr : sc.const_data_ptr<float>();
  const float *op = has_off && !sup ? oc.const_data_ptr<float>() : nullptr;
  const auto* ss = sup ? static_cast<const uint8_t*>(sc.const_data_ptr()) : nullptr;
  const auto* sm = sup && has_off ? static_cast<const uint8_t*>(oc.const_data_ptr()) : nullptr;
  const float* up = sup ? uc.const_data_ptr<float>() : nullptr;
  uint8_t* dst = out.mutable_data_ptr<uint8_t>();
  auto put = [&](uint8_t* p, float v) {
    if (params == 1) {
      const uint16_t bits = c10::Half(v).x;
      std::memcpy(p, &bits, 2);
    } else {
      std::memcpy(p, &v, 4);
    }
  };
  // per row of a block: its bytes zero-padded to Kp, then 4 k at a time into each step (as uint32)
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint8_t> row_buf(Kp);
    for (int64_t b = b0; b < b1; ++b)
      for (int r = 0; r < 16; ++r) {
        const int64_t row = b * 16 + r;
        if (row >= N) break;
        std::memcpy(row_buf.data(), qp + row * K, K);
        std::fill(row_buf.begin() + K, row_buf.end(), 0);
        const int h = r / 8, i = r % 8;
        for (int64_t g = 0; g < groups; ++g) {
          uint8_t* head = dst + (b * units + g / subs) * ubytes;
          uint8_t* o = head + sbytes + (g % subs) * gstride;
          if (sup) {
            o[r] = ss[row * G + g];
            if (has_off) o[16 + r] = sm[row * G + g];
            if (g % subs == 0)
              for (int64_t p = 0; p < P; ++p) std::memcpy(head + 64 * p + 4 * r, up + (row * units + g / subs) * P + p, 4);
          } else if (g < G) {
            put(o + r * psize, sp[row * G + g]);
            if (has_off) put(o + (16 + r) * psize, op[row * G + g]);
          }
          uint8_t* d = o + pbytes;
          for (int64_t st = 0; st < steps; ++st) {
            uint32_t v;
            std::memcpy(&v, row_buf.data() + (g * steps + st) * 4, 4);
            uint32_t w;
            if (kind == 0) {
              std::memcpy(d + st * 64 + 32 * h + 4 * i, &v, 4);
              continue;
            }
            uint8_t* nib = d + st * 32 + 4 * i;
            std::memcpy(&w, nib, 4);
            w |= (v & 0x0F0F0F0Fu) << (4 * h);
            std::memcpy(nib, &w, 4);
            if (kind >= 2) {  // u5: bit st of each byte the fifth bit; u6: bits 2 st, 2 st + 1 the high two
              uint8_t* plane = d + steps * 32 + 32 * h + 4 * i;
              std::memcpy(&w, plane, 4);
              w |= kind == 2 ? ((v >> 4) & 0x01010101u) << st : ((v >> 4) & 0x03030303u) << (2 * st);
              std::memcpy(plane, &w, 4);
            }
          }
        }
      }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def("gguf_decode(Tensor raw, int type, int n, int k) -> (Tensor, Tensor, Tensor, Tensor)", gguf_decode);
  m.def("qpack(Tensor q, Tensor scales, Tensor offsets, Tensor supers, int kind, int group, int params) -> Tensor",
        qpack);
}
