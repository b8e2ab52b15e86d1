// Ember CPU fast path: the small per-layer ops, fused so a decode step makes fewer torch calls.
//
// Built with the other csrc files by kernels/native.py; registered as torch.ops.ember.rotary_,
// silu_and_mul and write_kv. Each rounds exactly like the torch code it replaces (see the
// references in workers/models/layers.py and kernels/kv_write.py): in bf16/fp16 every intermediate
// that torch would store in the activation dtype is rounded to it here too.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// Rotate-half rotary on the first r elements of each [rows, D] head row, in place.
template <typename T>
void rotate_rows(T* base, int64_t T_, int64_t heads, int64_t s0, int64_t s1, const int64_t* pos,
                 const float* cos, const float* sin, int64_t table_stride, int64_t r) {
  const int64_t half = r / 2;
  at::parallel_for(0, T_ * heads, 64, [&](int64_t i0, int64_t i1) {
    std::vector<float> x(r);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / heads, h = i % heads;
      T* row = base + t * s0 + h * s1;
      const float* c = cos + pos[t] * table_stride;
      const float* s = sin + pos[t] * table_stride;
      for (int64_t j = 0; j < r; ++j) x[j] = static_cast<float>(row[j]);
      for (int64_t j = 0; j < r; ++j) {
        const float rot = j < half ? -x[j + half] : x[j - half];
        const float a = round_to<T>(x[j] * round_to<T>(c[j]));
        const float b = round_to<T>(rot * round_to<T>(s[j]));
        row[j] = static_cast<T>(a + b);
      }
    }
  });
}

}  // namespace

// q [T, H, D], k [T, Hkv, D] (last dim contiguous) rotated in place at `positions` [T]; cos/sin
// float32 [max_positions, r] tables (cast to the activation dtype before use, as HF does).
void rotary_(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
             const at::Tensor& sin, int64_t rotary_dim) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1, "rotary_: bad q/k");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "rotary_: q and k dtypes differ");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.size(1) >= rotary_dim && rotary_dim % 2 == 0 && rotary_dim <= q.size(2),
              "rotary_: bad tables");
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  const int64_t T = q.size(0);
  TORCH_CHECK(pos.numel() >= T && k.size(0) == T, "rotary_: positions do not cover the tokens");
  const int64_t* pp = pos.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos.size(0), "rotary_: position ", pp[t], " is outside the table");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_", [&] {
    const float* c = cos.const_data_ptr<float>();
    const float* s = sin.const_data_ptr<float>();
    const int64_t* p = pos.const_data_ptr<int64_t>();
    rotate_rows<scalar_t>(q.mutable_data_ptr<scalar_t>(), T, q.size(1), q.stride(0), q.stride(1), p, c, s,
                          cos.size(1), rotary_dim);
    rotate_rows<scalar_t>(k.mutable_data_ptr<scalar_t>(), T, k.size(1), k.stride(0), k.stride(1), p, c, s,
                          cos.size(1), rotary_dim);
  });
}

// x [T, 2I] = [gate | up] (last dim contiguous) -> silu(gate) * up [T, I], rounded like torch's two ops.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "silu_and_mul: bad input");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  at::Tensor out = at::empty({T, I}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), chunk = 512;  // columns per task
    const int64_t per_row = (I + chunk - 1) / chunk;
    at::parallel_for(0, T * per_row, 8, [&](int64_t i0, int64_t i1) {
      alignas(32) float act[chunk];
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = i / per_row, j0 = (i % per_row) * chunk, n = std::min(chunk, I - j0);
        const scalar_t* gate = xp + t * xs + j0;
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {  // silu(g) = g / (1 + exp(-g)), 8 at a time
          const __m256 g = load8(gate + j);
          const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
          _mm256_store_ps(act + j, _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
        }
        for (; j < n; ++j) {
          const float g = static_cast<float>(gate[j]);
          act[j] = g / (1.0f + std::exp(-g));
        }
        for (j = 0; j < n; ++j)
          op[t * I + j0 + j] = static_cast<scalar_t>(round_to<scalar_t>(act[j]) * static_cast<float>(gate[I + j]));
      }
    });
  });
  return out;
}

// key/value [T, Hkv, D] into caches [blocks, block_size, Hkv, D] at slot_mapping [T] (< 0: skip).
void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && k_cache.dim() == 4, "write_kv: bad shapes");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type(),
              "write_kv: dtypes differ");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "write_kv: rows must be contiguous");
  const int64_t T = key.size(0), Hkv = key.size(1), D = key.size(2), bs = k_cache.size(1);
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() >= T, "write_kv: slot_mapping is shorter than the tokens");
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const int64_t blocks = k_cache.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND3(at::kBFloat16, at::kHalf, at::kFloat8_e4m3fn, key.scalar_type(), "write_kv", [&] {
    const scalar_t* kp = key.const_data_ptr<scalar_t>();
    const scalar_t* vp = value.const_data_ptr<scalar_t>();
    scalar_t* kc = k_cache.mutable_data_ptr<scalar_t>();
    scalar_t* vc = v_cache.mutable_data_ptr<scalar_t>();
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = sp[t];
      if (slot < 0) continue;
      const int64_t blk = slot / bs, off = slot % bs;
      TORCH_CHECK(blk < blocks, "write_kv: slot ", slot, " is outside the cache");
      for (int64_t h = 0; h < Hkv; ++h) {
        std::copy(kp + t * key.stride(0) + h * key.stride(1), kp + t * key.stride(0) + h * key.stride(1) + D,
                  kc + blk * k_cache.stride(0) + off * k_cache.stride(1) + h * k_cache.stride(2));
        std::copy(vp + t * value.stride(0) + h * value.stride(1),
                  vp + t * value.stride(0) + h * value.stride(1) + D,
                  vc + blk * v_cache.stride(0) + off * v_cache.stride(1) + h * v_cache.stride(2));
      }
    }
  });
}

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def(
      "rotary_(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, int rotary_dim) -> ()",
      rotary_);
  m.def("silu_and_mul(Tensor x) -> Tensor", silu_and_mul);
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()",
        write_kv);
}
