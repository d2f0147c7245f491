// The host kernels' fp32 vectors (host_matmul.cpp, host_attention.cpp, host_flash_attention.cpp, host_cross_entropy.cpp,
// host_activations.cpp): GCC's vector extension,
// as wide as the CPU the kernels are built on (-march=native), and how bf16 is widened into them.

#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>

namespace host_vectors {

#if defined(__AVX512F__)
constexpr int kLanes = 16;  // one 512-bit register of fp32
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;   // 128-bit vectors (SSE, NEON)
#endif

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(sizeof(float))));
typedef uint16_t Half __attribute__((vector_size(kLanes * sizeof(uint16_t)), aligned(sizeof(uint16_t))));
typedef uint32_t Word __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int32_t Int __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Vec load(const float* p) { return *reinterpret_cast<const Vec*>(p); }  // Vec is 4-byte aligned

// x in every lane: one broadcast. (Vec{} + x adds 0.0 first, not an identity for -0.0 so not
// folded away; x - 0.0 is one, and setting the lanes one by one became 16 masked broadcasts.)
inline Vec splat(float x) { return x - Vec{}; }

// kLanes bf16 values widened to fp32: a bf16 is the top half of the fp32 with the same value.
#if defined(__AVX512F__)
// One vpmovzxwd from memory and a shift: GCC 12 compiles the generic conversion below into two
// 256-bit halves joined by three shuffles, which made a bf16 product of 8 rows slower than
// fp32's. Inline assembly, not _mm512_cvtepu16_epi32: with the intrinsic GCC 12 stored and
// reloaded every accumulator at every step.
inline Vec load(const c10::BFloat16* p) {
  Word w;
  asm("vpmovzxwd %1, %0" : "=v"(w) : "m"(*reinterpret_cast<const Half*>(p)));
  w <<= 16;
  return reinterpret_cast<const Vec&>(w);
}
#else
inline Vec load(const c10::BFloat16* p) {
  const Word w = __builtin_convertvector(*reinterpret_cast<const Half*>(p), Word) << 16;
  return reinterpret_cast<const Vec&>(w);
}
#endif

inline void store(Vec v, float* p) { *reinterpret_cast<Vec*>(p) = v; }

// kLanes fp32 values rounded to bf16 bits as c10::BFloat16 rounds them: to nearest, ties to even,
// NaN to 0x7FC0.
inline Half round_to_bf16(Vec v) {
  const Word bits = reinterpret_cast<const Word&>(v);
  const Word rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
  const Word nan = reinterpret_cast<Word>(v != v);  // all ones where v is NaN
  const Word word = (rounded & ~nan) | (0x7FC0 & nan);
#if defined(__AVX512F__)
  // One vpmovdw: GCC 12 narrows the generic way below with a two-register word permute.
  return reinterpret_cast<Half>(_mm512_cvtepi32_epi16(reinterpret_cast<__m512i>(word)));
#else
  return __builtin_convertvector(word, Half);
#endif
}

inline void store(Vec v, c10::BFloat16* p) { *reinterpret_cast<Half*>(p) = round_to_bf16(v); }

// A vector's lanes combined by `op` (a sum, a maximum), by halving: lanes i and i + L/2 are
// combined, then again on the half. Every vector gets the same additions, so a sum's bits do not
// depend on what is summed beside it.
template <int L, typename Op>
float reduce_halves(const float* lanes, Op op) {
  if constexpr (L == 1) {
    return lanes[0];
  } else {
    float half[L / 2];
    for (int i = 0; i < L / 2; ++i) half[i] = op(lanes[i], lanes[i + L / 2]);
    return reduce_halves<L / 2>(half, op);
  }
}

struct Plus {
  template <typename V>
  V operator()(V a, V b) const { return a + b; }
};

struct Max {
  template <typename V>
  V operator()(V a, V b) const { return a > b ? a : b; }
};

// The lanes of each of C vectors combined by `op` into out[0 .. C-1]. With AVX-512, 16 vectors at
// once by halving, two vectors' halves packed in each operation: the same additions as
// reduce_halves, so a sum's bits do not depend on the vectors summed beside it, at a fraction of
// the instructions of 16 reduce_halves (16 dot products ending a matmul tile, or 16 keys' scores,
// cost 15 shuffle pairs, not 64).
template <int C, typename Op>
void reduce_lanes(const Vec* v, float* out, Op op) {
#if defined(__AVX512F__)
  for (int first = 0; first < C; first += 16) {
    Vec level[16];
    for (int i = 0; i < 16; ++i) level[i] = first + i < C ? v[first + i] : Vec{};
    // 16 vectors -> 8: lanes 0-7 of the i-th hold vector 2i's halves combined, lanes 8-15 vector 2i+1's
    for (int i = 0; i < 8; ++i)
      level[i] = op(__builtin_shufflevector(level[2 * i], level[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                            19, 20, 21, 22, 23),
                    __builtin_shufflevector(level[2 * i], level[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26,
                                            27, 28, 29, 30, 31));
    // 8 -> 4: four vectors' 4 partial results each
    for (int i = 0; i < 4; ++i)
      level[i] = op(__builtin_shufflevector(level[2 * i], level[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                            19, 24, 25, 26, 27),
                    __builtin_shufflevector(level[2 * i], level[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                            23, 28, 29, 30, 31));
    // 4 -> 2: eight vectors' 2 partial results each
    for (int i = 0; i < 2; ++i)
      level[i] = op(__builtin_shufflevector(level[2 * i], level[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                            21, 24, 25, 28, 29),
                    __builtin_shufflevector(level[2 * i], level[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                            23, 26, 27, 30, 31));
    // 2 -> 1: lane i is vector first + i's result
    const Vec total = op(__builtin_shufflevector(level[0], level[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22,
                                                 24, 26, 28, 30),
                         __builtin_shufflevector(level[0], level[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25,
                                                 27, 29, 31));
    for (int i = 0; i < 16 && first + i < C; ++i) out[first + i] = total[i];
  }
#else
  for (int i = 0; i < C; ++i) {
    float lanes[kLanes];
    std::memcpy(lanes, &v[i], sizeof(Vec));
    out[i] = reduce_halves<kLanes>(lanes, op);
  }
#endif
}

// The lane sums of C vectors into sums[0 .. C-1] (reduce_lanes' additions).
template <int C>
void sum_lanes(const Vec* v, float* sums) { reduce_lanes<C>(v, sums, Plus{}); }

// e^x for softmax's shifted scores (x <= 0, -inf and NaN included), kLanes at a time: e^x =
// 2^n e^r with n = round(x / ln 2) and r = x - n ln 2 in [-ln 2 / 2, ln 2 / 2] (ln 2 in two parts,
// so r keeps its bits), e^r by its Taylor series to r^7 (relative error below 2^-24 over that
// range). Below -87.3 e^x is under fp32's smallest normal: 0. A NaN stays NaN.
inline Vec exp_nonpositive(Vec x) {
  const Vec low = Vec{} - 87.3f;
  const Vec safe = x < low ? low : x;                  // NaN compares false: kept
  const Int n = __builtin_convertvector(safe * 1.44269504f - 0.5f, Int);  // truncation: round(x / ln 2) for x <= 0
  const Vec nf = __builtin_convertvector(n, Vec);
  const Vec r = (safe - nf * 0.693145751953125f) - nf * 1.42860676533018e-06f;
  Vec p = Vec{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const Int scale_bits = (n + 127) << 23;  // 2^n: n >= -126 here
  const Vec e = p * reinterpret_cast<const Vec&>(scale_bits);
  return x < low ? Vec{} : e;
}

}  // namespace host_vectors
