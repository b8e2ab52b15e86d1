// The native CPU ops as C++ functions (defined in cpu_gemm.cpp, cpu_amx.cpp, cpu_dpbf16.cpp, cpu_qgemm.cpp,
// cpu_attention.cpp, cpu_layer_ops.cpp, cpu_moe.cpp and cpu_weights.cpp), for ops that chain them without going back
// to Python (cpu_decoder.cpp) and for the packing ops.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

at::Tensor weight_empty(at::IntArrayRef sizes, at::ScalarType dtype);  // EMBER_HUGE_PAGES=1: huge pages
at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n);
bool amx_ready();  // bf16 matmuls on AMX tiles: this build targets AMX-BF16 and the OS grants it
bool amx_claim();  // the tile-state request again (after a CRIU restore)
at::Tensor pack_amx(const at::Tensor& w);
at::Tensor gemm_amx(const at::Tensor& x, const at::Tensor& packed, int64_t n);
at::Tensor pairs_output(const at::Tensor& x, const at::Tensor& packed, int64_t n, at::Tensor& xc);
void bf16_terms(const at::Tensor& xc, int terms, int64_t Mp, int64_t Kp, uint16_t* dst);  // x as bf16 terms
bool dpbf16_built();  // the AVX512-BF16 kernels of cpu_dpbf16.cpp (the "pairs32" layout, AMX's bytes)
at::Tensor gemm_dpbf16(const at::Tensor& x, const at::Tensor& packed, int64_t n);
at::Tensor gemm_fp8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t n);
at::Tensor qgemm(const at::Tensor& x, const at::Tensor& packed, int64_t fmt, int64_t group, int64_t zero,
                 bool offsets, int64_t params, int64_t n);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rotary_(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
             const at::Tensor& sin, int64_t rotary_dim);
at::Tensor silu_and_mul(const at::Tensor& x);
void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slot_mapping);
at::Tensor moe_forward(const at::Tensor& x, at::TensorList params, at::TensorList weights, at::TensorList scales,
                       at::IntArrayRef specs, at::IntArrayRef dims, double routed_scale, const at::Tensor& load);
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                      double softcap, const at::Tensor& kv_scales, const at::Tensor& out);

// One linear of a group product (cpu_moe.cpp): out [rows of x, sum of the segments' rows] = x @ W^T,
// W given as segments, each a packed tensor, its fp8 scale (or empty) and 6 ints (kind: a qgemm format,
// -1 packed bf16, -2 fp8; group, zero, offsets, params, rows), as cpu_decoder.cpp's specs.
constexpr int64_t kSegBf16 = -1, kSegFp8 = -2;  // segment kinds besides the qgemm formats
constexpr int64_t kSegInts = 6;                 // ints per segment in a spec
struct LinearJob {
  at::Tensor x;
  std::vector<const at::Tensor*> packed, scales;
  std::vector<const int64_t*> specs;
  at::Tensor out;  // allocated by grouped_linears
};
// x @ W^T for output rows [16 b0, 16 (b0 + nb)) of one segment (its packed tensor, fp8 scale and 6 ints).
at::Tensor segment_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const int64_t* spec,
                          int64_t b0, int64_t nb);
// Every job's product in one parallel region: the threads take (job, segment, block range) items in turn.
void grouped_linears(std::vector<LinearJob>& jobs);
