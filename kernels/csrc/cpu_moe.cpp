// Ember CPU fast path: a mixture-of-experts MLP in one call.
//
// Built with the other csrc files by kernels/native.py, registered as torch.ops.ember.moe_forward and
// called by the one-call decoder layers (cpu_decoder.cpp). The phases, each named below:
//   route:   the router's float32 logits and each token's top-k (softmax then top-k, top-k then softmax,
//            or DeepSeek-V3 / GLM-4.5's sigmoid with the correction bias and grouped top-k);
//   group:   the (token, slot) pairs grouped by expert, each expert's rows gathered;
//   experts: the selected experts' gate/up, activation and down matmuls as one list of work items
//            (expert, weight segment, a range of its blocks of 16 output rows) that the threads take one at a time,
//            so a decode step reads only the selected experts' bytes and one thread pool serves all of
//            them (the matmuls are the native ops of cpu_ops.h, run single-threaded inside an item);
//            a decode step's few rows per expert take whole experts as items instead (run_whole_experts);
//   combine: per token its experts' outputs times their weights, in expert order, summed in float32,
//            plus the shared expert (times its sigmoid gate where there is one).
// The torch reference is workers/models/moe.py (route, experts_reference): the same routing, the same
// matmuls and float32 sums in the same order.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kSoftmax = 0, kTopkSoftmax = 1, kSigmoid = 2;  // moe.py's SCORINGS
constexpr int64_t kActSilu = 0, kActGeluTanh = 1;
constexpr int64_t kItemBlocks = 8;  // the fewest blocks of 16 output rows in a work item
constexpr int64_t kItemsPerThread = 4;  // work items per thread (more: finer balance, more fixed costs)

// dims of moe_forward, in order
struct Dims {
  int64_t experts, top_k, scoring, renormalize, act, groups, topk_groups, shared, shared_gate;
};

// The segments of 2 linears (gate_up, down) per expert, from cpu_decoder.cpp's spec layout (x unset).
std::vector<LinearJob> read_linears(at::TensorList weights, at::TensorList scales, at::IntArrayRef specs) {
  std::vector<LinearJob> lins;
  size_t w = 0, s = 0;
  while (s < specs.size()) {
    LinearJob lin;
    const int64_t count = specs[s++];
    for (int64_t k = 0; k < count; ++k, s += kSegInts, ++w) {
      TORCH_CHECK(w < weights.size() && s + kSegInts <= specs.size(), "moe_forward: specs do not match the weights");
      lin.packed.push_back(&weights[w]);
      lin.scales.push_back(&scales[w]);
      lin.specs.push_back(specs.data() + s);
    }
    lins.push_back(std::move(lin));
  }
  TORCH_CHECK(w == weights.size(), "moe_forward: specs do not match the weights");
  return lins;
}

// Indices of the k largest of v[0..n) (ties: the lower index first), in descending order.
void top_indices(const float* v, int64_t n, int64_t k, int64_t* out) {
  std::vector<int64_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
  std::copy(idx.begin(), idx.begin() + k, out);
}

