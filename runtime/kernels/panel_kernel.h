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

// At most 5 rows a pass: 10 accumulators, 2 weight vectors, a broadcast and the zero the
// bf16 widening unpacks against. At 6 rows (12 accumulators) the 16 AVX2 registers are
// all taken and GCC spilled an accumulator inside the k loop, a store and reload per k
// that made the kernel 1.75x slower (16 rows, one thread: 85 ms for SmolLM2's 30 layers
// against 48 ms without the spill).
constexpr int64_t kPanel = 16, kRows = 5;

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(at::Half v) { return static_cast<float>(v); }

#if defined(__AVX2__) && defined(__FMA__)
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

template <bool kPrefetch, typename W>
inline void panel_pass(int64_t mr, const float* x, int64_t ldx, int64_t K, const W* p,
                       float* out, bool add, const char* pf, int64_t pf_step) {
  switch (mr) {
    case 5: panel_rows<5, kPrefetch>(x, ldx, K, p, out, add, pf, pf_step); break;
    case 4: panel_rows<4, kPrefetch>(x, ldx, K, p, out, add, pf, pf_step); break;
    case 3: panel_rows<3, kPrefetch>(x, ldx, K, p, out, add, pf, pf_step); break;
    case 2: panel_rows<2, kPrefetch>(x, ldx, K, p, out, add, pf, pf_step); break;
    default: panel_rows<1, kPrefetch>(x, ldx, K, p, out, add, pf, pf_step); break;
  }
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
