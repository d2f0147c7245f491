// Training's attention on the host CPU, forward and backward, blockwise (flash attention): see
// host_flash_attention.py for why and when.
//
// out (B, H, T, D) = softmax(scale q k^T [+ causal mask]) v for q (B, H, T, D) and k, v (B, Hkv, S,
// D), query head h reading key/value head h / (H / Hkv). Queries and keys go in blocks of kBlock
// rows; a block of scores (kBlock x kBlock fp32) lives in L1/L2 and is never written to memory.
// The forward keeps softmax's running maximum and sum per query row (online softmax) and returns
// each row's log-sum-exp (B, H, T) fp32; the backward recomputes a block's probabilities from it.
// Every product and sum is fp32; bf16 operands are widened into fp32 block copies (zero-padded to
// whole blocks), and the results are rounded to the operands' dtype once.
//
// Three product shapes do all the work, each a register tile of fp32 vectors:
//   scores      C (kBlock x kBlock)  = A (kBlock x D) B^T, B^T given as (D x kBlock)
//   rows        C (kBlock x D)      += A (kBlock x kBlock) B (kBlock x D)
//   columns     C (kBlock x D)      += A^T (kBlock x kBlock) B (kBlock x D)
// forward: S = Q K^T (scores), O += P V (rows); backward per block pair: S = Q K^T and dP = dO V^T
// (scores), dV += P^T dO and dK += dS^T Q (columns), dQ += dS K (rows).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
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
using host_vectors::Int;
using host_vectors::kLanes;
using host_vectors::kNegInf;
using host_vectors::load;
using host_vectors::Max;
using host_vectors::Plus;
using host_vectors::reduce_lanes;
using host_vectors::splat;
using host_vectors::store;
using host_vectors::Vec;

constexpr int64_t kBlock = 64;               // query rows, and key rows, of a block
constexpr int kBlockVecs = kBlock / kLanes;  // vectors across a block's columns

// Tasks a thread takes at least, given each task's work in fp32 multiply-adds: about 2^20 of them
// (~20 us) per thread, so small problems stay on the calling thread instead of waking the pool.
inline int64_t grain(double work_per_task) {
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil((1 << 20) / std::max(work_per_task, 1.0))));
}

// Lane j of the result: j (the column within a vector).
inline Int lane_index() {
  Int idx;
  for (int j = 0; j < kLanes; ++j) idx[j] = j;
  return idx;
}

// ----- the three products ------------------------------------------------------------------

