// Ember's memory for packed CPU weights: `weight_empty`, used by the packing ops (cpu_gemm.cpp,
// cpu_amx.cpp, cpu_gguf.cpp) and, as torch.ops.ember.weight_empty, by the GGUF loader
// (workers/gguf_weights.pack_tensors), which has the native op write into it.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <cstdint>
#include <cstdlib>
#include <string>

#ifdef __linux__
#include <sys/mman.h>
#endif

// An uninitialized CPU tensor for a packed weight. With EMBER_HUGE_PAGES=1, one of 2 MiB and more gets
// memory of its own, mapped fresh and advised into transparent huge pages before its first write: a
// decode step streams every weight once, and on 4 KiB pages TLB misses cost a one-row K-quant product
// 3-18% of its stream in a 2-core Xeon VM (its nested page walks are long, and their cost moved with
// the host's load). Off by default, because the kernel zeroes each fresh 2 MiB page at load, which in
// that VM took 0.06-1.4 s per GB (more the less of the memory its host had backed before): Qwen 1.5B
// Q4_K_M's first token came 1.4 s later. Plain memory where huge pages are off (or not Linux).
at::Tensor weight_empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  static const bool wanted = [] {
    const char* v = std::getenv("EMBER_HUGE_PAGES");
    return v != nullptr && std::string(v) == "1";
  }();
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  int64_t numel = 1;
  for (const int64_t s : sizes) numel *= s;
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
#ifdef __linux__
  constexpr size_t kHuge = size_t{2} << 20, kPage = 4096;
  if (wanted && nbytes >= kHuge) {
    const size_t len = (nbytes + kPage - 1) / kPage * kPage;
    void* raw = mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw != MAP_FAILED) {
      // keep [start, start + len), 2 MiB aligned, of [base, base + len + 2 MiB)
      const uintptr_t base = reinterpret_cast<uintptr_t>(raw), start = (base + kHuge - 1) & ~(kHuge - 1);
      if (start > base) munmap(raw, start - base);
      munmap(reinterpret_cast<void*>(start + len), base + kHuge - start);  // > 0: start < base + 2 MiB
      void* data = reinterpret_cast<void*>(start);
      madvise(data, len, MADV_HUGEPAGE);  // declined where huge pages are off: plain pages then
      return at::from_blob(data, sizes, [len](void* p) { munmap(p, len); }, options);
    }
  }
#endif
  return at::empty(sizes, options);
}

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def("weight_empty(int[] size, ScalarType dtype) -> Tensor", weight_empty);
}
