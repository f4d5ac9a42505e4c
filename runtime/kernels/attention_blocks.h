// The block-level pieces of the paged attention kernels (paged_attention.cpp): a block's
// scores for a group of queries (float32 FMAs on the keys widened in registers, or
// `vdpbf16ps` on the bf16 keys as stored), the online softmax's exp in vector registers, and
// the values weighted into the accumulators, widened in registers as they are read. No
// block is copied: a widening pass through a float32 buffer stored and re-read every key
// and value row once more than the arithmetic needed.
#pragma once

#include <ATen/ATen.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <limits>

#include "prefetch.h"
#include "tile_gemm.h"

namespace aotllm::attn {
template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// A cache value as float32, and runs of 16 (AVX-512) or 8 (AVX2) of them widened in a
// register: bf16 by a shift, half by F16C, float as it is.
#if defined(__AVX512F__)
template <typename T>  // any other dtype (float64 caches): lane by lane
inline __m512 load16(const T* p) {
  alignas(64) float f[16];
  for (int i = 0; i < 16; ++i) f[i] = to_f(p[i]);
  return _mm512_load_ps(f);
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif
#if defined(__AVX2__)
template <typename T>
inline __m256 load8(const T* p) {
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = to_f(p[i]);
  return _mm256_load_ps(f);
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// Asks for n cache rows of `bytes` each, `stride` elements apart, ahead of their use: the
// next block's keys and values. A block of one head is 16 rows of 128 bytes (SmolLM2), too
// short a run for the hardware's stream prefetcher to ramp up on, and the blocks of a
// sequence lie wherever the allocator put them: without this, the first use of each line
// stalled (batch 16, context 128-528, 30 layers: two thirds of `attend`'s own time sat on
// the load that widens the values).
template <typename T>
inline void prefetch_rows(const T* base, int64_t n, int64_t stride, int64_t bytes) {
  for (int64_t t = 0; t < n; ++t) prefetch_lines(base + t * stride, bytes);
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

// exp_neg on every lane (the same polynomial): a block's softmax takes 16 (or 8) scores an
// instruction, where the scalar form took one.
#if defined(__AVX512F__)
inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 round = _mm512_set1_ps(12582912.f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), round), round);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.38888889e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.33333333e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16666667e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.66666667e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 round = _mm256_set1_ps(12582912.f);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f), round), round);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.38888889e-3f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.33333333e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.16666667e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.66666667e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}
// The lanes t + [0, 8) that fall in [lo, hi), as a mask of all-ones lanes.
inline __m256i lanes_in(int64_t t, int64_t lo, int64_t hi) {
  const __m256i idx = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                       _mm256_set1_epi32(static_cast<int32_t>(t)));
  const __m256i ge = _mm256_cmpgt_epi32(idx, _mm256_set1_epi32(static_cast<int32_t>(lo - 1)));
  const __m256i lt = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(hi)), idx);
  return _mm256_and_si256(ge, lt);
}
#endif

// One query's scores of a block, p[0, n), of which the keys [a, ni) are visible (a < ni):
// those become exp(score - m'), the rest 0, where m' is the running maximum m taken over
// them; m and the running sum l are updated. Returns the factor the query's accumulator
// must be scaled by (exp(m - m'): ~0 on the first block, where m is -inf).
inline float block_softmax(float* p, int64_t n, int64_t a, int64_t ni, float& m, float& l) {
#if defined(__AVX512F__)
  const auto live = [&](int64_t t) {  // the lanes t + [0, 16) in [a, ni)
    const int64_t lo = std::clamp<int64_t>(a - t, 0, 16), hi = std::clamp<int64_t>(ni - t, 0, 16);
    return static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
  };
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = a / 16 * 16; t < ni; t += 16)
    top = _mm512_mask_max_ps(top, live(t), top, _mm512_maskz_loadu_ps(live(t), p + t));
  const float m_new = std::max(m, _mm512_reduce_max_ps(top));
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = live(t);
    const __m512 e = _mm512_maskz_mov_ps(k, exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + t), mv)));
    sum = _mm512_add_ps(sum, e);
    const int64_t in = std::min<int64_t>(16, n - t);
    _mm512_mask_storeu_ps(p + t, static_cast<__mmask16>((1u << in) - 1), e);
  }
  const float lsum = _mm512_reduce_add_ps(sum);
#elif defined(__AVX2__) && defined(__FMA__)
  const float ninf = -std::numeric_limits<float>::infinity();
  __m256 top = _mm256_set1_ps(ninf);
  for (int64_t t = a / 8 * 8; t < ni; t += 8) {
    const __m256i k = lanes_in(t, a, ni);
    const __m256 x = _mm256_blendv_ps(_mm256_set1_ps(ninf), _mm256_maskload_ps(p + t, k),
                                      _mm256_castsi256_ps(k));
    top = _mm256_max_ps(top, x);
  }
  __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
  t4 = _mm_max_ss(t4, _mm_movehdup_ps(t4));
  const float m_new = std::max(m, _mm_cvtss_f32(t4));
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; t += 8) {
    const __m256i k = lanes_in(t, a, ni);
    const __m256 e = _mm256_and_ps(exp_neg(_mm256_sub_ps(_mm256_maskload_ps(p + t, k), mv)),
                                   _mm256_castsi256_ps(k));
    sum = _mm256_add_ps(sum, e);
    _mm256_maskstore_ps(p + t, lanes_in(t, 0, n), e);
  }
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
  const float lsum = _mm_cvtss_f32(s4);
#else
  const float m_new = std::max(m, *std::max_element(p + a, p + ni));
  float lsum = 0.f;
  for (int64_t t = a; t < ni; ++t) {
    p[t] = exp_neg(p[t] - m_new);
    lsum += p[t];
  }
  std::fill(p, p + a, 0.f);
  std::fill(p + ni, p + n, 0.f);
