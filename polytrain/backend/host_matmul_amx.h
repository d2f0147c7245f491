// bf16 products on the tile unit (AMX: Sapphire Rapids and later Xeons), for host_matmul.cpp.
//
// The FMA kernel's bf16 products cost one widening and one FMA per 16 weights per row of x, so
// from about 4 rows its arithmetic, not the memory, bounds it (llama 125m's weights read at 12-16
// GB/s with 8 rows, 8-10 with 16, 4-5 with 32, on a 2-core Xeon whose memory gives 23-29). One
// TDPBF16PS multiplies 16 weight rows x 32 inputs by up to 16 rows of x, and each weight tile is
// loaded once for up to three tiles of x, so up to 48 rows read the weights once (llama 125m's
// (32000, 768) weight at 20.5, 21.4, 15.0 and 11.7 GB/s with 8, 16, 32 and 48 rows).
//
// The product is computed transposed, y^T (N, M) = w (N, K) @ x^T (K, M), so that the weight is
// the tile unit's left operand, loaded straight from memory as 16 rows x 32 inputs (64 bytes
// each, row stride K). x^T is the right operand, which the unit takes with each two consecutive
// inputs of a row side by side: its row r holds x[m][2r], x[m][2r+1] for every m. x is packed so
// once per call, 16 rows to a tile. Each output is summed in fp32 over its K inputs
// in order and rounded to bf16 once, as the FMA kernel does, but the unit reads bf16 inputs below
// 2^-126 as zero and flushes such sums to zero.
//
// A row of x is summed the same way however many rows come with it (each output of the tile is
// its own dot product), and a weight row the same way in every block: the bits do not depend on
// the row count or the threads.

#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "host_vectors.h"

