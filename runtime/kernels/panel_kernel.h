// The outer-product micro-kernel over weights in panels of 16 output columns, K-major
// (panel_linear.cpp's layout notes): shared by linear_panel (panels stored at build time)
// and the quantized linears' batched path (quant_panel.h: panels dequantized per call).
#pragma once

#include <ATen/ATen.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
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
// 17.3-17.9 -> 15.5-16.5; 1 row level (memory bound). Up to 28 rows a pass (28 accumulators,
// the widened k and room to spare): a prompt's rows widen each panel once per 28 rows, not 16
// (one thread, weights in cache, AVX-512 forced on the Xeon, GFLOP/s over SmolLM2's four
// shapes, three rounds each: 128 rows 121-141 -> 129-151, 512 rows 107-139 -> 121-138); a
// decode step of up to 16 sequences is one pass of its rows, as before.
constexpr int64_t kRows = 28;
// Up to 4 rows (a decode step of 1-4 sequences) take 4 panels a pass (panel_group).
constexpr int64_t kGroupRows = 4;
#else
// At most 5 rows a pass: 10 accumulators, 2 weight vectors, a broadcast and the zero the
// bf16 widening unpacks against. At 6 rows (12 accumulators) the 16 AVX2 registers are
// all taken and GCC spilled an accumulator inside the k loop, a store and reload per k
// that made the kernel 1.75x slower (16 rows, one thread: 85 ms for SmolLM2's 30 layers
// against 48 ms without the spill).
constexpr int64_t kRows = 5;
// One row takes 4 panels a pass (panel_group): 8 accumulators. Two rows would need 16.
constexpr int64_t kGroupRows = 1;
#endif
// Panels a pass for up to kGroupRows rows. Why: a row's sum is one chain of FMAs, one a k,
// so a one-row pass over one panel issues its loads no faster than that chain (4 cycles a
// k), and the stream leaned on a software prefetch of the next panel, each prefetch into L1
// holding a fill buffer for a whole memory round trip. Four panels are four chains and four
// streams of loads in flight, which the hardware prefetchers follow without help (no
// software prefetch here). Each column still takes its k in order, one FMA a k: the same
// bits as one panel a pass. Measured (SmolLM2's 30 layers of linears and its LM head from
// memory, 2 threads, Intel Xeon with AMX, two rounds, ms): AVX-512 forced, 1 row 15.8-16.4
// -> 13.2-13.4, 2 rows 16.3-16.6 -> 13.6-14.3, 4 rows 17.3-18.2 -> 14.7-14.8, 8 rows level;
// AVX2 forced, 1 row 15.5-15.7 -> 12.7-13.6. A plain read of the same bytes, in the same
// calls: 10.2-11.0.
constexpr int64_t kGroupPanels = 4;

// x [M, K] (row-major) packed for passes of `rows` rows: the pass from row m (mr rows, the
// last may have fewer) at out + m * K, its element [k][r] at k * mr + r. Why: the kernel's
// broadcasts then read one pointer at fixed offsets. From MR row pointers (x + m * ldx),
// 16 at AVX-512, GCC ran out of general registers, kept the pointers in vector registers
// and moved one back per FMA: a vmovq on the FMA port and a reload from the stack in every
// k-step (perf annotate, AVX-512 forced on an Intel Xeon with AMX).
inline void pack_rows(const float* x, int64_t M, int64_t K, int64_t rows, float* out) {
  for (int64_t m = 0; m < M; m += rows) {
    const int64_t mr = std::min(rows, M - m);
    float* o = out + m * K;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < mr; ++r) o[k * mr + r] = x[(m + r) * K + k];
  }
}

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

