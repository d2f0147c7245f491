// y (M, N) = x (M, K) @ w (N, K)^T [+ bias (N)] for a few rows M, each weight streamed from
// memory once. See host_matmul.py for why and when.
//
// Decoding multiplies a handful of rows (one token per sequence) by every weight of the model,
// so its time is the time to read the weights. The BLAS's GEMM packs a panel of the weight
// before multiplying it, and at 2-16 rows that packing is most of the work: it reads llama
// 125m's weights at 7-13 GB/s where the memory gives 25. Here each thread walks its own
// contiguous block of the weight's rows, kTileN rows at a time, with the rows of x in L1: a
// weight element is loaded once and used for all M rows of x, and the rows kPrefetchTiles tiles
// ahead are prefetched so the load of the next rows overlaps this tile's arithmetic. Where x's
// rows are too long for L1 beside the weight (8 rows of 2,048 inputs are 64 KiB), a group of
// tiles runs over one block of kBlockK inputs at a time, each tile's partial sums kept in a
// buffer between blocks: the same additions in the same order, so the bits do not depend on
// the blocking, the row count or the threads.

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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__linux__)
#define POLYTRAIN_AMX 1
#include "host_matmul_amx.h"
#endif

namespace {

using host_vectors::kLanes;
using host_vectors::load;
using host_vectors::sum_lanes;
using host_vectors::Vec;

#if defined(__AVX512F__)
constexpr int kTileN = 2;   // 2 weight rows x 8 x rows = 16 accumulators of the 32 registers
#elif defined(__AVX__)
constexpr int kTileN = 1;   // 8 accumulators of the 16 registers
#else
constexpr int kTileN = 2;   // NEON: 32 registers
#endif
constexpr int kRowBlock = 8;       // rows of x per pass over a tile (more spill the accumulators)
constexpr int kPrefetchTiles = 1;  // the tile after this one is fetched while this one computes
constexpr int64_t kGrainTiles = 16;  // tiles per thread at least: tiny weights stay on one thread
constexpr int64_t kBlockK = 1024;    // inputs per pass: 8 rows of x in 32 KiB, beside the weight in L1
constexpr int64_t kGroupTiles = 64;  // tiles per group: their partial sums (64 KiB at most) stay in L2

// Rows n .. n+TN-1 of w against rows 0 .. MB-1 of x (fp32 rows of K elements; row stride N in
// y) over inputs k0 .. k1-1: kLanes-wide partial sums, started from `carry` (acc[j][m] at
// carry[j * kRowBlock + m]) unless k0 is 0, and left there unless k1 is K; at K each lane sum
// plus the scalar tail of k (K % kLanes) and the bias goes to y.
template <typename T, int TN, int MB>
void tile(const float* x, const T* w, const T* bias, T* y, int64_t K, int64_t N, int64_t n, int64_t k0,
          int64_t k1, Vec* carry) {
  Vec acc[TN][MB];
#pragma GCC unroll 8
  for (int j = 0; j < TN; ++j)
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) acc[j][m] = k0 == 0 ? Vec{} : carry[j * kRowBlock + m];
  const int64_t full = std::min(k1, K / kLanes * kLanes);
  const T* rows = w + n * K;
  for (int64_t k = k0; k < full; k += kLanes) {
    Vec wv[TN];
#pragma GCC unroll 8
    for (int j = 0; j < TN; ++j) {
      __builtin_prefetch(rows + (kPrefetchTiles * TN + j) * K + k);  // past the end: a no-op
      wv[j] = load(rows + j * K + k);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const Vec xv = load(x + m * K + k);
#pragma GCC unroll 8
      for (int j = 0; j < TN; ++j) acc[j][m] += xv * wv[j];
    }
  }
  if (k1 < K) {
#pragma GCC unroll 8
    for (int j = 0; j < TN; ++j)
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) carry[j * kRowBlock + m] = acc[j][m];
    return;
  }
  // copied: were acc's own address taken, GCC 12 would keep it in memory through the loop above
  Vec flat[TN * MB];
  float sums[TN][MB];
  for (int j = 0; j < TN; ++j)
    for (int m = 0; m < MB; ++m) flat[j * MB + m] = acc[j][m];
  sum_lanes<TN * MB>(flat, &sums[0][0]);
  for (int j = 0; j < TN; ++j) {
    for (int m = 0; m < MB; ++m) {
      float s = sums[j][m];
      for (int64_t k = full; k < K; ++k) s += x[m * K + k] * static_cast<float>(rows[j * K + k]);
      if (bias != nullptr) s += static_cast<float>(bias[n + j]);
      y[m * N + n + j] = static_cast<T>(s);
    }
  }
}

// What one pass of `tile` needs besides its row count and rows: the operands and the k range.
template <typename T>
struct Pass {
  const float* x;
  const T* w;
  const T* bias;
  T* y;
  int64_t M, K, N, k0, k1;
};