// C (kBlock x kBlock) = A (kBlock x D, row-major) times BT (D x kBlock, row-major): each A[i][d]
// broadcast against a row of BT. A tile of R rows x 4 vectors of columns stays in registers.
inline void scores(const float* A, const float* BT, int64_t D, float* C) {
  constexpr int R = kLanes == 16 ? 4 : 2;  // AVX-512: 16 accumulators + 4 operands of 32 registers
  constexpr int CV = 4;
  for (int64_t i0 = 0; i0 < kBlock; i0 += R) {
    for (int64_t j0 = 0; j0 < kBlock; j0 += CV * kLanes) {
      Vec acc[R][CV] = {};
      for (int64_t d = 0; d < D; ++d) {
        Vec b[CV];
        for (int c = 0; c < CV; ++c) b[c] = load(BT + d * kBlock + j0 + c * kLanes);
        for (int r = 0; r < R; ++r) {
          const Vec a = splat(A[(i0 + r) * D + d]);
          for (int c = 0; c < CV; ++c) acc[r][c] += a * b[c];
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < CV; ++c) store(acc[r][c], C + (i0 + r) * kBlock + j0 + c * kLanes);
    }
  }
}

// Rows of C a register tile holds when a row is NV vectors: 16 accumulators at most.
template <int NV>
constexpr int tile_rows() { return NV >= 16 ? 1 : (16 / NV > 8 ? 8 : 16 / NV); }

// C (kBlock x D) += A B (kTransposed false) or A^T B (true), for A (kBlock x kBlock, row-major) and
// B (kBlock x D), D = NV vectors: C[i] += sum over j of A[i][j] B[j], or of A[j][i] B[j]; only B's
// first n rows count (A's first n columns, or rows).
template <int NV, bool kTransposed>
void accumulate(const float* A, const float* B, int64_t n, float* C) {
  constexpr int R = tile_rows<NV>();
  constexpr int64_t D = NV * kLanes;
  for (int64_t i0 = 0; i0 < kBlock; i0 += R) {
    Vec acc[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = load(C + (i0 + r) * D + v * kLanes);
    for (int64_t j = 0; j < n; ++j) {
      Vec b[NV];
      for (int v = 0; v < NV; ++v) b[v] = load(B + j * D + v * kLanes);
      for (int r = 0; r < R; ++r) {
        const Vec a = splat(kTransposed ? A[j * kBlock + i0 + r] : A[(i0 + r) * kBlock + j]);
        for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) store(acc[r][v], C + (i0 + r) * D + v * kLanes);
  }
}

template <int NV>
void rows(const float* A, const float* B, int64_t n, float* C) { accumulate<NV, false>(A, B, n, C); }

template <int NV>
void columns(const float* A, const float* B, int64_t n, float* C) { accumulate<NV, true>(A, B, n, C); }

// ----- operands ------------------------------------------------------------------------------

// One head of q, k, v, out or a gradient: rows `row` elements apart, D contiguous elements each.
template <typename T>
struct Head {
  T* data;
  int64_t row;
};

// Rows [first, first + kBlock) of `src` widened to fp32 into `dst` (kBlock x D), rows at or past
// `rows` zero.
template <typename T>
void block_rows(Head<const T> src, int64_t first, int64_t rows, int64_t D, float* dst) {
  for (int64_t i = 0; i < kBlock; ++i) {
    float* out = dst + i * D;
    if (first + i >= rows) {
      std::fill(out, out + D, 0.0f);
      continue;
    }
    const T* in = src.data + (first + i) * src.row;
    for (int64_t d = 0; d < D; d += kLanes) store(load(in + d), out + d);
  }
}

// The same block transposed: dst (D x kBlock), dst[d][i] = row first + i's element d.
template <typename T>
void block_columns(Head<const T> src, int64_t first, int64_t rows, int64_t D, float* dst) {
  for (int64_t i = 0; i < kBlock; ++i) {
    if (first + i >= rows) {
      for (int64_t d = 0; d < D; ++d) dst[d * kBlock + i] = 0.0f;
      continue;
    }
    const T* in = src.data + (first + i) * src.row;
    for (int64_t d = 0; d < D; ++d) dst[d * kBlock + i] = static_cast<float>(in[d]);
  }
}

// Rows [first, min(first + kBlock, rows)) of `src` (kBlock x D fp32) into `dst`, rounded to T.
template <typename T>
void store_rows(const float* src, int64_t first, int64_t rows, int64_t D, Head<T> dst) {
  for (int64_t i = 0; i < kBlock && first + i < rows; ++i)
    for (int64_t d = 0; d < D; d += kLanes) store(load(src + i * D + d), dst.data + (first + i) * dst.row + d);
}

// Keys a query row may see in the key block starting at `k0`: all S - k0 of them (at most kBlock),
// or under the causal mask those at or before the row's own position.
inline int64_t visible(int64_t row, int64_t k0, int64_t S, bool causal) {
  const int64_t n = std::min(kBlock, S - k0);
  return causal ? std::clamp<int64_t>(row - k0 + 1, 0, n) : n;
}

// The problem: shapes, strides of each operand (batch, head, row; D contiguous), scale, mask.
struct Shape {
  int64_t B, H, Hkv, T, S, D;
  float scale;
  bool causal;
  int64_t blocks_q() const { return (T + kBlock - 1) / kBlock; }
  int64_t blocks_k() const { return (S + kBlock - 1) / kBlock; }
  // Key blocks a query block sees: under the causal mask (T == S) those up to its own.
  int64_t blocks_k_for(int64_t qb) const { return causal ? qb + 1 : blocks_k(); }
};

struct Strides {
  int64_t b, h, t;
  template <typename T>
  Head<T> head(T* base, int64_t b_, int64_t h_) const { return {base + b_ * b + h_ * h, t}; }
};

// ----- forward -------------------------------------------------------------------------------

// Key/value head (b, hk)'s keys transposed and values widened, block by block: kT (blocks_k, D,
// kBlock) and v32 (blocks_k, kBlock, D) of one head, zero past S. Done once for all the query
// heads and query blocks that read them.
template <typename T>
void widen_keys(const Shape& p, Head<const T> k, Head<const T> v, float* kT, float* v32) {
  for (int64_t kb = 0; kb < p.blocks_k(); ++kb) {
    block_columns(k, kb * kBlock, p.S, p.D, kT + kb * p.D * kBlock);
    block_rows(v, kb * kBlock, p.S, p.D, v32 + kb * kBlock * p.D);
  }
}

// One query block of one head: out's rows and their log-sum-exp, from its head's widened keys.
template <typename T, int NV>
void forward_block(const Shape& p, Head<const T> q, const float* kT, const float* v32, Head<T> out, float* lse,
                   int64_t qb, float* scratch) {
  constexpr int64_t D = NV * kLanes;
  float* q32 = scratch;               // (kBlock, D)
  float* s = q32 + kBlock * D;        // (kBlock, kBlock): scores, then probabilities
  float* o = s + kBlock * kBlock;     // (kBlock, D): unnormalised output
  alignas(64) float top[kBlock], sum[kBlock];  // per query row: the largest score so far, the sum of e^(score - top)
  const int64_t q0 = qb * kBlock;
  block_rows(q, q0, p.T, D, q32);
  std::fill(o, o + kBlock * D, 0.0f);
  std::fill(top, top + kBlock, kNegInf);
  std::fill(sum, sum + kBlock, 0.0f);
  const Int lanes = lane_index();
  for (int64_t kb = 0; kb < p.blocks_k_for(qb); ++kb) {
    const int64_t k0 = kb * kBlock;
    scores(q32, kT + kb * D * kBlock, D, s);
    // kLanes rows at a time, so that their maxima and sums come out as one vector each.
    for (int64_t i0 = 0; i0 < kBlock; i0 += kLanes) {
      Vec row_max[kLanes], row_sum[kLanes];
      for (int r = 0; r < kLanes; ++r) {
        float* row = s + (i0 + r) * kBlock;
        const int32_t n = static_cast<int32_t>(visible(q0 + i0 + r, k0, p.S, p.causal));  // >= 1
        Vec m = splat(kNegInf);
        for (int c = 0; c < kBlockVecs; ++c) {
          const Vec x = (lanes + c * kLanes) < n ? load(row + c * kLanes) * p.scale : splat(kNegInf);
          store(x, row + c * kLanes);
          m = m > x ? m : x;
        }
        row_max[r] = m;
      }
      alignas(64) float block_top[kLanes];
      reduce_lanes<kLanes>(row_max, block_top, Max{});
      const Vec old_top = load(top + i0);
      const Vec new_top = old_top > load(block_top) ? old_top : load(block_top);
      const Vec rescale = exp_nonpositive(old_top - new_top);  // 0 while top is -inf
      store(new_top, top + i0);
      for (int r = 0; r < kLanes; ++r) {
        float* row = s + (i0 + r) * kBlock;
        const Vec shift = splat(new_top[r]);
        Vec total{};
        for (int c = 0; c < kBlockVecs; ++c) {
          const Vec e = exp_nonpositive(load(row + c * kLanes) - shift);
          total += e;
          store(e, row + c * kLanes);
        }
        row_sum[r] = total;
        const Vec f = splat(rescale[r]);
        for (int64_t d = 0; d < D; d += kLanes) store(load(o + (i0 + r) * D + d) * f, o + (i0 + r) * D + d);
      }
      alignas(64) float added[kLanes];
      reduce_lanes<kLanes>(row_sum, added, Plus{});
      store(load(sum + i0) * rescale + load(added), sum + i0);
    }
    rows<NV>(s, v32 + kb * kBlock * D, std::min(kBlock, p.S - k0), o);
  }
  for (int64_t i = 0; i < kBlock && q0 + i < p.T; ++i) {
    const float inv = 1.0f / sum[i];
    for (int64_t d = 0; d < D; d += kLanes) store(load(o + i * D + d) * inv, o + i * D + d);
    lse[q0 + i] = top[i] + std::log(sum[i]);
  }
  store_rows(o, q0, p.T, D, out);
}

template <int NV>
constexpr int64_t forward_scratch() { return 2 * kBlock * NV * kLanes + kBlock * kBlock; }

template <typename T, int NV>
void forward(const Shape& p, const T* q, Strides qs, const T* k, Strides ks, const T* v, Strides vs, T* out,
             Strides os, float* lse) {
  const int64_t nq = p.blocks_q(), group = p.H / p.Hkv, per_head = p.blocks_k() * kBlock * p.D;
  // Every key/value head widened once (2 x B x Hkv x S x D fp32), then one task per (b, h, query
  // block); a thread's scratch is reused across its tasks.
  std::vector<float> kT(p.B * p.Hkv * per_head), v32(p.B * p.Hkv * per_head);
  at::parallel_for(0, p.B * p.Hkv, grain(2.0 * per_head), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task)
      widen_keys(p, ks.head(k, task / p.Hkv, task % p.Hkv), vs.head(v, task / p.Hkv, task % p.Hkv),
                 kT.data() + task * per_head, v32.data() + task * per_head);
  });
  // a query block's products: 2 x kBlock^2 x D per key block, (blocks_k + 1) / 2 of them on average if causal
  const double block_work = 2.0 * kBlock * kBlock * p.D * (p.causal ? (p.blocks_k() + 1) / 2.0 : p.blocks_k());
  at::parallel_for(0, p.B * p.H * nq, grain(block_work), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(forward_scratch<NV>());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t qb = task % nq, h = task / nq % p.H, b = task / nq / p.H;
      const int64_t kv = (b * p.Hkv + h / group) * per_head;
      forward_block<T, NV>(p, qs.head(q, b, h), kT.data() + kv, v32.data() + kv, os.head(out, b, h),
                           lse + (b * p.H + h) * p.T, qb, scratch.data());
    }
  });
}