namespace amx {

using BF16 = c10::BFloat16;

constexpr int kRows = 16;    // weight rows per tile, and the most rows of x per tile
constexpr int kDepth = 32;   // inputs per tile row: 64 bytes of bf16
constexpr int kChunks = 3;   // tiles of x per pass over the weight: 48 rows of x read it once
constexpr int64_t kGrainBlocks = 2;  // blocks of 16 weight rows per thread at least

// The tile registers used, as literal numbers: GCC's intrinsics paste them into the instruction.
// Chunk c of a pass (16 rows of x at most) has its own x tile and sums tile.
#define POLYTRAIN_AMX_WEIGHT 1  // 16 weight rows x 32 inputs, bf16
#define POLYTRAIN_AMX_SUMS0 0   // 16 weight rows x the chunk's rows of x, fp32
#define POLYTRAIN_AMX_X0 2      // 16 input pairs x the chunk's rows of x, bf16 pairs
#define POLYTRAIN_AMX_SUMS1 3
#define POLYTRAIN_AMX_X1 4
#define POLYTRAIN_AMX_SUMS2 5
#define POLYTRAIN_AMX_X2 6

// LDTILECFG's 64-byte operand, palette 1: each tile's rows and bytes per row.
struct alignas(64) Config {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// GCC's tile intrinsics are inline assembly that tells the compiler of no memory it reads or
// writes (ldtilecfg names 8 of its 64 bytes): without a barrier around them the stores to a
// buffer a tile is loaded from, or the loads from one it is stored to, may be dropped or moved.
inline void compiler_barrier() { asm volatile("" ::: "memory"); }

// Linux gives a process the tile registers' 8 KiB of state only when it asks; a kernel that
// refuses (or lacks AMX support) leaves the FMA kernel in use, as POLYTRAIN_HOST_AMX=0 does.
inline bool permitted() {
  static const bool ok = [] {
    const char* setting = std::getenv("POLYTRAIN_HOST_AMX");
    if (setting != nullptr && std::strcmp(setting, "0") == 0) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  }();
  return ok;
}

// x (M <= 16 rows, K) as the right operand: ceil(K / 32) tiles of 16 pair rows x M pairs, a pair
// being x[m][2r], x[m][2r + 1] as one 32-bit word (the first in its low half); zeros past K.
inline std::vector<uint32_t> pack_pairs(const BF16* x, int64_t M, int64_t K) {
  const int64_t pairs = (K + kDepth - 1) / kDepth * (kDepth / 2);
  std::vector<uint32_t> packed(pairs * M, 0);
  for (int64_t m = 0; m < M; ++m) {
    const BF16* row = x + m * K;
    for (int64_t p = 0; p < K / 2; ++p) std::memcpy(&packed[p * M + m], row + 2 * p, sizeof(uint32_t));
    if (K % 2 == 1) packed[K / 2 * M + m] = row[K - 1].x;
  }
  return packed;
}

// One pass's rows of x: `count` chunks of at most 16 rows, each packed for its own tile.
struct Pass {
  int count = 0;
  int64_t rows[kChunks] = {};
  std::vector<uint32_t> packed[kChunks];
};

// Chunk c's product with the weight tile now loaded: its x tile for inputs t * 32 .. t * 32 + 31
// (its packed words t * 16 * rows on), added into its sums.
#define POLYTRAIN_AMX_CHUNK(c, t, sums, x)                                                       \
  if constexpr (C > c) {                                                                         \
    _tile_loadd(x, pass.packed[c].data() + (t) * (kDepth / 2) * pass.rows[c], pass.rows[c] * 4); \
    _tile_dpbf16ps(sums, POLYTRAIN_AMX_WEIGHT, x);                                               \
  }
#define POLYTRAIN_AMX_CHUNKS(t)                                \
  POLYTRAIN_AMX_CHUNK(0, t, POLYTRAIN_AMX_SUMS0, POLYTRAIN_AMX_X0) \
  POLYTRAIN_AMX_CHUNK(1, t, POLYTRAIN_AMX_SUMS1, POLYTRAIN_AMX_X1) \
  POLYTRAIN_AMX_CHUNK(2, t, POLYTRAIN_AMX_SUMS2, POLYTRAIN_AMX_X2)

// 16 weight rows (`stride` elements apart) times the C chunks of x over K inputs: chunk c's sums
// (16, rows[c]) fp32 at sums + c * 256. Each weight tile is loaded once for all chunks.
template <int C>
void block(const BF16* w, int64_t stride, int64_t K, const Pass& pass, float* sums) {
  const int64_t full = K / kDepth;
  compiler_barrier();  // w may be a buffer just written (the padded last rows)
  _tile_zero(POLYTRAIN_AMX_SUMS0);
  if constexpr (C > 1) _tile_zero(POLYTRAIN_AMX_SUMS1);
  if constexpr (C > 2) _tile_zero(POLYTRAIN_AMX_SUMS2);
  for (int64_t t = 0; t < full; ++t) {
    _tile_loadd(POLYTRAIN_AMX_WEIGHT, w + t * kDepth, stride * sizeof(BF16));
    POLYTRAIN_AMX_CHUNKS(t)
  }
  if (const int64_t rest = K - full * kDepth; rest > 0) {  // the last inputs, zero-padded to a tile
    alignas(64) uint16_t last[kRows][kDepth] = {};
    for (int r = 0; r < kRows; ++r) std::memcpy(last[r], w + r * stride + full * kDepth, rest * sizeof(BF16));
    compiler_barrier();
    _tile_loadd(POLYTRAIN_AMX_WEIGHT, last, sizeof(last[0]));
    POLYTRAIN_AMX_CHUNKS(full)
  }
  _tile_stored(POLYTRAIN_AMX_SUMS0, sums, pass.rows[0] * sizeof(float));
  if constexpr (C > 1) _tile_stored(POLYTRAIN_AMX_SUMS1, sums + kRows * kRows, pass.rows[1] * sizeof(float));
  if constexpr (C > 2) _tile_stored(POLYTRAIN_AMX_SUMS2, sums + 2 * kRows * kRows, pass.rows[2] * sizeof(float));
  compiler_barrier();
}

// y[m][n + r] = bf16(sums[r][m] + bias[n + r]) for the block's `live` weight rows r: a column of
// sums per row of y, gathered 16 at a time, rounded as c10::BFloat16 rounds (host_vectors.h).
inline void write(const float* sums, int64_t live, int64_t M, const BF16* bias, BF16* y, int64_t N, int64_t n) {
  const __mmask16 lanes = static_cast<__mmask16>((1u << live) - 1);
  const __m512i column = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(M));
  __m512 b = _mm512_setzero_ps();
  if (bias != nullptr)
    b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, bias + n)), 16));
  for (int64_t m = 0; m < M; ++m) {
    const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, sums + m, sizeof(float)), b);
    const host_vectors::Half half = host_vectors::round_to_bf16(reinterpret_cast<const host_vectors::Vec&>(v));
    _mm256_mask_storeu_epi16(y + m * N + n, lanes, reinterpret_cast<const __m256i&>(half));
  }
}

