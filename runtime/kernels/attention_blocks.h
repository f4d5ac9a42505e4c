// The block-level pieces of the paged attention kernels (paged_attention.cpp): a block's
// keys and values widened to float32, its scores for a group of queries (float32 FMAs, or
// `vdpbf16ps` on the bf16 keys as stored), the exp of the online softmax, and the values
// weighted into the accumulators.
#pragma once

#include <ATen/ATen.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

#include "tile_gemm.h"

namespace aotllm::attn {
template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// One cache row as float32: bf16 widened by a shift (vectorized), others converted.
template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = to_f(src[d]);
}
template <>
inline void widen(const at::BFloat16* src, float* dst, int64_t n) {
  aotllm::bf16_to_f32(reinterpret_cast<const uint16_t*>(src), dst, n);
}

// Asks for n cache rows of `bytes` each, `stride` elements apart, ahead of their use: the
// next block's keys and values. A block of one head is 16 rows of 128 bytes (SmolLM2), too
// short a run for the hardware's stream prefetcher to ramp up on, and the blocks of a
// sequence lie wherever the allocator put them: without this, the first use of each line
// stalled (batch 16, context 128-528, 30 layers: two thirds of `attend`'s own time sat on
// the load that widens the values).
template <typename T>
inline void prefetch_rows(const T* base, int64_t n, int64_t stride, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(base);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t b = 0; b < bytes; b += 64)
      __builtin_prefetch(p + t * stride * static_cast<int64_t>(sizeof(T)) + b, 0, 3);
}

// exp(x) for x <= 0 in a form the compiler vectorizes (std::exp is a scalar libm call, and
// a block's softmax calls it once per score): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2],
// p of degree 6 (relative error below 2e-7). Inputs under -87 return about 1e-38, not 0.
inline float exp_neg(float x) {
  x = std::max(x, -87.0f);
  const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest
  const float r = x - n * 0.693145752f - n * 1.42860677e-6f;
  float p = 1.38888889e-3f;
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, 4);
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// The sums of four vectors, one a lane.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

// Scores of one block: probs[i * bs + t] = q_i . k_t for the group's g queries (qf [gp, D],
// zero rows past g) and the block's n keys (kbuf [n, D], float32).
void block_scores(const float* qf, const float* kbuf, int64_t n, int64_t g, int64_t gp,
                  int64_t D, float* probs, int64_t bs) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    // Four queries x two keys a pass: eight independent FMA chains (one dot product a chain
    // waited on the FMA latency: most of the kernel's time before), reduced four at a time.
    alignas(16) float s[2][4];
    for (int64_t i = 0; i < gp; i += 4) {
      const float* q0 = qf + i * D;
      const int64_t heads = std::min<int64_t>(4, g - i);
      for (int64_t t = 0; t < n; t += 2) {
        const float* k0 = kbuf + t * D;
        const float* k1 = t + 1 < n ? k0 + D : k0;  // an odd last key pairs with itself
        __m256 a[8];
#pragma GCC unroll 8
        for (auto& v : a) v = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 x0 = _mm256_loadu_ps(k0 + d), x1 = _mm256_loadu_ps(k1 + d);
#pragma GCC unroll 4
          for (int64_t j = 0; j < 4; ++j) {
            const __m256 qv = _mm256_loadu_ps(q0 + j * D + d);
            a[j] = _mm256_fmadd_ps(qv, x0, a[j]);
            a[4 + j] = _mm256_fmadd_ps(qv, x1, a[4 + j]);
          }
        }
        _mm_store_ps(s[0], hsum4(a[0], a[1], a[2], a[3]));
        _mm_store_ps(s[1], hsum4(a[4], a[5], a[6], a[7]));
        for (int64_t j = 0; j < heads; ++j) {
          probs[(i + j) * bs + t] = s[0][j];
          if (t + 1 < n) probs[(i + j) * bs + t + 1] = s[1][j];
        }
      }
    }
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    const float* kr = kbuf + t * D;
    for (int64_t i = 0; i < g; ++i) {
      const float* qi = qf + i * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qi[d] * kr[d];
      probs[i * bs + t] = s;
    }
  }
}