// route: one token's experts and weights from its logits.
void route_token(const float* logits, const float* bias, const Dims& d, double scale, int64_t* ids, float* w) {
  const int64_t E = d.experts, K = d.top_k;
  std::vector<float> p(logits, logits + E);
  if (d.scoring == kTopkSoftmax) {
    top_indices(p.data(), E, K, ids);
    float mx = p[ids[0]], sum = 0.0f;
    for (int64_t j = 0; j < K; ++j) sum += (w[j] = std::exp(p[ids[j]] - mx));
    for (int64_t j = 0; j < K; ++j) w[j] /= sum;
    return;
  }
  if (d.scoring == kSoftmax) {
    const float mx = *std::max_element(p.begin(), p.end());
    float sum = 0.0f;
    for (auto& v : p) sum += (v = std::exp(v - mx));
    for (auto& v : p) v /= sum;
    top_indices(p.data(), E, K, ids);
    for (int64_t j = 0; j < K; ++j) w[j] = p[ids[j]];
  } else {  // sigmoid scores; the choice adds the correction bias, within the best groups
    std::vector<float> choice(E);
    for (int64_t e = 0; e < E; ++e) {
      p[e] = 1.0f / (1.0f + std::exp(-p[e]));
      choice[e] = p[e] + (bias ? bias[e] : 0.0f);
    }
    if (d.groups > 1) {
      const int64_t size = E / d.groups;
      std::vector<float> gscore(d.groups);
      for (int64_t g = 0; g < d.groups; ++g) {  // a group's score: its two best choices
        int64_t best[2];
        top_indices(choice.data() + g * size, size, std::min<int64_t>(2, size), best);
        gscore[g] = choice[g * size + best[0]] + (size > 1 ? choice[g * size + best[1]] : 0.0f);
      }
      std::vector<int64_t> keep(d.topk_groups);
      top_indices(gscore.data(), d.groups, d.topk_groups, keep.data());
      std::vector<char> kept(d.groups, 0);
      for (int64_t g : keep) kept[g] = 1;
      for (int64_t e = 0; e < E; ++e)
        if (!kept[e / size]) choice[e] = -INFINITY;
    }
    top_indices(choice.data(), E, K, ids);
    for (int64_t j = 0; j < K; ++j) w[j] = p[ids[j]];
  }
  if (d.renormalize) {
    float sum = d.scoring == kSigmoid ? 1e-20f : 0.0f;
    for (int64_t j = 0; j < K; ++j) sum += w[j];
    for (int64_t j = 0; j < K; ++j) w[j] /= sum;
  }
  if (scale != 1.0)
    for (int64_t j = 0; j < K; ++j) w[j] *= static_cast<float>(scale);
}

// x [T, H] @ w^T in float32 ([T, E]): a plain loop for a few rows (a decode step: no thread team for
// a product this small), torch's matmul for more.
at::Tensor router_logits(const at::Tensor& x, const at::Tensor& w) {
  constexpr int64_t kFewRows = 4;
  if (x.size(0) > kFewRows) return at::matmul(x, w.t()).contiguous();
  const at::Tensor wc = w.contiguous(), xc = x.contiguous();
  const int64_t T = xc.size(0), E = wc.size(0), H = wc.size(1);
  at::Tensor out = at::empty({T, E}, xc.options());
  const float *xp = xc.const_data_ptr<float>(), *wp = wc.const_data_ptr<float>();
  float* o = out.mutable_data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      float acc[8] = {};  // 8 running sums (vectorizable), added at the end
      int64_t h = 0;
      for (; h + 8 <= H; h += 8)
        for (int j = 0; j < 8; ++j) acc[j] += xp[t * H + h + j] * wp[e * H + h + j];
      for (; h < H; ++h) acc[0] += xp[t * H + h] * wp[e * H + h];
      o[t * E + e] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
  return out;
}

template <typename T>
void gather_rows(const at::Tensor& x, const std::vector<int64_t>& rows, at::Tensor& out) {
  const int64_t H = x.size(1);
  const T* src = x.const_data_ptr<T>();
  T* dst = out.mutable_data_ptr<T>();
  for (size_t i = 0; i < rows.size(); ++i) std::memcpy(dst + i * H, src + rows[i] * H, H * sizeof(T));
}

template <typename T>
inline float value(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

}  // namespace

// Output rows [16 b0, 16 (b0 + nb)) of one weight segment for x (see cpu_ops.h).
at::Tensor segment_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const int64_t* spec,
                          int64_t b0, int64_t nb) {
  const int64_t n = std::min(nb * 16, spec[5] - b0 * 16);
  const at::Tensor w = packed.narrow(0, b0, nb);
  if (spec[0] == kSegBf16) return gemm_bf16(x, w, n);
  if (spec[0] == kSegFp8) return gemm_fp8(x, w, scale, n);
  return qgemm(x, w, spec[0], spec[1], spec[2], spec[3] != 0, spec[4], n);
}

