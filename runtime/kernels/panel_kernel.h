// The outer-product micro-kernel over weights in panels of 16 output columns, K-major
// (panel_linear.cpp's layout notes): shared by linear_panel (panels stored at build time)
// and the quantized linears' batched path (quant_panel.h: panels dequantized per call).
#pragma once

#include <ATen/ATen.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <type_traits>

namespace aotllm {

constexpr int64_t kPanel = 16;
#if defined(__AVX512F__)
// AVX-512: a k of a panel is one vector of 16 columns, and each row's x is broadcast from
// memory inside its FMA, so a pass takes 16 rows in 16 of the 32 registers (a decode step
// of 16 sequences: one pass, where AVX2 takes four, each widening the panel again).
// Measured against the AVX2 kernel built for the same level (SmolLM2's 30 layers of linears
// from memory, 2 threads, AVX-512 forced on an Intel Xeon with AMX, two rounds, ms): 16 rows
// 28.1-28.2 -> 22.0-23.2 (its LM head 5.7 -> 4.5-4.7), 64 rows 83-84 -> 66-69, 8 rows
// 17.3-17.9 -> 15.5-16.5; 1 row level (memory bound).
constexpr int64_t kRows = 16;
#else
// At most 5 rows a pass: 10 accumulators, 2 weight vectors, a broadcast and the zero the
// bf16 widening unpacks against. At 6 rows (12 accumulators) the 16 AVX2 registers are
// all taken and GCC spilled an accumulator inside the k loop, a store and reload per k
// that made the kernel 1.75x slower (16 rows, one thread: 85 ms for SmolLM2's 30 layers
// against 48 ms without the spill).
constexpr int64_t kRows = 5;
#endif

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(at::Half v) { return static_cast<float>(v); }

#if defined(__AVX512F__)
// One k of a full panel as one float vector, columns in order.
inline __m512 widen16(const at::BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __m512 widen16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
constexpr int64_t kPermId[kPanel] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
// Output lane i holds column perm()[i] of the panel: in order here.
template <typename W>
constexpr const int64_t* perm() {
  return kPermId;
}

// out[m][i] = sum_k x[m][k] * panel[k][i], for MR rows of x (ldx apart) and K values of k;
// with `add`, the sums are added to what out holds (a panel taken in chunks of K). With
// kPrefetch, each k also prefetches the line at pf + k * pf_step: the caller's share of the
// next panel for this pass (panel_gemm's note). Each sum takes its k in order, one FMA a k,
// as the AVX2 kernel's: the two give the same bits.
template <int64_t MR, bool kPrefetch, typename W>
inline void panel_rows(const float* x, int64_t ldx, int64_t K, const W* p, float* out, bool add,
                       const char* pf, int64_t pf_step) {
  __m512 c[MR];
#pragma GCC unroll 16
  for (int64_t m = 0; m < MR; ++m) c[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w = widen16(p + k * kPanel);
    if constexpr (kPrefetch) _mm_prefetch(pf + k * pf_step, _MM_HINT_T0);
#pragma GCC unroll 16
    for (int64_t m = 0; m < MR; ++m) c[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + k]), w, c[m]);
  }
#pragma GCC unroll 16
  for (int64_t m = 0; m < MR; ++m) {
    if (add) c[m] = _mm512_add_ps(c[m], _mm512_loadu_ps(out + m * kPanel));
    _mm512_storeu_ps(out + m * kPanel, c[m]);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// One k of a full panel as two float vectors. For bf16, unpacking against zero within each
// 128-bit lane is the cheapest widening (one load, two shuffles) and yields the columns in
// the order kPerm names; fp16 and float32 come out in order.
inline void widen(const at::BFloat16* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
}
inline void widen(const at::Half* p, __m256& lo, __m256& hi) {
  lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}
inline void widen(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
// Output lane i of the two accumulators holds column kPerm[i] of the panel.
constexpr int64_t kPermBf16[kPanel] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
constexpr int64_t kPermId[kPanel] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
template <typename W>
constexpr const int64_t* perm() {
  return std::is_same_v<W, at::BFloat16> ? kPermBf16 : kPermId;
}

// out[m][i] (lane order) = sum_k x[m][k] * panel[k][perm[i]], for MR rows of x (ldx apart)
// and K values of k; with `add`, the sums are added to what out holds (a panel taken in
// chunks of K). With kPrefetch, each k also prefetches the line at pf + k * pf_step: the
// caller's share of the next panel for this pass (panel_gemm's note).
template <int64_t MR, bool kPrefetch, typename W>
inline void panel_rows(const float* x, int64_t ldx, int64_t K, const W* p, float* out, bool add,
                       const char* pf, int64_t pf_step) {
  __m256 c0[MR], c1[MR];
#pragma GCC unroll 8
  for (int64_t m = 0; m < MR; ++m) c0[m] = c1[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0, w1;
    widen(p + k * kPanel, w0, w1);
    if constexpr (kPrefetch) _mm_prefetch(pf + k * pf_step, _MM_HINT_T0);
#pragma GCC unroll 8
    for (int64_t m = 0; m < MR; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
      c0[m] = _mm256_fmadd_ps(xb, w0, c0[m]);
      c1[m] = _mm256_fmadd_ps(xb, w1, c1[m]);
    }
  }
#pragma GCC unroll 8
  for (int64_t m = 0; m < MR; ++m) {
    if (add) {
      c0[m] = _mm256_add_ps(c0[m], _mm256_loadu_ps(out + m * kPanel));
      c1[m] = _mm256_add_ps(c1[m], _mm256_loadu_ps(out + m * kPanel + 8));
    }
    _mm256_storeu_ps(out + m * kPanel, c0[m]);
    _mm256_storeu_ps(out + m * kPanel + 8, c1[m]);
  }
}

#endif

#if defined(__AVX2__) && defined(__FMA__)
// panel_rows<mr> for 1 <= mr <= MR (MR: kRows, counted down).
template <bool kPrefetch, typename W, int64_t MR = kRows>
inline void panel_pass(int64_t mr, const float* x, int64_t ldx, int64_t K, const W* p,
                       float* out, bool add, const char* pf, int64_t pf_step) {
  if constexpr (MR > 1) {
    if (mr < MR) return panel_pass<kPrefetch, W, MR - 1>(mr, x, ldx, K, p, out, add, pf, pf_step);
  }
  panel_rows<MR, kPrefetch>(x, ldx, K, p, out, add, pf, pf_step);
}

// One pass of mr <= kRows rows over a panel; `pf` (or null): what to prefetch meanwhile.
template <typename W>
inline void panel_block(int64_t mr, const float* x, int64_t ldx, int64_t K, const W* p,
                        float* out, bool add = false, const char* pf = nullptr,
                        int64_t pf_step = 0) {
  if (pf != nullptr) panel_pass<true>(mr, x, ldx, K, p, out, add, pf, pf_step);
  else panel_pass<false>(mr, x, ldx, K, p, out, add, nullptr, 0);
}
#endif

}  // namespace aotllm
