// Pair panels dequantized to bf16, a run at a time: the B tiles of AMX (qpanel_amx.h), and
// W^T [K, N] for oneDNN's GEMM, the prompts of AMX targets where AMX is not granted
// (qpanel_linear.cpp kVnniMaxRows).
#pragma once

#include "parallel.h"
#include "qpanel_vnni.h"

namespace aotllm {

#if defined(__AVX512BF16__)
// Run r of panel p as the B tile's 1 KiB: pair t's 16 columns x (k even, k odd) bf16. The
// weights are prefetched as in the VNNI passes: without it the dequantization waited on
// memory (30 layers, 16 rows, ms: int8 12.2-12.4 -> 9.6-9.8, int4 9.5-9.8 -> 6.7-7.1).
inline void dequant_run_tile(const QWeight& w, int64_t p, int64_t r, int64_t g, uint16_t* tile) {
  const int64_t K = w.K;
  alignas(64) static const int32_t lo_idx[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
  alignas(64) static const int32_t hi_idx[16] = {8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
  const __m512i il = _mm512_load_si512(lo_idx), ih = _mm512_load_si512(hi_idx);
  const __m512 s = group_vec(w.scales, p, w.groups, g);
  const __m512 mn = w.mins ? group_vec(w.mins, p, w.groups, g)
                           : (w.int4 ? _mm512_mul_ps(s, _mm512_set1_ps(-8.f)) : _mm512_setzero_ps());
  // the scales and zero points of columns 0-7 and 8-15, each twice (k even, k odd)
  const __m512 sl = _mm512_permutexvar_ps(il, s), sh = _mm512_permutexvar_ps(ih, s);
  const __m512 ml = _mm512_permutexvar_ps(il, mn), mh = _mm512_permutexvar_ps(ih, mn);
  const uint8_t* wr = w.q + p * kVCols * (w.int4 ? K / 2 : K) + r * kRun * kVCols / (w.int4 ? 2 : 1);
  prefetch_ahead(wr, kRun * kVCols / (w.int4 ? 2 : 1));
  for (int64_t t = 0; t < kRun / 2; ++t) {
    // int32: columns 0-7 and 8-15, (k even, k odd) each, widened straight from memory
    __m512i lo, hi;
    if (w.int4) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + t * 16)));
      lo = _mm512_and_si512(b, _mm512_set1_epi32(15));
      hi = _mm512_srli_epi32(b, 4);
    } else {
      lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + t * 32)));
      hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + t * 32 + 16)));
    }
    const __m512 fl = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), sl, ml);
    const __m512 fh = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), sh, mh);
    _mm512_store_si512(tile + t * 32, (__m512i)_mm512_cvtne2ps_pbh(fh, fl));
  }
}

// W^T [K, N] bf16 (wt) from the pair panels, each value q x s (+ min) rounded once to bf16,
// as the row layout's dequantization (quant_linear.cpp dequant_into): prompts' GEMM.
// A run's pairs come from dequant_run_tile as (column, k % 2) and are permuted to
// (k % 2, column), so each half is 16 columns of one k: 32 contiguous bytes of a row of W^T,
// no transpose. A thread sweeps its panels inside each run so that the rows of W^T it writes
// are filled left to right.
inline void dequant_qpanels_kn(const QWeight& w, at::BFloat16* wt) {
  const int64_t N = w.N, runs = w.K / kRun;
  alignas(64) int16_t perm[32];
  for (int i = 0; i < 32; ++i) perm[i] = static_cast<int16_t>(2 * (i % 16) + i / 16);
  aotllm::parallel_chunks(0, N / kVCols, 1, [&](int64_t begin, int64_t end) {
    const __m512i idx = _mm512_load_si512(perm);
    alignas(64) uint16_t tile[kRun * kVCols];
    GroupCounter gc(w);
    for (int64_t r = 0; r < runs; ++r, gc.next()) {
      for (int64_t p = begin; p < end; ++p) {
        dequant_run_tile(w, p, r, gc.g, tile);
        for (int64_t t = 0; t < kRun / 2; ++t) {
          const __m512i v = _mm512_permutexvar_epi16(idx, _mm512_load_si512(tile + t * 32));
          const int64_t k = r * kRun + 2 * t;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(wt + k * N + p * kVCols),
                              _mm512_castsi512_si256(v));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(wt + (k + 1) * N + p * kVCols),
                              _mm512_extracti64x4_epi64(v, 1));
        }
      }
    }
  });
}
#endif

}  // namespace aotllm