// Every job's product in one parallel region (see cpu_ops.h): items of a block range of one segment,
// as large as leave each thread kItemsPerThread of them (an item's calls have fixed costs).
void grouped_linears(std::vector<LinearJob>& jobs) {
  struct Item {
    size_t job, seg;
    int64_t b0, nb, col;
  };
  std::vector<Item> items;
  int64_t total = 0;  // blocks of all the segments
  for (const LinearJob& job : jobs)
    for (const at::Tensor* packed : job.packed) total += packed->size(0);
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max(kItemBlocks, (total + kItemsPerThread * threads - 1) / (kItemsPerThread * threads));
  for (size_t j = 0; j < jobs.size(); ++j) {
    LinearJob& job = jobs[j];
    int64_t col = 0;
    for (size_t s = 0; s < job.packed.size(); ++s) {
      const int64_t blocks = job.packed[s]->size(0);
      for (int64_t b0 = 0; b0 < blocks; b0 += chunk)
        items.push_back({j, s, b0, std::min(chunk, blocks - b0), col + b0 * 16});
      col += job.specs[s][5];
    }
    job.out = at::empty({job.x.size(0), col}, job.x.options());
  }
  std::atomic<size_t> next{0};
  at::parallel_for(0, std::min<int64_t>(threads, static_cast<int64_t>(items.size())), 1, [&](int64_t, int64_t) {
    for (size_t i = next++; i < items.size(); i = next++) {
      const Item& it = items[i];
      LinearJob& job = jobs[it.job];
      const at::Tensor part = segment_matmul(job.x, *job.packed[it.seg], *job.scales[it.seg], job.specs[it.seg], it.b0, it.nb);
      const int64_t rows = part.size(0), size = part.element_size(), bytes = part.size(1) * size;
      auto* dst = static_cast<char*>(job.out.data_ptr()) + it.col * size;
      const auto* src = static_cast<const char*>(part.const_data_ptr());
      for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * job.out.size(1) * size, src + r * bytes, bytes);
    }
  });
}

namespace {

// experts: linear `which` (0 gate_up, 1 down) of every active expert over its inputs, into outs.
void run_experts(const std::vector<LinearJob>& lins, int which, const std::vector<int64_t>& active,
                 const std::vector<at::Tensor>& ins, std::vector<at::Tensor>& outs) {
  std::vector<LinearJob> jobs;
  for (int64_t e : active) {
    jobs.push_back(lins[2 * e + which]);
    jobs.back().x = ins[e];
  }
  grouped_linears(jobs);
  for (size_t j = 0; j < active.size(); ++j) outs[active[j]] = jobs[j].out;
}

at::Tensor activate(const at::Tensor& gate_up, int64_t act) {
  if (act == kActSilu) return silu_and_mul(gate_up);
  TORCH_CHECK(act == kActGeluTanh, "moe_forward: unknown activation");
  const int64_t inter = gate_up.size(1) / 2;
  return at::mul(at::gelu(gate_up.narrow(1, 0, inter), "tanh"), gate_up.narrow(1, inter, inter));
}

// One linear over all its segments, on this thread (inside a work item): x @ W^T, the segments' outputs
// side by side.
at::Tensor linear_whole(const LinearJob& lin, const at::Tensor& x) {
  std::vector<at::Tensor> parts;
  int64_t cols = 0;
  for (size_t s = 0; s < lin.packed.size(); ++s) {
    const at::Tensor& packed = *lin.packed[s];
    parts.push_back(segment_matmul(x, packed, *lin.scales[s], lin.specs[s], 0, packed.size(0)));
    cols += parts.back().size(1);
  }
  if (parts.size() == 1) return parts[0];
  at::Tensor out = at::empty({x.size(0), cols}, parts[0].options());
  int64_t col = 0;
  for (const at::Tensor& part : parts) {
    out.narrow(1, col, part.size(1)).copy_(part);
    col += part.size(1);
  }
  return out;
}

// experts, a whole expert per work item: gate_up, activation and down of one expert on one thread, the
// threads taking experts in turn. For decode steps (every active expert has at most kWholeRows rows and
// each thread gets several experts): no barrier between the two products, no parallel region for the
// activations. The same products as run_experts', row for row.
constexpr int64_t kWholeRows = 4;
bool whole_experts(const std::vector<int64_t>& active, const std::vector<at::Tensor>& ins) {
  const auto threads = static_cast<size_t>(at::get_num_threads());
  if (threads < 2 || active.size() < 2 * threads) return false;
  return std::all_of(active.begin(), active.end(), [&](int64_t e) { return ins[e].size(0) <= kWholeRows; });
}

void run_whole_experts(const std::vector<LinearJob>& lins, const std::vector<int64_t>& active,
                       const std::vector<at::Tensor>& ins, int64_t act, std::vector<at::Tensor>& outs) {
  std::atomic<size_t> next{0};
  const auto threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(active.size()));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (size_t i = next++; i < active.size(); i = next++) {
      const int64_t e = active[i];
      outs[e] = linear_whole(lins[2 * e + 1], activate(linear_whole(lins[2 * e], ins[e]), act));
    }
  });
}

}  // namespace

