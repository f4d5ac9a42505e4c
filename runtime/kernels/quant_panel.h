// Quantized weights, batches (M > kInt16MaxRows input rows) on AVX2 targets: each panel of 16
// output rows of W is dequantized once per call into a float32 panel, K-major (8 x 8
// transposes in registers), and multiplied into every input row by the outer-product
// micro-kernel that linear_panel runs on panels stored at build time (panel_kernel.h).
//
// Why: the band-tiled dot products (tile_gemm.h) pay a horizontal sum per output and ran a
// Q8_0 engine's batch-16 decode step at 142-161 ms against the bf16 engine's 65-75; here the
// dequantization (about one instruction a weight, plus a division per 8 weights until the
// group was counted instead: 52-62 -> 31-41 ms for 5 rows) is shared by all M rows, and the
// multiply runs at the bf16 panels' speed (16 rows, 30 layers: 70-87 ms, bf16 panels 72 ms
// in the same noisy hour; the integer rows, in passes of 8, are better up to 16 rows).
//
// Weights are used at their exact float32 values (q * scale (+ min)), as the integer path
// does, not rounded through bf16 first as the eager reference does: within the tolerance
// the tests hold every path to, and never further from the checkpoint's numbers.
#pragma once

#include "parallel.h"
#include "panel_kernel.h"
#include "quant_weight.h"
#include "store_panel.h"

namespace aotllm {

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
inline bool panel_fits(const QWeight& w) { return w.K % kRun == 0 && w.group % kRun == 0; }

// r[0..7] (rows) <- their transpose (columns).
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20), r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20), r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20), r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20), r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// W[n, k0 .. k0 + 7] as float32 (k0 % 8 == 0: the 8 values sit in one run and one group),
// s and mn: that group's scale and zero point for row n.
inline __m256 dequant8(const QWeight& w, int64_t n, int64_t k0, float s, float mn) {
  if (!w.int4) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.q + n * w.K + k0));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_set1_ps(s));
  }
  // A run's byte j holds value j (low nibble) and value j + 16 (high nibble).
  const int64_t in_run = k0 % kRun;
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(
      w.q + n * (w.K / 2) + (k0 / kRun) * 16 + in_run % 16));
  const __m128i v = _mm_and_si128(in_run < 16 ? b : _mm_srli_epi16(b, 4), _mm_set1_epi8(15));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_set1_ps(s),
                         _mm256_set1_ps(mn));
}

// The rows' scales and zero points as float32, s and mn [groups, 16].
inline void panel_scales(const QWeight& w, int64_t n0, float* s, float* mn) {
  for (int64_t j = 0; j < kPanel; ++j)
    for (int64_t g = 0; g < w.groups; ++g) {
      const int64_t i = (n0 + j) * w.groups + g;
      s[g * kPanel + j] = half_to_float(w.scales[i]);
      mn[g * kPanel + j] = w.mins ? half_to_float(w.mins[i]) : -8.f * s[g * kPanel + j];
    }
}

// W[n0 .. n0 + 15, kb .. ke) into panel [ke - kb][16] float32, columns in order (kb % 32 == 0).
inline void dequant_panel(const QWeight& w, int64_t n0, int64_t kb, int64_t ke, const float* s,
                          const float* mn, float* panel) {
  // The group advances by counting, not dividing: a 64-bit division per 8 weights cost
  // more than the rest of the dequantization together.
  for (int64_t k0 = kb, g = kb / w.group, left = w.group - kb % w.group; k0 < ke; k0 += 8) {
    const float* sg = s + g * kPanel;
    const float* mg = mn + g * kPanel;
    if ((left -= 8) == 0) ++g, left = w.group;
    for (int64_t half = 0; half < 2; ++half) {
      __m256 r[8];
      for (int64_t i = 0; i < 8; ++i) {
        const int64_t j = half * 8 + i;
        r[i] = dequant8(w, n0 + j, k0, sg[j], mg[j]);
      }
      transpose8(r);
      for (int64_t i = 0; i < 8; ++i)
        _mm256_storeu_ps(panel + (k0 - kb + i) * kPanel + half * 8, r[i]);
    }
  }
}

// K is taken in chunks of kChunk so that a chunk's float32 panel (16 KiB) stays in L1 while
// every pass of input rows reads it: a whole panel of K = 576 (36 KiB) did not fit.
constexpr int64_t kChunk = 256;

// y [M, N] float32 = x [M, K] float32 W^T (+ bias); panel_fits(w).
inline void gemm_quant_panels(const QWeight& w, const float* x, int64_t M, const float* bias,
                              float* y) {
  const int64_t K = w.K, N = w.N, panels = N / kPanel;
  const int64_t passes = (M + kRows - 1) / kRows, rows = (M + passes - 1) / passes;
  std::vector<float> xp(M * K);
  pack_rows(x, M, K, rows, xp.data());
  aotllm::parallel_chunks(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> panel(kPanel * kChunk), s(kPanel * w.groups), mn(kPanel * w.groups);
    std::vector<float> acc(M * kPanel);  // [M, 16]: the panel's outputs
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel;
      panel_scales(w, n0, s.data(), mn.data());
      for (int64_t kb = 0; kb < K; kb += kChunk) {
        const int64_t ke = std::min(K, kb + kChunk);
        dequant_panel(w, n0, kb, ke, s.data(), mn.data(), panel.data());
        for (int64_t m = 0; m < M; m += rows) {
          const int64_t mr = std::min(rows, M - m);
          panel_block(mr, xp.data() + m * K + kb * mr, ke - kb, panel.data(),
                      acc.data() + m * kPanel, kb > 0);
        }
      }
      store_panel(acc.data(), M, bias ? bias + n0 : nullptr, y + n0, N);
    }
  });
  // The rows past the last full panel (N % 16), one at a time.
  std::vector<float> row(K);
  for (int64_t n = panels * kPanel; n < N; ++n) {
    dequant_row(w, n, false, row.data());
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * row[k];
      y[m * N + n] = acc + (bias ? bias[n] : 0.f);
    }
  }
}
#endif

}  // namespace aotllm
