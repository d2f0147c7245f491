// Decoding's attention on the host CPU: one query position, G query heads per key/value head.
// See host_attention.py for why and when.
//
// out (B, Hkv, G, D) = softmax(scale q k^T + mask) v for q (B, Hkv, G, D) and the cache's k, v
// (B, Hkv, S, D). Each (b, h) is one task: its G queries are widened to fp32 once, each key row
// is read once for all G queries (the scores), each value row once for all G outputs; scores,
// softmax and sums are fp32 and the output is rounded to q's dtype once. Slots the mask excludes
// are skipped, not multiplied: a static cache's unwritten slots cost nothing.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "host_vectors.h"

namespace {

using host_vectors::exp_nonpositive;
using host_vectors::Int;
using host_vectors::kLanes;
using host_vectors::kNegInf;
using host_vectors::load;
using host_vectors::sum_lanes;
using host_vectors::Vec;

constexpr int kGroup = 8;  // query heads per pass over a head's keys and values: their sums stay in registers
constexpr int kChunk = 2;  // vectors of a value row summed per pass over the slots: 8 heads x 2 of the registers


// A row of scores: S padded to whole vectors.
inline int64_t row_length(int64_t S) { return (S + kLanes - 1) / kLanes * kLanes; }

// The operands as element pointers and strides (in elements); D is contiguous in each.
template <typename T>
struct Operands {
  const T* q;
  const T* k;
  const T* v;
  T* out;                    // (B, Hkv, G, D), contiguous
  int64_t q_b, q_h, q_g;
  int64_t k_b, k_h, k_s;
  int64_t v_b, v_h, v_s;
  const bool* keep;          // a boolean mask (true: attend), or nullptr
  const float* add;          // an additive mask, or nullptr
  int64_t mask_b, mask_s;    // the mask's strides (mask_b 0: one row for every b)
  int64_t H, G, S, D;
  float scale;
};

// acc[g][d .. d + W * kLanes) = sum over s of e[g][s] v[s][same], v this head's values.
template <typename T, int NG, int W>
void values(const Operands<T>& p, const T* v, const float* e, int64_t padded, int64_t d, float* acc) {
  Vec sum[NG][W];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < W; ++j) sum[g][j] = Vec{};
  for (int64_t s = 0; s < p.S; ++s) {
    float weight[NG];
    bool any = false;
    for (int g = 0; g < NG; ++g) any |= (weight[g] = e[g * padded + s]) != 0.0f;
    if (!any) continue;
    const T* value = v + s * p.v_s + d;
    for (int j = 0; j < W; ++j) {
      const Vec vv = load(value + j * kLanes);
      for (int g = 0; g < NG; ++g) sum[g][j] += weight[g] * vv;
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < W; ++j) std::memcpy(acc + g * p.D + d + j * kLanes, &sum[g][j], sizeof(Vec));
}

// Queries g0 .. g0 + NG - 1 of head (b, h). scores: NG x row_length(S) floats; q32 and acc: NG x D floats.
template <typename T, int NG>
void heads(const Operands<T>& p, int64_t b, int64_t h, int64_t g0, float* q32, float* scores, float* acc) {
  const int64_t S = p.S, D = p.D, full = D / kLanes * kLanes, padded = row_length(S);
  const T* q = p.q + b * p.q_b + h * p.q_h + g0 * p.q_g;
  for (int g = 0; g < NG; ++g)
    for (int64_t d = 0; d < D; ++d) q32[g * D + d] = static_cast<float>(q[g * p.q_g + d]);
  const T* k = p.k + b * p.k_b + h * p.k_h;
  const T* v = p.v + b * p.v_b + h * p.v_h;
  const bool* keep = p.keep == nullptr ? nullptr : p.keep + b * p.mask_b;
  const float* add = p.add == nullptr ? nullptr : p.add + b * p.mask_b;

  // scores (NG, S): scale q.k + mask; -inf where the mask excludes the slot. Keys go kLanes at a
  // time: each key's NG dot-product vectors are parked in `dots`, then each query's kLanes vectors
  // are summed at once (sum_lanes), a fraction of the instructions of kLanes separate lane sums.
  float top[NG];
  for (int g = 0; g < NG; ++g) top[g] = kNegInf;
  for (int64_t s0 = 0; s0 < S; s0 += kLanes) {
    const int n = static_cast<int>(std::min<int64_t>(kLanes, S - s0));
    bool kept[kLanes];
    Vec dots[NG][kLanes];
    for (int i = 0; i < kLanes; ++i) {
      kept[i] = i < n && (keep == nullptr || keep[(s0 + i) * p.mask_s]);
      for (int g = 0; g < NG; ++g) dots[g][i] = Vec{};
      if (!kept[i]) continue;  // skipped, not multiplied
      const T* key = k + (s0 + i) * p.k_s;
      Vec dot[NG];  // in registers, parked once the key is done
      for (int g = 0; g < NG; ++g) dot[g] = Vec{};
      for (int64_t d = 0; d < full; d += kLanes) {
        const Vec kv = load(key + d);
        for (int g = 0; g < NG; ++g) dot[g] += load(q32 + g * D + d) * kv;
      }
      for (int g = 0; g < NG; ++g) dots[g][i] = dot[g];
    }
    for (int g = 0; g < NG; ++g) {
      float sums[kLanes];
      sum_lanes<kLanes>(dots[g], sums);
      for (int i = 0; i < n; ++i) {
        const int64_t s = s0 + i;
        float score = kNegInf;
        if (kept[i]) {
          const T* key = k + s * p.k_s;
          for (int64_t d = full; d < D; ++d) sums[i] += q32[g * D + d] * static_cast<float>(key[d]);
          score = sums[i] * p.scale + (add != nullptr ? add[s * p.mask_s] : 0.0f);
        }
        scores[g * padded + s] = score;
        top[g] = std::max(top[g], score);
      }
    }
  }
  // softmax's numerators, in place (the row padded with -inf to whole vectors), and their sums;
  // every slot excluded gives 0 / 0 = NaN, as torch's softmax of a row of -inf
  float total[NG];
  for (int g = 0; g < NG; ++g) {
    float* row = scores + g * padded;
    std::fill(row + S, row + padded, kNegInf);
    Vec sum{};
    if (top[g] != kNegInf) {
      for (int64_t s = 0; s < padded; s += kLanes) {
        const Vec e = exp_nonpositive(load(row + s) - top[g]);
        std::memcpy(row + s, &e, sizeof(Vec));
        sum += e;
      }
    } else {
      std::fill(row, row + padded, 0.0f);
    }
    sum_lanes<1>(&sum, &total[g]);
  }
  // acc (NG, D) = sum over s of e[g][s] v[s], kChunk vectors of D at a time so that their NG x
  // kChunk sums stay in registers through the slots; a slot whose weights are all 0 adds nothing
  int64_t d = 0;
  for (; d + kChunk * kLanes <= full; d += kChunk * kLanes) values<T, NG, kChunk>(p, v, scores, padded, d, acc);
  for (; d < full; d += kLanes) values<T, NG, 1>(p, v, scores, padded, d, acc);
  for (; d < D; ++d) {
    for (int g = 0; g < NG; ++g) {
      float sum = 0.0f;
      for (int64_t s = 0; s < S; ++s) sum += scores[g * padded + s] * static_cast<float>(v[s * p.v_s + d]);
      acc[g * D + d] = sum;
    }
  }
  T* out = p.out + ((b * p.H + h) * p.G + g0) * D;
  for (int g = 0; g < NG; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(acc[g * D + d] / total[g]);
}

template <typename T>
void group(const Operands<T>& p, int64_t b, int64_t h, int64_t g0, float* q32, float* scores, float* acc) {
  switch (std::min<int64_t>(kGroup, p.G - g0)) {
    case 1: return heads<T, 1>(p, b, h, g0, q32, scores, acc);
    case 2: return heads<T, 2>(p, b, h, g0, q32, scores, acc);
    case 3: return heads<T, 3>(p, b, h, g0, q32, scores, acc);
    case 4: return heads<T, 4>(p, b, h, g0, q32, scores, acc);
    case 5: return heads<T, 5>(p, b, h, g0, q32, scores, acc);
    case 6: return heads<T, 6>(p, b, h, g0, q32, scores, acc);
    case 7: return heads<T, 7>(p, b, h, g0, q32, scores, acc);
    default: return heads<T, kGroup>(p, b, h, g0, q32, scores, acc);
  }
}

template <typename T>
void attend(const Operands<T>& p, int64_t B) {
  at::parallel_for(0, B * p.H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q32(kGroup * p.D), scores(kGroup * row_length(p.S)), acc(kGroup * p.D);
    for (int64_t task = begin; task < end; ++task)
      for (int64_t g0 = 0; g0 < p.G; g0 += kGroup)
        group(p, task / p.H, task % p.H, g0, q32.data(), scores.data(), acc.data());
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "decode_attention: q (B, Hkv, G, D), k and v (B, Hkv, S, D) expected, got ", q.sizes(), ", ",
              k.sizes(), " and ", v.sizes());
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D && v.sizes() == k.sizes(),
              "decode_attention: k and v of shape (", B, ", ", H, ", S, ", D, ") expected, got ", k.sizes(),
              " and ", v.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "decode_attention: fp32 or bf16 q, k and v of one dtype expected");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "decode_attention: q, k and v with contiguous heads (stride 1 over D) expected");
  at::Tensor keep_mask, add_mask;
  int64_t mask_b = 0, mask_s = 0;
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.dim() == 4 && (m.size(0) == 1 || m.size(0) == B) && m.size(1) == 1 && m.size(2) == 1 &&
                    m.size(3) == S && (m.scalar_type() == at::kBool || m.scalar_type() == at::kFloat),
                "decode_attention: a boolean or fp32 mask of shape (B or 1, 1, 1, ", S, ") expected, got ",
                m.sizes(), " ", m.scalar_type());
    (m.scalar_type() == at::kBool ? keep_mask : add_mask) = m;
    mask_b = m.size(0) == 1 ? 0 : m.stride(0);
    mask_s = m.stride(3);
  }
  at::Tensor out = at::empty({B, H, G, D}, q.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const Operands<T> p{q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), out.data_ptr<T>(),
                        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                        v.stride(0), v.stride(1), v.stride(2),
                        keep_mask.defined() ? keep_mask.data_ptr<bool>() : nullptr,
                        add_mask.defined() ? add_mask.data_ptr<float>() : nullptr, mask_b, mask_s,
                        H, G, S, D, static_cast<float>(scale)};
    attend(p, B);
  };
  if (q.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(c10::BFloat16{});
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(polytrain, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(polytrain, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
