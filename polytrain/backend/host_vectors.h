// The host kernels' fp32 vectors (host_matmul.cpp, host_attention.cpp): GCC's vector extension,
// as wide as the CPU the kernels are built on (-march=native), and how bf16 is widened into them.

#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace host_vectors {

#if defined(__AVX512F__)
constexpr int kLanes = 16;  // one 512-bit register of fp32
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;   // 128-bit vectors (SSE, NEON)
#endif

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(sizeof(float))));
typedef uint16_t Half __attribute__((vector_size(kLanes * sizeof(uint16_t)), aligned(sizeof(uint16_t))));
typedef uint32_t Word __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int32_t Int __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Vec load(const float* p) { return *reinterpret_cast<const Vec*>(p); }  // Vec is 4-byte aligned

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

// A vector's lane sum, by halving: lanes i and i + L/2 are added, then again on the half. Every
// vector gets the same additions, so a sum's bits do not depend on what is summed beside it.
template <int L>
float sum_halves(const float* lanes) {
  if constexpr (L == 1) {
    return lanes[0];
  } else {
    float half[L / 2];
    for (int i = 0; i < L / 2; ++i) half[i] = lanes[i] + lanes[i + L / 2];
    return sum_halves<L / 2>(half);
  }
}

}  // namespace host_vectors
