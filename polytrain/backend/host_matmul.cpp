// y (M, N) = x (M, K) @ w (N, K)^T [+ bias (N)] for a few rows M, each weight streamed from
// memory once. See host_matmul.py for why and when.
//
// Decoding multiplies a handful of rows (one token per sequence) by every weight of the model,
// so its time is the time to read the weights. The BLAS's GEMM packs a panel of the weight
// before multiplying it, and at 2-16 rows that packing is most of the work: it reads llama
// 125m's weights at 7-13 GB/s where the memory gives 25. Here each thread walks its own
// contiguous block of the weight's rows with the rows of x in L1, and each weight element is
// loaded once and used for all M rows of x. Two weight rows are walked side by side, each x
// vector loaded serving both, while the rows two pairs ahead are prefetched into L2: the
// memory then streams while the core multiplies. Where x's rows are too long for L1 beside the
// weight rows, a group of tiles runs over one block of inputs at a time, each tile's partial
// sums kept in a buffer between blocks: the same additions in the same order, so the bits do
// not depend on the blocking, the row count or the threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "host_vectors.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__linux__)
#define POLYTRAIN_AMX 1
#include "host_matmul_amx.h"
#endif

namespace {

using host_vectors::kLanes;
using host_vectors::load;
using host_vectors::store;
using host_vectors::sum_lanes;
using host_vectors::Vec;

#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kRowBlock = 8;  // rows of x per pass over a weight row: 8 accumulators, 32 registers
#else
constexpr int kRowBlock = 4;  // 16 registers
#endif
constexpr int kTileN = 16;            // weight rows whose sums are finished together (sum_lanes: 16 at once)
constexpr int64_t kGrainTiles = 2;    // tiles per thread at least: tiny weights stay on one thread
constexpr int64_t kXBytes = 32 * 1024;  // of x's rows per pass over a block of inputs: L1 beside the weight rows
constexpr int64_t kGroupTiles = 8;    // tiles per group: their partial sums (kTileN x M vectors each) stay in L2

// How a tile multiplies a weight row by a row of x, kStep inputs at a time into kLanes fp32 sums.
// Widened: x widened to fp32 once per call (X = float), each weight vector widened in registers
// (bf16) and multiplied and added with one FMA per kLanes inputs.
template <typename T>
struct Widened {
  using X = float;
  using Weights = Vec;
  static constexpr int kStep = kLanes;
  static Weights load_weights(const T* p) { return load(p); }
  static Vec multiply_add(Vec acc, Weights w, const float* x) { return acc + w * load(x); }
};

#if defined(__AVX512BF16__)
// Paired (bf16 on CPUs with AVX512-BF16: Zen 4, Cooper Lake, Sapphire Rapids): x and the weight
// as they are; one VDPBF16PS adds to each of 16 fp32 lanes the products of a pair of neighbouring
// inputs, 32 inputs an instruction, where widening costs a conversion and an FMA per 16. A bf16
// product is exact in fp32 and each is added with one rounding, as an FMA adds it; but inputs
// below 2^-126 read as zero, as on AMX. x is not widened either: half the bytes in L1.
struct Paired {
  using X = c10::BFloat16;
  using Weights = __m512bh;
  static constexpr int kStep = 2 * kLanes;
  static Weights load_weights(const c10::BFloat16* p) {
    Weights w;
    std::memcpy(&w, p, sizeof(w));  // one unaligned 64-byte load
    return w;
  }
  static Vec multiply_add(Vec acc, Weights w, const c10::BFloat16* x) {
    return reinterpret_cast<Vec>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc), w, load_weights(x)));
  }
};
#endif

// P neighbouring weight rows against MB rows of x (rows of K elements) over inputs k0 .. k1-1
// (k1 - k0 a multiple of kStep): kLanes-wide partial sums (weight row p, x row m at
// sums[m * kTileN + p]), started from `sums` unless k0 is 0, and left there. Each weight vector
// loaded serves MB rows of x, each x vector P weight rows.
template <typename Way, int P, int MB, typename T>
void rows_pass(const typename Way::X* x, const T* rows, int64_t K, int64_t k0, int64_t k1, Vec* sums) {
  Vec acc[P][MB];
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) acc[p][m] = k0 == 0 ? Vec{} : sums[m * kTileN + p];
  for (int64_t k = k0; k < k1; k += Way::kStep) {
    typename Way::Weights w[P];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      // The rows two passes ahead (past the end: a no-op) into L2, not L1 (locality 2: prefetcht1),
      // where they would compete with x's rows.
      if constexpr (P > 1) __builtin_prefetch(rows + (2 * P + p) * K + k, 0, 2);
      w[p] = Way::load_weights(rows + p * K + k);
    }
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p) acc[p][m] = Way::multiply_add(acc[p][m], w[p], x + m * K + k);
  }
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) sums[m * kTileN + p] = acc[p][m];
}