// out[i][m][c] = sum_k x[k][m] * panel_i[k][c], for MR rows of x (packed: pack_rows), K values
// of k and NP panels (panel i at p + i * stride), out[i] at out + i * MR * kPanel; with `add`,
// the sums are added to what out holds (a panel taken in chunks of K). With kPrefetch, each k
// also prefetches the line at pf + k * pf_step: the caller's share of the next panel for this
// pass (panel_gemm's note). Each sum takes its k in order, one FMA a k, as the AVX2 kernel's:
// the two give the same bits, for any NP.
template <int64_t MR, int64_t NP, bool kPrefetch, typename W>
inline void panel_rows(const float* x, int64_t K, const W* p, int64_t stride, float* out,
                       bool add, const char* pf, int64_t pf_step) {
  __m512 c[NP][MR];
#pragma GCC unroll 4
  for (int64_t i = 0; i < NP; ++i)
#pragma GCC unroll 28
    for (int64_t m = 0; m < MR; ++m) c[i][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (kPrefetch) _mm_prefetch(pf + k * pf_step, _MM_HINT_T0);
    const float* xk = x + k * MR;
#pragma GCC unroll 4
    for (int64_t i = 0; i < NP; ++i) {
      const __m512 w = widen16(p + i * stride + k * kPanel);
#pragma GCC unroll 28
      for (int64_t m = 0; m < MR; ++m)
        c[i][m] = _mm512_fmadd_ps(_mm512_set1_ps(xk[m]), w, c[i][m]);
    }
  }
#pragma GCC unroll 4
  for (int64_t i = 0; i < NP; ++i)
#pragma GCC unroll 28
    for (int64_t m = 0; m < MR; ++m) {
      float* o = out + (i * MR + m) * kPanel;
      if (add) c[i][m] = _mm512_add_ps(c[i][m], _mm512_loadu_ps(o));
      _mm512_storeu_ps(o, c[i][m]);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
// One k of a full panel as two float vectors. For bf16, unpacking against zero within each
// 128-bit lane is the cheapest widening (one load, two shuffles): lo holds columns 0-3 and
// 8-11, hi 4-7 and 12-15 (panel_rows puts them in order once, at its end); fp16 and float32
// come out in order.
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

// out[i][m][c] = sum_k x[k][m] * panel_i[k][c], for MR rows of x (packed: pack_rows), K values
// of k and NP panels (panel i at p + i * stride), out[i] at out + i * MR * kPanel; with `add`,
// the sums are added to what out holds (a panel taken in chunks of K). With kPrefetch, each k
// also prefetches the line at pf + k * pf_step: the caller's share of the next panel for this
// pass (panel_gemm's note).
template <int64_t MR, int64_t NP, bool kPrefetch, typename W>
inline void panel_rows(const float* x, int64_t K, const W* p, int64_t stride, float* out,
                       bool add, const char* pf, int64_t pf_step) {
  __m256 c0[NP][MR], c1[NP][MR];
#pragma GCC unroll 4
  for (int64_t i = 0; i < NP; ++i)
#pragma GCC unroll 8
    for (int64_t m = 0; m < MR; ++m) c0[i][m] = c1[i][m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (kPrefetch) _mm_prefetch(pf + k * pf_step, _MM_HINT_T0);
#pragma GCC unroll 4
    for (int64_t i = 0; i < NP; ++i) {
      __m256 w0, w1;
      widen(p + i * stride + k * kPanel, w0, w1);
#pragma GCC unroll 8
      for (int64_t m = 0; m < MR; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + k * MR + m);
        c0[i][m] = _mm256_fmadd_ps(xb, w0, c0[i][m]);
        c1[i][m] = _mm256_fmadd_ps(xb, w1, c1[i][m]);
      }
    }
  }
#pragma GCC unroll 4
  for (int64_t i = 0; i < NP; ++i)
#pragma GCC unroll 8
    for (int64_t m = 0; m < MR; ++m) {
      __m256 lo = c0[i][m], hi = c1[i][m];
      if constexpr (std::is_same_v<W, at::BFloat16>) {  // widen's lane order to column order
        lo = _mm256_permute2f128_ps(c0[i][m], c1[i][m], 0x20);
        hi = _mm256_permute2f128_ps(c0[i][m], c1[i][m], 0x31);
      }
      float* o = out + (i * MR + m) * kPanel;
      if (add) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(o));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(o + 8));
      }
      _mm256_storeu_ps(o, lo);
      _mm256_storeu_ps(o + 8, hi);
    }
}

#endif

#if defined(__AVX2__) && defined(__FMA__)
// panel_rows<mr, NP> for 1 <= mr <= MR (MR: kRows, counted down).
template <bool kPrefetch, typename W, int64_t NP = 1, int64_t MR = kRows>
inline void panel_pass(int64_t mr, const float* x, int64_t K, const W* p, int64_t stride,
                       float* out, bool add, const char* pf, int64_t pf_step) {
  if constexpr (MR > 1) {
    if (mr < MR)
      return panel_pass<kPrefetch, W, NP, MR - 1>(mr, x, K, p, stride, out, add, pf, pf_step);
  }
  panel_rows<MR, NP, kPrefetch>(x, K, p, stride, out, add, pf, pf_step);
}

// One pass of mr <= kRows rows over a panel, the rows packed k-major (pack_rows: x[k][mr]);
// `pf` (or null): what to prefetch meanwhile.
template <typename W>
inline void panel_block(int64_t mr, const float* x, int64_t K, const W* p, float* out,
                        bool add = false, const char* pf = nullptr, int64_t pf_step = 0) {
  if (pf != nullptr) panel_pass<true>(mr, x, K, p, 0, out, add, pf, pf_step);
  else panel_pass<false>(mr, x, K, p, 0, out, add, nullptr, 0);
}

// One pass of mr <= kGroupRows rows over kGroupPanels panels, `stride` elements apart (the
// rows packed as for panel_block): out [kGroupPanels][mr][kPanel].
template <typename W>
inline void panel_group(int64_t mr, const float* x, int64_t K, const W* p, int64_t stride,
                        float* out) {
  panel_pass<false, W, kGroupPanels, kGroupRows>(mr, x, K, p, stride, out, false, nullptr, 0);
}
#endif

}  // namespace aotllm
