// The chunked loss's softmax on the host CPU: see host_cross_entropy.py for why and when.
//
// For a chunk's logits (C, V) (this rank's V vocabulary rows), fp32 or bf16:
//   chunk_lse:  lse[c] = log sum_v e^logits[c][v] (fp32), and the sum over rows whose target is one
//               of these V of logits[c][target[c]];
//   chunk_grad: grad[c][v] = e^(logits[c][v] - lse[c]) - [v == target[c]], 0 on unscored rows, in
//               the logits' dtype: d(summed loss) / d logits.
// Each is one pass over the logits, a row at a time (a row of 32K fp32 logits is 128 KiB: read
// twice by chunk_lse, from L2), with every sum in fp32 and one rounding at the end.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "host_vectors.h"

namespace {

using host_vectors::exp_nonpositive;
using host_vectors::kLanes;
using host_vectors::kNegInf;
using host_vectors::load;
using host_vectors::Max;
using host_vectors::Plus;
using host_vectors::reduce_lanes;
using host_vectors::splat;
using host_vectors::store;
using host_vectors::Vec;


// Rows a thread takes at least: 2^16 logits (~30 us), so small chunks stay on the calling thread.
inline int64_t grain(int64_t V) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(V, 1)); }

template <typename T>
float row_lse(const T* row, int64_t V) {
  Vec top = splat(kNegInf);
  int64_t v = 0;
  for (; v + kLanes <= V; v += kLanes) {
    const Vec x = load(row + v);
    top = top > x ? top : x;
  }
  float m;
  reduce_lanes<1>(&top, &m, Max{});
  for (int64_t u = v; u < V; ++u) m = std::max(m, static_cast<float>(row[u]));
  if (m == kNegInf) return kNegInf;  // every logit -inf (or V = 0)
  Vec total{};
  for (v = 0; v + kLanes <= V; v += kLanes) total += exp_nonpositive(load(row + v) - m);
  float sum;
  reduce_lanes<1>(&total, &sum, Plus{});
  for (int64_t u = v; u < V; ++u) sum += std::exp(static_cast<float>(row[u]) - m);
  return m + std::log(sum);
}

template <typename T>
void lse_rows(const T* logits, int64_t C, int64_t V, int64_t stride, const int64_t* target, const bool* hit,
              float* lse, float* target_logit) {
  at::parallel_for(0, C, grain(V), [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const T* row = logits + c * stride;
      lse[c] = row_lse(row, V);
      target_logit[c] = hit[c] ? static_cast<float>(row[target[c]]) : 0.0f;
    }
  });
}

template <typename T>
void grad_rows(const T* logits, int64_t C, int64_t V, int64_t stride, const float* lse, const int64_t* target,
               const bool* hit, const bool* keep, T* grad) {
  at::parallel_for(0, C, grain(V), [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const T* row = logits + c * stride;
      T* out = grad + c * V;
      if (!keep[c]) {
        for (int64_t v = 0; v < V; ++v) out[v] = T(0.0f);
        continue;
      }
      const float shift = lse[c];
      int64_t v = 0;
      for (; v + kLanes <= V; v += kLanes) store(exp_nonpositive(load(row + v) - shift), out + v);
      for (; v < V; ++v) out[v] = T(std::exp(static_cast<float>(row[v]) - shift));
      if (hit[c]) {  // the target's probability minus one, rounded once
        const int64_t t = target[c];
        out[t] = T(std::exp(static_cast<float>(row[t]) - shift) - 1.0f);
      }
    }
  });
}

void check(const char* op, const at::Tensor& logits, const at::Tensor& target, const at::Tensor& hit) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              op, ": fp32 or bf16 logits (C, V) with contiguous rows expected, got ", logits.sizes(), " ",
              logits.scalar_type());
  const int64_t C = logits.size(0);
  TORCH_CHECK(target.dim() == 1 && target.size(0) == C && target.scalar_type() == at::kLong && target.is_contiguous(),
              op, ": int64 targets (", C, ",) expected");
  TORCH_CHECK(hit.dim() == 1 && hit.size(0) == C && hit.scalar_type() == at::kBool && hit.is_contiguous(), op,
              ": a boolean (", C, ",) of which targets are rows here expected");
  const int64_t* t = target.data_ptr<int64_t>();
  const bool* h = hit.data_ptr<bool>();
  for (int64_t c = 0; c < C; ++c)
    TORCH_CHECK(!h[c] || (t[c] >= 0 && t[c] < logits.size(1)), op, ": target ", t[c], " of row ", c,
                " is not one of the ", logits.size(1), " vocabulary rows");
}

std::tuple<at::Tensor, at::Tensor> chunk_lse(const at::Tensor& logits, const at::Tensor& target,
                                             const at::Tensor& hit) {
  check("chunk_lse", logits, target, hit);
  const int64_t C = logits.size(0), V = logits.size(1);
  at::Tensor lse = at::empty({C}, logits.options().dtype(at::kFloat));
  std::vector<float> target_logit(C);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    lse_rows(logits.data_ptr<T>(), C, V, logits.stride(0), target.data_ptr<int64_t>(), hit.data_ptr<bool>(),
             lse.data_ptr<float>(), target_logit.data());
  };
  logits.scalar_type() == at::kFloat ? run(float{}) : run(c10::BFloat16{});
  float total = 0.0f;  // in row order: the same bits on any thread count
  for (float x : target_logit) total += x;
  return {lse, at::zeros({}, logits.options().dtype(at::kFloat)).fill_(total)};
}

at::Tensor chunk_grad(const at::Tensor& logits, const at::Tensor& lse, const at::Tensor& target,
                      const at::Tensor& hit, const at::Tensor& keep) {
  check("chunk_grad", logits, target, hit);
  const int64_t C = logits.size(0), V = logits.size(1);
  TORCH_CHECK(lse.dim() == 1 && lse.size(0) == C && lse.scalar_type() == at::kFloat && lse.is_contiguous(),
              "chunk_grad: an fp32 lse (", C, ",) expected");
  TORCH_CHECK(keep.dim() == 1 && keep.size(0) == C && keep.scalar_type() == at::kBool && keep.is_contiguous(),
              "chunk_grad: a boolean keep (", C, ",) expected");
  at::Tensor grad = at::empty({C, V}, logits.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    grad_rows(logits.data_ptr<T>(), C, V, logits.stride(0), lse.data_ptr<float>(), target.data_ptr<int64_t>(),
              hit.data_ptr<bool>(), keep.data_ptr<bool>(), grad.data_ptr<T>());
  };
  logits.scalar_type() == at::kFloat ? run(float{}) : run(c10::BFloat16{});
  return grad;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(polytrain, m) {
  m.def("chunk_lse(Tensor logits, Tensor target, Tensor hit) -> (Tensor, Tensor)");
  m.def("chunk_grad(Tensor logits, Tensor lse, Tensor target, Tensor hit, Tensor keep) -> Tensor");
}

TORCH_LIBRARY_IMPL(polytrain, CPU, m) {
  m.impl("chunk_lse", &chunk_lse);
  m.impl("chunk_grad", &chunk_grad);
}