// x [T, H] (float32 / bf16 / half, contiguous). params: the router's weight [E, H] float32, the
// correction bias [E] float32 (sigmoid scoring; or empty), the shared expert's gate [1, H] float32
// (or empty). weights / scales / specs: per expert (then the shared expert) its gate_up and down
// linears' segments, as cpu_decoder.cpp's (scales: one per segment, empty but for fp8). dims: experts,
// top_k, scoring, renormalize, activation, groups, groups kept, shared expert, shared gate.
// routed_scale multiplies the routed weights. load: int64 [E] (or empty), each expert's token count
// added. Returns [T, H] in x's dtype (partial sums under tensor parallelism: the caller reduces).
at::Tensor moe_forward(const at::Tensor& x, at::TensorList params, at::TensorList weights, at::TensorList scales,
                       at::IntArrayRef specs, at::IntArrayRef dims_, double routed_scale, const at::Tensor& load) {
  TORCH_CHECK(dims_.size() == 9 && params.size() == 3, "moe_forward: 9 dims and 3 params");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "moe_forward: x must be a contiguous [T, H]");
  TORCH_CHECK(weights.size() == scales.size(), "moe_forward: one scale per weight segment");
  const Dims d{dims_[0], dims_[1], dims_[2], dims_[3], dims_[4], dims_[5], dims_[6], dims_[7], dims_[8]};
  const int64_t T = x.size(0), H = x.size(1), E = d.experts, K = d.top_k;
  TORCH_CHECK(K > 0 && K <= E && (d.groups <= 1 || (E % d.groups == 0 && d.topk_groups <= d.groups)),
              "moe_forward: bad top-k or groups");
  const std::vector<LinearJob> lins = read_linears(weights, scales, specs);
  TORCH_CHECK(static_cast<int64_t>(lins.size()) == 2 * (E + d.shared), "moe_forward: 2 linears per expert");
  const at::Tensor& router = params[0];
  TORCH_CHECK(router.scalar_type() == at::kFloat && router.size(0) == E && router.size(1) == H,
              "moe_forward: the router must be float32 [E, H]");
  const at::Tensor& bias = params[1];
  TORCH_CHECK(!bias.numel() || (bias.scalar_type() == at::kFloat && bias.numel() == E && bias.is_contiguous()),
              "moe_forward: the correction bias must be float32 [E]");

  // route
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  const at::Tensor logits = router_logits(xf, router);
  std::vector<int64_t> ids(T * K);
  std::vector<float> w(T * K);
  const float* lp = logits.const_data_ptr<float>();
  const float* bp = bias.numel() ? bias.const_data_ptr<float>() : nullptr;
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) route_token(lp + t * E, bp, d, routed_scale, &ids[t * K], &w[t * K]);
  });

  // group: per expert its (token, slot) pairs in token order; per token its experts in expert order
  std::vector<std::vector<int64_t>> rows(E + d.shared);
  for (int64_t i = 0; i < T * K; ++i) rows[ids[i]].push_back(i);
  if (load.numel()) {
    TORCH_CHECK(load.scalar_type() == at::kLong && load.numel() == E, "moe_forward: load must be int64 [E]");
    int64_t* lc = load.mutable_data_ptr<int64_t>();
    for (int64_t e = 0; e < E; ++e) lc[e] += static_cast<int64_t>(rows[e].size());
  }
  std::vector<int64_t> active;
  std::vector<at::Tensor> ins(E + d.shared), mids(E + d.shared), outs(E + d.shared);
  for (int64_t e = 0; e < E; ++e) {
    if (rows[e].empty()) continue;
    std::vector<int64_t> tokens(rows[e].size());
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = rows[e][i] / K;
    ins[e] = at::empty({static_cast<int64_t>(tokens.size()), H}, x.options());
    if (x.scalar_type() == at::kBFloat16) gather_rows<c10::BFloat16>(x, tokens, ins[e]);
    else if (x.scalar_type() == at::kHalf) gather_rows<c10::Half>(x, tokens, ins[e]);
    else gather_rows<float>(x, tokens, ins[e]);
    active.push_back(e);
  }
  if (d.shared && T) {
    ins[E] = x;
    active.push_back(E);
  }

  // experts
  if (whole_experts(active, ins)) {
    run_whole_experts(lins, active, ins, d.act, outs);
  } else {
    run_experts(lins, 0, active, ins, mids);
    for (int64_t e : active) mids[e] = activate(mids[e], d.act);
    run_experts(lins, 1, active, mids, outs);
  }

  // combine
  std::vector<float> gate(d.shared_gate ? T : 0);
  if (d.shared_gate) {
    const at::Tensor g = router_logits(xf, params[2]);
    for (int64_t t = 0; t < T; ++t) gate[t] = 1.0f / (1.0f + std::exp(-g.const_data_ptr<float>()[t]));
  }
  std::vector<int64_t> where(T * K);  // (token, slot) -> its row in its expert's output
  for (int64_t e = 0; e < E; ++e)
    for (size_t r = 0; r < rows[e].size(); ++r) where[rows[e][r]] = static_cast<int64_t>(r);
  at::Tensor out = at::empty({T, H}, x.options());
  auto combine = [&](auto* o) {
    using T_ = std::remove_pointer_t<decltype(o)>;
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> acc(H);
      std::vector<int64_t> slots(K);
      for (int64_t t = t0; t < t1; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        std::iota(slots.begin(), slots.end(), t * K);
        std::sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
        for (int64_t i : slots) {
          const T_* y = outs[ids[i]].const_data_ptr<T_>() + where[i] * H;
          for (int64_t h = 0; h < H; ++h) acc[h] += value(y, h) * w[i];
        }
        if (d.shared) {
          const T_* y = outs[E].const_data_ptr<T_>() + t * H;
          const float g = d.shared_gate ? gate[t] : 1.0f;
          for (int64_t h = 0; h < H; ++h) acc[h] += value(y, h) * g;
        }
        for (int64_t h = 0; h < H; ++h) o[t * H + h] = static_cast<T_>(acc[h]);
      }
    });
  };
  if (x.scalar_type() == at::kBFloat16) combine(out.mutable_data_ptr<c10::BFloat16>());
  else if (x.scalar_type() == at::kHalf) combine(out.mutable_data_ptr<c10::Half>());
  else combine(out.mutable_data_ptr<float>());
  return out;
}

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def(
      "moe_forward(Tensor x, Tensor[] params, Tensor[] weights, Tensor[] scales, int[] specs, int[] dims, "
      "float routed_scale, Tensor(a!) load) -> Tensor",
      moe_forward);
}