template <typename Way, int P, typename T>
void rows_pass(int MB, const typename Way::X* x, const T* rows, int64_t K, int64_t k0, int64_t k1, Vec* sums) {
  switch (MB) {
    case 1: return rows_pass<Way, P, 1>(x, rows, K, k0, k1, sums);
    case 2: return rows_pass<Way, P, 2>(x, rows, K, k0, k1, sums);
    case 3: return rows_pass<Way, P, 3>(x, rows, K, k0, k1, sums);
    case 4: return rows_pass<Way, P, 4>(x, rows, K, k0, k1, sums);
    case 5: return rows_pass<Way, P, 5>(x, rows, K, k0, k1, sums);
    case 6: return rows_pass<Way, P, 6>(x, rows, K, k0, k1, sums);
    case 7: return rows_pass<Way, P, 7>(x, rows, K, k0, k1, sums);
    default: return rows_pass<Way, P, kRowBlock>(x, rows, K, k0, k1, sums);
  }
}

// The outputs of weight rows n .. n+TN-1 for the M rows of x (y's rows, stride N) from their
// partial sums (weight row j, x row m at sums[m * kTileN + j]): each lane sum, plus the scalar
// tail of k (K % kStep) and the bias. A whole tile without a tail is finished kLanes outputs at a
// time: the same additions as the scalar path, in vectors.
template <typename Way, typename T>
void finish(const typename Way::X* x, const T* w, const T* bias, T* y, int64_t M, int64_t K, int64_t N,
            int64_t n, int64_t TN, const Vec* sums) {
  const int64_t full = K / Way::kStep * Way::kStep;
  alignas(64) float totals[kTileN];
  for (int64_t m = 0; m < M; ++m) {
    sum_lanes<kTileN>(sums + m * kTileN, totals);  // rows past TN (the last tile): summed, not written
    if (TN == kTileN && full == K) {
      for (int v = 0; v < kTileN; v += kLanes) {
        Vec out = load(totals + v);
        if (bias != nullptr) out += load(bias + n + v);
        store(out, y + m * N + n + v);
      }
      continue;
    }
    for (int64_t j = 0; j < TN; ++j) {
      const T* row = w + (n + j) * K;
      float s = totals[j];
      for (int64_t k = full; k < K; ++k) s += static_cast<float>(x[m * K + k]) * static_cast<float>(row[k]);
      if (bias != nullptr) s += static_cast<float>(bias[n + j]);
      y[m * N + n + j] = static_cast<T>(s);
    }
  }
}

// One tile: weight rows n .. n+TN-1 over inputs k0 .. k1-1 against every block of kRowBlock rows
// of x, two weight rows at a time (one at a time in a tile of odd TN: only the last can be).
// What the memory gives hinges on the prefetch: into L1 it competed with x's rows and a single
// row read front to back beat two side by side; into L2, two passes ahead, two side by side read
// llama 125m's weights 1.0-1.3x faster than one row at a time at 1-2 rows of x and 1.4-1.8x at
// 4, and 1.1-1.6x faster at 8 than with the prefetch into L1 (bf16 and fp32, a 2-core Zen 4
// EPYC; benchmarks/RESULTS.md as of commit fc66cd9, "Weight rows prefetched into L2 ...").
// `sums` holds the tile's partial sums, block after block (kTileN x MB each: kTileN x M in all);
// at K they are finished into y.
template <typename T, typename Way>
void tile(const typename Way::X* x, const T* w, const T* bias, T* y, int64_t M, int64_t K, int64_t N,
          int64_t n, int64_t k0, int64_t k1, Vec* sums) {
  const int64_t TN = std::min<int64_t>(kTileN, N - n);
  const int64_t pass_end = std::min(k1, K / Way::kStep * Way::kStep);
  const int P = TN % 2 == 0 ? 2 : 1;
  for (int64_t j = 0; j < TN; j += P) {
    const T* rows = w + (n + j) * K;
    for (int64_t m = 0; m < M; m += kRowBlock) {
      const int MB = static_cast<int>(std::min<int64_t>(kRowBlock, M - m));
      Vec* s = sums + kTileN * m + j;
      if (P == 2) {
        rows_pass<Way, 2>(MB, x + m * K, rows, K, k0, pass_end, s);
      } else {
        rows_pass<Way, 1>(MB, x + m * K, rows, K, k0, pass_end, s);
      }
    }
  }
  if (k1 == K) finish<Way>(x, w, bias, y, M, K, N, n, TN, sums);
}