#if defined(__AVX512BF16__)
constexpr bool kBf16Scores = true;
// block_scores for bf16 caches, from the keys as stored: `vdpbf16ps` multiplies 32 pairs of a
// query's and a key's values an instruction, exact products summed in float32 (the float
// path widened every key to float32 first, then took 8 products an FMA). qb [gp, D] holds
// the queries unscaled, in bf16 as the model gave them; the scale multiplies the sums.
void block_scores_bf16(const at::BFloat16* qb, const at::BFloat16* kb, int64_t k_slot,
                       int64_t n, int64_t g, int64_t gp, int64_t D, float sc, float* probs,
                       int64_t bs) {
  const auto fold = [](__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  };
  const __m128 scale = _mm_set1_ps(sc);
  alignas(16) float s[2][4];
  for (int64_t i = 0; i < gp; i += 4) {
    const at::BFloat16* q0 = qb + i * D;
    const int64_t heads = std::min<int64_t>(4, g - i);
    for (int64_t t = 0; t < n; t += 2) {
      const at::BFloat16* k0 = kb + t * k_slot;
      const at::BFloat16* k1 = t + 1 < n ? k0 + k_slot : k0;  // an odd last key: itself
      __m512 a[8];
      for (auto& v : a) v = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 32) {
        const __m512bh x0 = (__m512bh)_mm512_loadu_si512(k0 + d);
        const __m512bh x1 = (__m512bh)_mm512_loadu_si512(k1 + d);
        for (int64_t j = 0; j < 4; ++j) {
          const __m512bh qv = (__m512bh)_mm512_loadu_si512(q0 + j * D + d);
          a[j] = _mm512_dpbf16_ps(a[j], qv, x0);
          a[4 + j] = _mm512_dpbf16_ps(a[4 + j], qv, x1);
        }
      }
      _mm_store_ps(s[0], _mm_mul_ps(scale, hsum4(fold(a[0]), fold(a[1]), fold(a[2]), fold(a[3]))));
      _mm_store_ps(s[1], _mm_mul_ps(scale, hsum4(fold(a[4]), fold(a[5]), fold(a[6]), fold(a[7]))));
      for (int64_t j = 0; j < heads; ++j) {
        probs[(i + j) * bs + t] = s[0][j];
        if (t + 1 < n) probs[(i + j) * bs + t + 1] = s[1][j];
      }
    }
  }
}
#else
constexpr bool kBf16Scores = false;
#endif

// acc_i += sum_t p_i[t] v_t for the group's g queries over the block's n values (vbuf
// [n, D], float32).
void block_values(const float* probs, const float* vbuf, int64_t n, int64_t g, int64_t D,
                  float* acc, int64_t bs) {
  for (int64_t i = 0; i < g; ++i) {
    const float* pi = probs + i * bs;
    float* ai = acc + i * D;
    int64_t d0 = 0;
#if defined(__AVX512F__)
    // 64 dimensions a pass in four registers, the keys' weights broadcast.
    for (; d0 + 64 <= D; d0 += 64) {
      __m512 a[4];
      for (int64_t j = 0; j < 4; ++j) a[j] = _mm512_loadu_ps(ai + d0 + 16 * j);
      for (int64_t t = 0; t < n; ++t) {
        const __m512 p = _mm512_set1_ps(pi[t]);
        const float* vr = vbuf + t * D + d0;
        for (int64_t j = 0; j < 4; ++j) a[j] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16 * j), a[j]);
      }
      for (int64_t j = 0; j < 4; ++j) _mm512_storeu_ps(ai + d0 + 16 * j, a[j]);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    // 64 dimensions a pass in eight registers, the keys' weights broadcast: eight chains.
    for (; d0 + 64 <= D; d0 += 64) {
      __m256 a[8];
      for (int64_t j = 0; j < 8; ++j) a[j] = _mm256_loadu_ps(ai + d0 + 8 * j);
      for (int64_t t = 0; t < n; ++t) {
        const __m256 p = _mm256_broadcast_ss(pi + t);
        const float* vr = vbuf + t * D + d0;
        for (int64_t j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * j), a[j]);
      }
      for (int64_t j = 0; j < 8; ++j) _mm256_storeu_ps(ai + d0 + 8 * j, a[j]);
    }
#endif
    for (int64_t t = 0; t < n; ++t) {  // what is left of D (all of it without AVX2)
      const float p = pi[t];
      const float* vr = vbuf + t * D;
#pragma omp simd
      for (int64_t d = d0; d < D; ++d) ai[d] += p * vr[d];
    }
  }
}

}  // namespace aotllm::attn
