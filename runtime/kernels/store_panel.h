// A panel's float32 sums into the output: the bias added, rounded once to the output's dtype,
// 16 columns a vector.
//
// Why: every panel kernel ends its pass with rows x 16 float32 sums. Stored one element at a
// time, c10's conversion to bf16 (a NaN test, then round-to-nearest-even on the bits) took
// about as many instructions per output as the pass's FMAs took per column: at 16 rows of
// x over a panel of K = 576, 256 scalar conversions beside 576 k-steps. Here the same
// rounding runs on 16 lanes, bit for bit what the scalar cast gives (NaN -> 0x7FC0,
// denormals kept; `vcvtneps2bf16` flushes them, so it is not used even where it exists).
// Half goes through the scalar cast.
#pragma once

#include <ATen/ATen.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <type_traits>

namespace aotllm {

#if defined(__AVX512F__)
// 16 floats to bf16, rounded as c10::BFloat16(float).
inline __m256i round_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i biased = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  __m512i r = _mm512_srli_epi32(biased, 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}
#elif defined(__AVX2__)
// 8 floats to bf16, rounded as c10::BFloat16(float).
inline __m128i round_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i biased = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  __m256i r = _mm256_srli_epi32(biased, 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0),
                         _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // r's lanes hold values below 2^16: packing with unsigned saturation keeps them.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
#endif

// y[m][j] = Y(c[m][j] + bias[j]) for m < rows, j < 16: c [rows, 16] float32 sums, bias the
// panel's 16 (or none), y the panel's first output, rows ldy apart.
template <typename Y>
inline void store_panel(const float* c, int64_t rows, const float* bias, Y* y, int64_t ldy) {
  constexpr bool kVector = std::is_same_v<Y, float> || std::is_same_v<Y, at::BFloat16>;
  for (int64_t m = 0; m < rows; ++m) {
    const float* cm = c + m * 16;
    Y* ym = y + m * ldy;
#if defined(__AVX512F__)
    if constexpr (kVector) {
      // + 0.f without a bias too, as the scalar form: -0.f comes out +0.f either way.
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(cm),
                                     bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps());
      if constexpr (std::is_same_v<Y, float>) _mm512_storeu_ps(ym, v);
      else _mm256_storeu_si256(reinterpret_cast<__m256i*>(ym), round_bf16(v));
      continue;
    }
#elif defined(__AVX2__)
    if constexpr (kVector) {
      for (int64_t h = 0; h < 16; h += 8) {
        const __m256 v = _mm256_add_ps(_mm256_loadu_ps(cm + h),
                                       bias ? _mm256_loadu_ps(bias + h) : _mm256_setzero_ps());
        if constexpr (std::is_same_v<Y, float>) _mm256_storeu_ps(ym + h, v);
        else _mm_storeu_si128(reinterpret_cast<__m128i*>(ym + h), round_bf16(v));
      }
      continue;
    }
#endif
    for (int64_t j = 0; j < 16; ++j) ym[j] = static_cast<Y>(cm[j] + (bias ? bias[j] : 0.f));
  }
}

}  // namespace aotllm
