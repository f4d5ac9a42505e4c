// Pair panels dequantized to W^T [K, N] bf16 for oneDNN's GEMM: the prompts of AVX512-BF16
// targets without AMX (qpanel_linear.cpp kVnniMaxRows; with AMX, qpanel_amx.h multiplies the
// dequantized runs in tiles instead).
#pragma once

#include "qpanel_vnni.h"

namespace aotllm {

#if defined(__AVX512BF16__)
// W^T [K, N] bf16 (wt) from the pair panels, each value q x s (+ min) rounded once to bf16,
// as the row layout's dequantization (quant_linear.cpp dequant_into): prompts' GEMM.
// A pair's 32 int16 values (column j, k % 2) are permuted to (k % 2, column j), so each half
// is 16 columns of one k: 32 contiguous bytes of a row of W^T, no transpose. A thread sweeps
// its panels inside each run so that the rows of W^T it writes are filled left to right.
inline void dequant_qpanels_kn(const QWeight& w, at::BFloat16* wt) {
  const int64_t K = w.K, N = w.N, runs = K / kRun;
  alignas(64) int16_t perm[32];
  for (int i = 0; i < 32; ++i) perm[i] = static_cast<int16_t>(2 * (i % 16) + i / 16);
  at::parallel_for(0, N / kVCols, 1, [&](int64_t begin, int64_t end) {
    const __m512i idx = _mm512_load_si512(perm);
    GroupCounter gc(w);
    for (int64_t r = 0; r < runs; ++r, gc.next()) {
      const int64_t g = gc.g;
      for (int64_t p = begin; p < end; ++p) {
        const __m512 s = group_vec(w.scales, p, w.groups, g);
        const __m512 mn = w.mins ? group_vec(w.mins, p, w.groups, g)
                                 : (w.int4 ? _mm512_mul_ps(s, _mm512_set1_ps(-8.f)) : _mm512_setzero_ps());
        const uint8_t* wr = w.q + p * kVCols * (w.int4 ? K / 2 : K) + r * kRun * kVCols / (w.int4 ? 2 : 1);
        for (int64_t t = 0; t < kRun / 2; ++t) {
          __m512i v;
          if (w.int4) {
            const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + t * 16)));
            v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, _mm256_set1_epi16(15))),
                                   _mm256_srli_epi16(b, 4), 1);
          } else {
            v = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + t * 32)));
          }
          v = _mm512_permutexvar_epi16(idx, v);  // (k % 2, column)
          for (int64_t half = 0; half < 2; ++half) {
            const __m256i h = half ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v);
            const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(h)), s, mn);
            const int64_t k = r * kRun + 2 * t + half;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(wt + k * N + p * kVCols),
                                (__m256i)_mm512_cvtneps_pbh(f));
          }
        }
      }
    }
  });
}
#endif

}  // namespace aotllm
