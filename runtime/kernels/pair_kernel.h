// The `vdpbf16ps` pass over bf16 pair panels (contract/layout.py "pairs16": a pair of k for
// a panel's 16 columns is one 512-bit vector): pair_linear.cpp's bf16 weights, and
// qpanel_linear.cpp's int8 weights dequantized to the same panels once a call.
#pragma once

#include <algorithm>
#include <cstdint>

namespace aotllm {

constexpr int64_t kPairCols = 16;  // a panel's columns (contract/layout.py PANEL_COLUMNS)

}  // namespace aotllm

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace aotllm {

// MR rows of x (pairs of bf16 as int32) against NP adjacent panels from `pw`: c [NP][MR][16].
// At most 16 accumulators: with 8 rows over 2 panels, one broadcast pair of x feeds two
// products and a step loads 10 vectors for 16 `vdpbf16ps` (4 rows over 1 panel: 10 for 8).
//
// One chain a row and panel whatever MR and NP: a row's sums must not depend on how many rows
// share its pass (the rows of a verify step and of plain decode give bit-identical logits;
// two chains where MR x NP is small broke that).
//
// `next` (or null): the thread's next panels, prefetched into L2 line for line as these are
// read, by the last of several row passes. A decode step of 16 rows is two passes of 8
// rows: the first waits on memory while the second only computes, from L2; the next panels'
// lines requested during the second keep memory busy through both.
//
// Nothing else is prefetched: a thread streams its panels once, and a one-row pass (memory
// bound) ran faster on the hardware prefetcher alone than with a prefetch 4 KiB ahead into
// L1 (SmolLM2 bf16 decode step, 1 row, Zen 5: 13.2-14.5 -> 11.0-11.8 ms in process).
template <int MR, int NP>
void dpbf16_rows(const int32_t* xp, int64_t K, const char* pw, float* c, const char* next) {
  static_assert(MR * NP <= 16, "accumulators beyond the register file");
  const int64_t stride = kPairCols * K * 2;  // bytes from one panel to the next
  __m512 acc[MR][NP];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  for (int64_t t = 0; t < K / 2; ++t) {
    __m512bh wv[NP];
    for (int q = 0; q < NP; ++q) {
      if (next != nullptr) _mm_prefetch(next + q * stride + t * 64, _MM_HINT_T1);
      wv[q] = (__m512bh)_mm512_loadu_si512(pw + q * stride + t * 64);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[r * K / 2 + t]);
      for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], wv[q], xv);
    }
  }
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < MR; ++r) _mm512_storeu_ps(c + (q * MR + r) * kPairCols, acc[r][q]);
}

constexpr int64_t kMR = 8;  // rows a vdpbf16ps pass

// Rows a pass for M input rows: split evenly into passes of at most kMR (12 rows: 6 + 6, not
// 8 + 4).
inline int64_t dpbf16_pass_rows(int64_t M) {
  const int64_t passes = (M + kMR - 1) / kMR;
  return (M + passes - 1) / passes;
}

// dpbf16_rows<mr, NP> for 1 <= mr <= MR (counted down; at most 16 accumulators).
template <int NP, int MR = std::min<int>(kMR, 16 / NP)>
void dpbf16_any(int64_t mr, const int32_t* xp, int64_t K, const char* pw, float* c,
                const char* next) {
  if constexpr (MR > 1) {
    if (mr < MR) return dpbf16_any<NP, MR - 1>(mr, xp, K, pw, c, next);
  }
  dpbf16_rows<MR, NP>(xp, K, pw, c, next);
}

}  // namespace aotllm
#endif