#endif
  const float corr = exp_neg(m - m_new);
  l = lsum + l * corr;
  m = m_new;
  return corr;
}

#if defined(__AVX2__) && defined(__FMA__)
// The sums of four vectors, one a lane.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

// Scores of one block: probs[i * bs + t] = q_i . k_t for the group's g queries (qf [gp, D],
// float32, zero rows past g) and the block's n keys, read in place (key t at kb + t * k_slot)
// and widened in registers.
template <typename K>
void block_scores(const float* qf, const K* kb, int64_t k_slot, int64_t n, int64_t g,
                  int64_t gp, int64_t D, float* probs, int64_t bs) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    // Four queries x two keys a pass: eight independent FMA chains (one dot product a chain
    // waited on the FMA latency: most of the kernel's time before), reduced four at a time.
    alignas(16) float s[2][4];
    for (int64_t i = 0; i < gp; i += 4) {
      const float* q0 = qf + i * D;
      const int64_t heads = std::min<int64_t>(4, g - i);
      for (int64_t t = 0; t < n; t += 2) {
        const K* k0 = kb + t * k_slot;
        const K* k1 = t + 1 < n ? k0 + k_slot : k0;  // an odd last key pairs with itself
        __m256 a[8];
#pragma GCC unroll 8
        for (auto& v : a) v = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 x0 = load8(k0 + d), x1 = load8(k1 + d);
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
    const K* kr = kb + t * k_slot;
    for (int64_t i = 0; i < g; ++i) {
      const float* qi = qf + i * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qi[d] * to_f(kr[d]);
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

// acc_i += sum_t p_i[t] v_t, G queries (a group of rows i0.. of probs and acc) over one
// pass of the block's n values (value t at vb + t * v_slot), kW lanes x W registers of
// dimensions from d0: each value row is read and widened once for the G queries, in
// registers. The sums run over t in order, the same for every G.
#if defined(__AVX512F__)
constexpr int kLanes = 16, kPassRegs = 4, kPassRows = 4;  // 64 dimensions x 4 queries
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8, kPassRegs = 4, kPassRows = 2;  // 32 dimensions x 2 queries
#endif
#if defined(__AVX2__) && defined(__FMA__)
template <int G, typename V>
void values_pass(const float* probs, const V* vb, int64_t v_slot, int64_t n, int64_t d0,
                 float* acc, int64_t D, int64_t bs) {
#if defined(__AVX512F__)
  using Vec = __m512;
  const auto load = [](const V* p) { return load16(p); };
  const auto bcast = [](float x) { return _mm512_set1_ps(x); };
  const auto fma = [](Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); };
  const auto ld = [](const float* p) { return _mm512_loadu_ps(p); };
  const auto st = [](float* p, Vec v) { _mm512_storeu_ps(p, v); };
#else
  using Vec = __m256;
  const auto load = [](const V* p) { return load8(p); };
  const auto bcast = [](float x) { return _mm256_set1_ps(x); };
  const auto fma = [](Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); };
  const auto ld = [](const float* p) { return _mm256_loadu_ps(p); };
  const auto st = [](float* p, Vec v) { _mm256_storeu_ps(p, v); };
#endif
  Vec a[G][kPassRegs];
  for (int i = 0; i < G; ++i)
    for (int j = 0; j < kPassRegs; ++j) a[i][j] = ld(acc + i * D + d0 + j * kLanes);
  for (int64_t t = 0; t < n; ++t) {
    const V* vr = vb + t * v_slot + d0;
    Vec v[kPassRegs];
    for (int j = 0; j < kPassRegs; ++j) v[j] = load(vr + j * kLanes);
    for (int i = 0; i < G; ++i) {
      const Vec p = bcast(probs[i * bs + t]);
      for (int j = 0; j < kPassRegs; ++j) a[i][j] = fma(p, v[j], a[i][j]);
    }
  }
  for (int i = 0; i < G; ++i)
    for (int j = 0; j < kPassRegs; ++j) st(acc + i * D + d0 + j * kLanes, a[i][j]);
}
#endif

// acc_i += sum_t p_i[t] v_t for the group's g queries over the block's n values, read in
// place (value t at vb + t * v_slot).
template <typename V>
void block_values(const float* probs, const V* vb, int64_t v_slot, int64_t n, int64_t g,
                  int64_t D, float* acc, int64_t bs) {
  int64_t d0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  constexpr int64_t width = kLanes * kPassRegs;
  for (; d0 + width <= D; d0 += width) {
    for (int64_t i = 0; i < g; i += kPassRows) {
      const float* pi = probs + i * bs;
      float* ai = acc + i * D;
      switch (std::min<int64_t>(kPassRows, g - i)) {
        case 1: values_pass<1>(pi, vb, v_slot, n, d0, ai, D, bs); break;
#if defined(__AVX512F__)
        case 2: values_pass<2>(pi, vb, v_slot, n, d0, ai, D, bs); break;
        case 3: values_pass<3>(pi, vb, v_slot, n, d0, ai, D, bs); break;
#endif
        default: values_pass<kPassRows>(pi, vb, v_slot, n, d0, ai, D, bs); break;
      }
    }
  }
#endif
  for (int64_t i = 0; i < g; ++i) {  // what is left of D (all of it without AVX2)
    const float* pi = probs + i * bs;
    float* ai = acc + i * D;
    for (int64_t t = 0; t < n; ++t) {
      const float p = pi[t];
      const V* vr = vb + t * v_slot;
#pragma omp simd
      for (int64_t d = d0; d < D; ++d) ai[d] += p * to_f(vr[d]);
    }
  }
}

}  // namespace aotllm::attn