template <typename T, int TN>
void tile_rows(const Pass<T>& p, int64_t rows_left, int64_t m0, int64_t n, Vec* carry) {
  const float* x = p.x + m0 * p.K;
  T* y = p.y + m0 * p.N;
  switch (rows_left) {
    case 1: return tile<T, TN, 1>(x, p.w, p.bias, y, p.K, p.N, n, p.k0, p.k1, carry);
    case 2: return tile<T, TN, 2>(x, p.w, p.bias, y, p.K, p.N, n, p.k0, p.k1, carry);
    case 3: return tile<T, TN, 3>(x, p.w, p.bias, y, p.K, p.N, n, p.k0, p.k1, carry);
    case 4: return tile<T, TN, 4>(x, p.w, p.bias, y, p.K, p.N, n, p.k0, p.k1, carry);
    case 5: return tile<T, TN, 5>(x, p.w, p.bias, y, p.K, p.N, n, p.k0, p.k1, carry);
    case 6: return tile<T, TN, 6>(x, p.w, p.bias, y, p.K, p.N, n, p.k0, p.k1, carry);
    case 7: return tile<T, TN, 7>(x, p.w, p.bias, y, p.K, p.N, n, p.k0, p.k1, carry);
    default: return tile<T, TN, kRowBlock>(x, p.w, p.bias, y, p.K, p.N, n, p.k0, p.k1, carry);
  }
}

// Every block of kRowBlock rows of x against weight rows n .. n+kTileN-1 (fewer in the last
// tile), the weight read from memory once however many rows there are (it stays in L1 between
// blocks). `carry` holds the tile's partial sums: kTileN x kRowBlock per block of rows.
template <typename T>
void weight_tile(const Pass<T>& p, int64_t n, Vec* carry) {
  for (int64_t m = 0, block = 0; m < p.M; m += kRowBlock, ++block) {
    const int64_t rows_left = std::min<int64_t>(kRowBlock, p.M - m);
    Vec* block_carry = carry + block * kTileN * kRowBlock;
    if (n + kTileN <= p.N) {
      tile_rows<T, kTileN>(p, rows_left, m, n, block_carry);
    } else {
      for (int64_t row = n; row < p.N; ++row)
        tile_rows<T, 1>(p, rows_left, m, row, block_carry + (row - n) * kRowBlock);
    }
  }
}

template <typename T>
void thin_linear_kernel(const float* x, const T* w, const T* bias, T* y, int64_t M, int64_t K, int64_t N) {
  const int64_t tiles = (N + kTileN - 1) / kTileN;  // the last one may hold fewer than kTileN rows
  const int64_t carry_per_tile = (M + kRowBlock - 1) / kRowBlock * kTileN * kRowBlock;
  at::parallel_for(0, tiles, kGrainTiles, [&](int64_t begin, int64_t end) {
    std::vector<Vec> carry(K > kBlockK ? kGroupTiles * carry_per_tile : 0);
    for (int64_t group = begin; group < end; group += kGroupTiles) {
      const int64_t group_end = std::min(end, group + kGroupTiles);
      for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
        const Pass<T> pass{x, w, bias, y, M, K, N, k0, std::min(K, k0 + kBlockK)};
        for (int64_t t = group; t < group_end; ++t)
          weight_tile(pass, t * kTileN, carry.data() + (t - group) * carry_per_tile);
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
    thin_linear_kernel<float>(x.data_ptr<float>(), weight.data_ptr<float>(), bias_data, y.data_ptr<float>(), M, K, N);
  } else {
    // x widened to fp32 once here, not once per weight row: (M, K). Into an aligned buffer, not
    // x.to(kFloat), a dispatched op: llama 125m's 85 bf16 products of one row ran 3% faster this
    // way (paired rounds on a 2-core Xeon); a malloc'd buffer, whose 16-byte alignment splits
    // the 64-byte vector loads across cache lines, ran 10% slower at 8 rows.
    using B = c10::BFloat16;
    const B* bias_data = bias.has_value() ? bias->data_ptr<B>() : nullptr;
#ifdef POLYTRAIN_AMX
    if (amx::permitted()) {
      amx::thin_linear(x.data_ptr<B>(), weight.data_ptr<B>(), bias_data, y.data_ptr<B>(), M, K, N);
      return y;
    }
#endif
    c10::DataPtr x32 = c10::GetCPUAllocator()->allocate(M * K * sizeof(float));
    std::copy(x.data_ptr<B>(), x.data_ptr<B>() + M * K, static_cast<float*>(x32.get()));  // exact
    thin_linear_kernel<B>(static_cast<const float*>(x32.get()), weight.data_ptr<B>(), bias_data, y.data_ptr<B>(),
                          M, K, N);
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