// Every 16 weight rows of w (N, K) against the pass's rows of x, m0 .. m0 + 48 at most, into y.
template <int C>
void pass_over_weight(const Pass& pass, const BF16* w, const BF16* bias, BF16* y, int64_t K, int64_t N) {
  const int64_t blocks = (N + kRows - 1) / kRows;  // the last may hold fewer than 16 weight rows
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t begin, int64_t end) {
    Config config;  // per thread: the tile registers are each thread's own
    config.rows[POLYTRAIN_AMX_WEIGHT] = kRows;
    config.bytes_per_row[POLYTRAIN_AMX_WEIGHT] = kDepth * sizeof(BF16);
    const int sums_tiles[kChunks] = {POLYTRAIN_AMX_SUMS0, POLYTRAIN_AMX_SUMS1, POLYTRAIN_AMX_SUMS2};
    const int x_tiles[kChunks] = {POLYTRAIN_AMX_X0, POLYTRAIN_AMX_X1, POLYTRAIN_AMX_X2};
    for (int c = 0; c < C; ++c) {
      config.rows[sums_tiles[c]] = config.rows[x_tiles[c]] = kRows;
      config.bytes_per_row[sums_tiles[c]] = config.bytes_per_row[x_tiles[c]] = pass.rows[c] * sizeof(float);
    }
    compiler_barrier();
    _tile_loadconfig(&config);
    alignas(64) float sums[kChunks * kRows * kRows];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * kRows, live = std::min<int64_t>(kRows, N - n);
      if (live == kRows) {
        block<C>(w + n * K, K, K, pass, sums);
      } else {  // the weight's last rows, zero-padded to 16: the tile load must not read past w
        std::vector<BF16> padded(kRows * K, BF16(0.0f));
        std::copy(w + n * K, w + N * K, padded.begin());
        block<C>(padded.data(), K, K, pass, sums);
      }
      for (int c = 0; c < C; ++c)
        write(sums + c * kRows * kRows, live, pass.rows[c], bias, y + c * kRows * N, N, n);
    }
    _tile_release();
  });
}

// y (M, N) = x (M, K) @ w (N, K)^T [+ bias (N)], bf16, on the tile unit (permitted() first).
inline void thin_linear(const BF16* x, const BF16* w, const BF16* bias, BF16* y, int64_t M, int64_t K, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += kChunks * kRows) {  // each 48 rows of x one pass over the weight
    Pass pass;
    for (int64_t m = m0; m < std::min(M, m0 + kChunks * kRows); m += kRows, ++pass.count) {
      pass.rows[pass.count] = std::min<int64_t>(kRows, M - m);
      pass.packed[pass.count] = pack_pairs(x + m * K, pass.rows[pass.count], K);
    }
    switch (pass.count) {
      case 1: pass_over_weight<1>(pass, w, bias, y + m0 * N, K, N); break;
      case 2: pass_over_weight<2>(pass, w, bias, y + m0 * N, K, N); break;
      default: pass_over_weight<3>(pass, w, bias, y + m0 * N, K, N); break;
    }
  }
}

}  // namespace amx

#undef POLYTRAIN_AMX_CHUNKS
#undef POLYTRAIN_AMX_CHUNK
#undef POLYTRAIN_AMX_WEIGHT
#undef POLYTRAIN_AMX_SUMS0
#undef POLYTRAIN_AMX_X0
#undef POLYTRAIN_AMX_SUMS1
#undef POLYTRAIN_AMX_X1
#undef POLYTRAIN_AMX_SUMS2
#undef POLYTRAIN_AMX_X2