// ----- backward ------------------------------------------------------------------------------

template <int NV>
constexpr int64_t backward_block_scratch() { return 7 * kBlock * NV * kLanes + 2 * kBlock * kBlock; }

// One (b, key/value head): dK and dV of its keys, dQ of its `group` query heads, which no other
// task touches. Key blocks outside, query blocks inside: a key block's dK and dV stay in a
// block-sized accumulator; dQ of every query row accumulates in dq32 (group x T x D fp32).
template <typename T, int NV>
void backward_head(const Shape& p, int64_t b, int64_t hk, const T* q, Strides qs, const T* k, Strides ks,
                   const T* v, Strides vs, const T* out, Strides os, const T* dout, Strides dos, const float* lse,
                   T* dq, Strides dqs, T* dk, Strides dks, T* dv, Strides dvs, float* scratch,
                   std::vector<float>& dq32, std::vector<float>& delta) {
  constexpr int64_t D = NV * kLanes;
  const int64_t group = p.H / p.Hkv, nq = p.blocks_q(), Tpad = nq * kBlock;
  float* kT = scratch;              // (D, kBlock)
  float* k32 = kT + D * kBlock;     // (kBlock, D)
  float* vT = k32 + kBlock * D;     // (D, kBlock)
  float* q32 = vT + D * kBlock;     // (kBlock, D)
  float* do32 = q32 + kBlock * D;   // (kBlock, D)
  float* dk32 = do32 + kBlock * D;  // (kBlock, D)
  float* dv32 = dk32 + kBlock * D;  // (kBlock, D)
  float* pr = dv32 + kBlock * D;    // (kBlock, kBlock): probabilities
  float* ds = pr + kBlock * kBlock;  // (kBlock, kBlock): dP, then dS
  dq32.assign(group * Tpad * D, 0.0f);
  delta.assign(group * Tpad, 0.0f);
  // delta_i = sum_d dO[i][d] O[i][d] = sum_j P[i][j] dP[i][j]: softmax's backward needs it per row.
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = hk * group + g;
    const Head<const T> o = os.head(out, b, h), go = dos.head(dout, b, h);
    for (int64_t i = 0; i < p.T; ++i) {
      Vec acc{};
      for (int64_t d = 0; d < D; d += kLanes) acc += load(o.data + i * o.row + d) * load(go.data + i * go.row + d);
      float total = 0.0f;
      for (int j = 0; j < kLanes; ++j) total += acc[j];
      delta[g * Tpad + i] = total;
    }
  }
  const Head<const T> kh = ks.head(k, b, hk), vh = vs.head(v, b, hk);
  const Int lanes = lane_index();
  for (int64_t kb = 0; kb < p.blocks_k(); ++kb) {
    const int64_t k0 = kb * kBlock, nk = std::min(kBlock, p.S - k0);
    block_columns(kh, k0, p.S, D, kT);
    block_rows(kh, k0, p.S, D, k32);
    block_columns(vh, k0, p.S, D, vT);
    std::fill(dk32, dk32 + kBlock * D, 0.0f);
    std::fill(dv32, dv32 + kBlock * D, 0.0f);
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = hk * group + g;
      const Head<const T> qh = qs.head(q, b, h), goh = dos.head(dout, b, h);
      const float* row_lse = lse + (b * p.H + h) * p.T;
      for (int64_t qb = p.causal ? kb : 0; qb < nq; ++qb) {
        const int64_t q0 = qb * kBlock, mq = std::min(kBlock, p.T - q0);
        block_rows(qh, q0, p.T, D, q32);
        block_rows(goh, q0, p.T, D, do32);
        scores(q32, kT, D, pr);
        scores(do32, vT, D, ds);
        for (int64_t i = 0; i < kBlock; ++i) {
          float* prow = pr + i * kBlock;
          float* drow = ds + i * kBlock;
          const int64_t n = i < mq ? visible(q0 + i, k0, p.S, p.causal) : 0;
          const float l = i < mq ? row_lse[q0 + i] : 0.0f, dl = i < mq ? delta[g * Tpad + q0 + i] : 0.0f;
          for (int c = 0; c < kBlockVecs; ++c) {
            const Vec e = exp_nonpositive(load(prow + c * kLanes) * p.scale - l);
            const Vec prob = (lanes + c * kLanes) < static_cast<int32_t>(n) ? e : Vec{};
            store(prob, prow + c * kLanes);
            store(prob * (load(drow + c * kLanes) - dl) * p.scale, drow + c * kLanes);  // dS, scaled
          }
        }
        columns<NV>(pr, do32, mq, dv32);                 // dV += P^T dO
        columns<NV>(ds, q32, mq, dk32);                  // dK += dS^T Q
        rows<NV>(ds, k32, nk, dq32.data() + (g * Tpad + q0) * D);  // dQ += dS K
      }
    }
    store_rows(dk32, k0, p.S, D, dks.head(dk, b, hk));
    store_rows(dv32, k0, p.S, D, dvs.head(dv, b, hk));
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t qb = 0; qb < nq; ++qb)
      store_rows(dq32.data() + (g * Tpad + qb * kBlock) * D, qb * kBlock, p.T, D, dqs.head(dq, b, hk * group + g));
}