// Where x's rows are too long for L1 beside the weight rows (8 rows of 2,048 fp32 inputs are 64
// KiB), a group of tiles runs over one block of inputs at a time (block_k: kXBytes of x's rows),
// the partial sums kept between blocks: the same additions in the same order, so the bits do
// not depend on the blocking, the row count or the threads.
template <typename T, typename Way>
void thin_linear_kernel(const typename Way::X* x, const T* w, const T* bias, T* y, int64_t M, int64_t K,
                        int64_t N) {
  const int64_t tiles = (N + kTileN - 1) / kTileN;  // the last one may hold fewer than kTileN rows
  const int64_t sums_per_tile = kTileN * M;
  const int64_t x_row_bytes = std::min<int64_t>(M, kRowBlock) * sizeof(typename Way::X);
  const int64_t block_k = std::max<int64_t>(kXBytes / x_row_bytes / 1024 * 1024, 1024);  // a multiple of kStep
  at::parallel_for(0, tiles, kGrainTiles, [&](int64_t begin, int64_t end) {
    std::vector<Vec> sums(std::min(kGroupTiles, end - begin) * sums_per_tile);
    for (int64_t group = begin; group < end; group += kGroupTiles) {
      const int64_t group_end = std::min(end, group + kGroupTiles);
      for (int64_t k0 = 0; k0 < K; k0 += block_k) {
        const int64_t k1 = std::min(K, k0 + block_k);
        for (int64_t t = group; t < group_end; ++t)
          tile<T, Way>(x, w, bias, y, M, K, N, t * kTileN, k0, k1, sums.data() + (t - group) * sums_per_tile);
      }
    }
  });
}

at::Tensor thin_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "thin_linear: x (M, K) and weight (N, K) expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "thin_linear: fp32 or bf16 x and weight of one dtype expected, got ", x.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "thin_linear: contiguous x and weight expected");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "thin_linear: a contiguous bias of ", N, " elements in x's dtype expected");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (x.scalar_type() == at::kFloat) {
    const float* bias_data = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    thin_linear_kernel<float, Widened<float>>(x.data_ptr<float>(), weight.data_ptr<float>(), bias_data,
                                              y.data_ptr<float>(), M, K, N);
  } else {
    using B = c10::BFloat16;
    const B* bias_data = bias.has_value() ? bias->data_ptr<B>() : nullptr;
#ifdef POLYTRAIN_AMX
    if (amx::permitted()) {
      amx::thin_linear(x.data_ptr<B>(), weight.data_ptr<B>(), bias_data, y.data_ptr<B>(), M, K, N);
      return y;
    }
#endif
#if defined(__AVX512BF16__)
    thin_linear_kernel<B, Paired>(x.data_ptr<B>(), weight.data_ptr<B>(), bias_data, y.data_ptr<B>(), M, K, N);
#else
    // x widened to fp32 once here, not once per weight row: (M, K). Into an aligned buffer, not
    // x.to(kFloat), a dispatched op: llama 125m's 85 bf16 products of one row ran 3% faster this
    // way (paired rounds on a 2-core Xeon); a malloc'd buffer, whose 16-byte alignment splits
    // the 64-byte vector loads across cache lines, ran 10% slower at 8 rows.
    c10::DataPtr x32 = c10::GetCPUAllocator()->allocate(M * K * sizeof(float));
    std::copy(x.data_ptr<B>(), x.data_ptr<B>() + M * K, static_cast<float*>(x32.get()));  // exact
    thin_linear_kernel<B, Widened<B>>(static_cast<const float*>(x32.get()), weight.data_ptr<B>(), bias_data,
                                      y.data_ptr<B>(), M, K, N);
#endif
  }
  return y;
}

// Whether bf16 products run on AMX's tile unit (host_matmul_amx.h) in this process.
bool thin_linear_uses_amx() {
#ifdef POLYTRAIN_AMX
  return amx::permitted();
#else
  return false;
#endif
}

}  // namespace

// A fragment: polytrain's Python operators (host_collective_ops.py) share the namespace.
TORCH_LIBRARY_FRAGMENT(polytrain, m) {
  m.def("thin_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("thin_linear_uses_amx() -> bool", &thin_linear_uses_amx);
}

TORCH_LIBRARY_IMPL(polytrain, CPU, m) {
  m.impl("thin_linear", &thin_linear);
}