template <typename T, int NV>
void backward(const Shape& p, const T* q, Strides qs, const T* k, Strides ks, const T* v, Strides vs, const T* out,
              Strides os, const T* dout, Strides dos, const float* lse, T* dq, Strides dqs, T* dk, Strides dks,
              T* dv, Strides dvs) {
  // a key/value head's products: 5 x kBlock^2 x D per block pair, its group's query heads' pairs
  const double pairs = p.causal ? p.blocks_q() * (p.blocks_q() + 1) / 2.0 : double(p.blocks_q()) * p.blocks_k();
  const double head_work = 5.0 * kBlock * kBlock * p.D * pairs * (p.H / p.Hkv);
  at::parallel_for(0, p.B * p.Hkv, grain(head_work), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(backward_block_scratch<NV>()), dq32, delta;
    for (int64_t task = begin; task < end; ++task)
      backward_head<T, NV>(p, task / p.Hkv, task % p.Hkv, q, qs, k, ks, v, vs, out, os, dout, dos, lse, dq, dqs, dk,
                           dks, dv, dvs, scratch.data(), dq32, delta);
  });
}

// ----- the operators -------------------------------------------------------------------------

Strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

Shape check(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
            double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": q (B, H, T, D), k and v (B, Hkv, S, D) expected, got ",
              q.sizes(), ", ", k.sizes(), " and ", v.sizes());
  const Shape p{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), static_cast<float>(scale), causal};
  TORCH_CHECK(k.size(0) == p.B && k.size(3) == p.D && v.sizes() == k.sizes() && p.Hkv > 0 && p.H % p.Hkv == 0, op,
              ": k and v of shape (", p.B, ", Hkv, S, ", p.D, ") with Hkv dividing ", p.H, " expected, got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              op, ": fp32 or bf16 q, k and v of one dtype expected");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, op,
              ": q, k and v with contiguous heads (stride 1 over D) expected");
  TORCH_CHECK(p.D % kLanes == 0 && p.D / kLanes <= 16 && ((p.D / kLanes) & (p.D / kLanes - 1)) == 0, op,
              ": a head size of ", kLanes, " x 1, 2, 4, 8 or 16 expected here, got ", p.D);
  TORCH_CHECK(!causal || p.T == p.S, op, ": the causal mask needs as many queries as keys, got ", p.T, " and ", p.S);
  TORCH_CHECK(p.T > 0 && p.S > 0, op, ": at least one query and one key expected");
  return p;
}

// Calls f.template operator()<T, NV>() for the operands' dtype and head size.
template <typename F>
void dispatch(const at::Tensor& q, int64_t D, F&& f) {
  auto with_type = [&](auto tag) {
    using T = decltype(tag);
    switch (D / kLanes) {
      case 1: return f.template operator()<T, 1>();
      case 2: return f.template operator()<T, 2>();
      case 4: return f.template operator()<T, 4>();
      case 8: return f.template operator()<T, 8>();
      default: return f.template operator()<T, 16>();
    }
  };
  if (q.scalar_type() == at::kFloat) {
    with_type(float{});
  } else {
    with_type(c10::BFloat16{});
  }
}

std::tuple<at::Tensor, at::Tensor> flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   bool causal, double scale) {
  const Shape p = check("flash_attention", q, k, v, causal, scale);
  // (B, T, H, D) memory seen as (B, H, T, D): the caller's transpose back to (B, T, H * D) is free.
  at::Tensor out = at::empty({p.B, p.T, p.H, p.D}, q.options()).transpose(1, 2);
  at::Tensor lse = at::empty({p.B, p.H, p.T}, q.options().dtype(at::kFloat));
  dispatch(q, p.D, [&]<typename T, int NV>() {
    forward<T, NV>(p, q.data_ptr<T>(), strides_of(q), k.data_ptr<T>(), strides_of(k), v.data_ptr<T>(), strides_of(v),
                   out.data_ptr<T>(), strides_of(out), lse.data_ptr<float>());
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, bool causal, double scale) {
  const Shape p = check("flash_attention_backward", q, k, v, causal, scale);
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes() && dout.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type() && dout.stride(3) == 1 && out.stride(3) == 1,
              "flash_attention_backward: dout and out like q expected");
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == p.B && lse.size(1) == p.H && lse.size(2) == p.T &&
                  lse.scalar_type() == at::kFloat && lse.is_contiguous(),
              "flash_attention_backward: a contiguous fp32 lse (B, H, T) expected");
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  TORCH_CHECK(dq.stride(3) == 1 && dk.stride(3) == 1 && dv.stride(3) == 1,
              "flash_attention_backward: gradients with contiguous heads expected");
  dispatch(q, p.D, [&]<typename T, int NV>() {
    backward<T, NV>(p, q.data_ptr<T>(), strides_of(q), k.data_ptr<T>(), strides_of(k), v.data_ptr<T>(),
                    strides_of(v), out.data_ptr<T>(), strides_of(out), dout.data_ptr<T>(), strides_of(dout),
                    lse.data_ptr<float>(), dq.data_ptr<T>(), strides_of(dq), dk.data_ptr<T>(), strides_of(dk),
                    dv.data_ptr<T>(), strides_of(dv));
  });
  return {dq, dk, dv};
}

int64_t host_vector_lanes() { return kLanes; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(polytrain, m) {
  m.def("host_vector_lanes() -> int", &host_vector_lanes);  // fp32 lanes of the vectors the kernels were built with
  m.def("flash_attention(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> (Tensor, Tensor)");
  m.def(
      "flash_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
      "float scale) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(polytrain, CPU, m) {
  m.impl("flash_attention", &flash_attention);
  m.impl("flash_attention_backward", &flash_attention_backward);
}
