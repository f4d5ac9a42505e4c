// The quantized weight layout of contract/quant.py as the kernels read it (QWeight), its
// row dequantizers, and the AVX2 float32 decode-row kernel (quant_linear.cpp's layout notes
// apply; 16-bit inputs take quant_int16.h's integer rows instead).
#pragma once

#include "parallel.h"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

#include "tile_gemm.h"

namespace aotllm {

constexpr int64_t kRun = 32;      // values per packed run

inline float half_to_float(at::Half h) { return static_cast<float>(h); }

struct QWeight {
  const uint8_t* q;        // int8 (as bytes) or packed int4
  const at::Half* scales;  // [N, groups]
  const at::Half* mins;    // [N, groups] or nullptr (int4 symmetric / int8)
  int64_t N, K, groups, group;
  bool int4;

  // float32 value of W[n, k] (portable path)
  float at(int64_t n, int64_t k) const {
    const int64_t g = k / group;
    const float s = half_to_float(scales[n * groups + g]);
    if (!int4) return s * static_cast<float>(reinterpret_cast<const int8_t*>(q)[n * K + k]);
    const uint8_t byte = q[n * (K / 2) + (k / kRun) * 16 + (k % 16)];
    const float v = static_cast<float>((k % kRun) < 16 ? (byte & 15) : (byte >> 4));
    const float m = mins ? half_to_float(mins[n * groups + g]) : -8.f * s;
    return v * s + m;
  }
};

// Row n of W as float32, rounded through bf16 when the inputs are bf16 (as the reference).
inline void dequant_row(const QWeight& w, int64_t n, bool to_bf16, float* out) {
  for (int64_t k = 0; k < w.K; ++k) {
    float v = w.at(n, k);
    if (to_bf16) v = static_cast<float>(static_cast<at::BFloat16>(v));
    out[k] = v;
  }
}

// Row n of W as float32 in a form the compiler vectorizes (a group at a time), rounded
// through bf16 when the inputs are bf16: the tiled kernel's band loader.
inline void dequant_row_vec(const QWeight& w, int64_t n, bool to_bf16, float* out) {
  for (int64_t g = 0; g < w.groups; ++g) {
    const int64_t k0 = g * w.group, k1 = std::min(w.K, k0 + w.group);
    const float s = half_to_float(w.scales[n * w.groups + g]);
    if (!w.int4) {
      const auto* q = reinterpret_cast<const int8_t*>(w.q) + n * w.K;
#pragma omp simd
      for (int64_t k = k0; k < k1; ++k) out[k] = s * static_cast<float>(q[k]);
      continue;
    }
    const float m = w.mins ? half_to_float(w.mins[n * w.groups + g]) : -8.f * s;
    for (int64_t r = k0; r < k1; r += kRun) {  // groups hold whole runs (K % 32 == 0)
      const uint8_t* q = w.q + n * (w.K / 2) + r / 2;
#pragma omp simd
      for (int64_t j = 0; j < 16; ++j) {
        out[r + j] = static_cast<float>(q[j] & 15) * s + m;
        out[r + 16 + j] = static_cast<float>(q[j] >> 4) * s + m;
      }
    }
  }
  if (to_bf16) aotllm::round_through_bf16(out, w.K);
}

// Per-group sums of each row of x [M, K] into out [M, groups] (the int4 zero points' terms).
inline void group_sums(const float* x, int64_t M, int64_t K, int64_t G, int64_t groups,
                       float* out) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float t = 0.f;
      const float* p = x + m * K;
#pragma omp simd reduction(+ : t)
      for (int64_t k = g * G; k < std::min(K, (g + 1) * G); ++k) t += p[k];
      out[m * groups + g] = t;
    }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// Decode rows of float32 inputs on AVX2 (M <= kFewRows; 16-bit inputs take the integer rows
// of quant_int16.h, batches the panels of quant_panel.h): W is read once and dequantized in
// registers, with each group's scale (and zero point) factored out of its dot product, as
// llama.cpp does: x . W_g = s_g (x . q_g) + min_g sum(x_g). The band-tiled kernel, which
// writes every weight to a float32 buffer first, measured 2-4x slower than this at one row.
constexpr int64_t kFewRows = 4;

// One weight row n against MR input rows (MR a constant, so the accumulators stay in
// registers); two accumulators per row for int8 to hide the FMA latency.
template <int64_t MR>
inline void row_avx2(const QWeight& w, int64_t n, const float* x, const float* xsum,
                     float* out) {
  const int64_t K = w.K, G = w.group, groups = w.groups;
  __m256 total[MR];
  float extra[MR];
  for (int64_t m = 0; m < MR; ++m) total[m] = _mm256_setzero_ps(), extra[m] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * G, k1 = std::min(K, k0 + G);
    const float s = half_to_float(w.scales[n * groups + g]);
    __m256 a0[MR], a1[MR];
    for (int64_t m = 0; m < MR; ++m) a0[m] = _mm256_setzero_ps(), a1[m] = _mm256_setzero_ps();
    int64_t k = k0;
    if (!w.int4) {
      const auto* q = reinterpret_cast<const int8_t*>(w.q) + n * K;
      for (; k + 16 <= k1; k += 16) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k));
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
        for (int64_t m = 0; m < MR; ++m) {
          a0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), w0, a0[m]);
          a1[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8), w1, a1[m]);
        }
      }
      for (int64_t m = 0; m < MR; ++m) {  // the tail of a group (K or G % 16 != 0)
        float t = 0.f;
        for (int64_t kk = k; kk < k1; ++kk) t += x[m * K + kk] * static_cast<float>(q[kk]);
        extra[m] += s * t;
      }
    } else {
      const uint8_t* q = w.q + n * (K / 2);
      for (; k < k1; k += kRun) {  // groups hold whole runs (K % 32 == 0)
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k / 2));
        const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        for (int64_t m = 0; m < MR; ++m) {
          const float* xr = x + m * K + k;
          a0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, a0[m]);
          a1[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, a1[m]);
          a0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w2, a0[m]);
          a1[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w3, a1[m]);
        }
      }
      const float mn = w.mins ? half_to_float(w.mins[n * groups + g]) : -8.f * s;
      for (int64_t m = 0; m < MR; ++m) extra[m] += mn * xsum[m * groups + g];
    }
    const __m256 vs = _mm256_set1_ps(s);
    for (int64_t m = 0; m < MR; ++m)
      total[m] = _mm256_fmadd_ps(_mm256_add_ps(a0[m], a1[m]), vs, total[m]);
  }
  for (int64_t m = 0; m < MR; ++m) out[m] = aotllm::vsum(total[m]) + extra[m];
}

template <int64_t MR>
inline void gemv_avx2_rows(const QWeight& w, const float* x, const float* xsum,
                           const float* bias, float* y) {
  aotllm::parallel_chunks(0, w.N, 16, [&](int64_t begin, int64_t end) {
    float out[MR];
    for (int64_t n = begin; n < end; ++n) {
      row_avx2<MR>(w, n, x, xsum, out);
      for (int64_t m = 0; m < MR; ++m) y[m * w.N + n] = out[m] + (bias ? bias[n] : 0.f);
    }
  });
}

inline void gemv_avx2(const QWeight& w, const float* x, const float* bias, float* y,
                      int64_t M) {
  const int64_t K = w.K, G = w.group, groups = w.groups;
  std::vector<float> xsum(M * groups, 0.f);  // per-group sums of x, for the zero points
  if (w.int4) group_sums(x, M, K, G, groups, xsum.data());
  switch (M) {
    case 1: gemv_avx2_rows<1>(w, x, xsum.data(), bias, y); break;
    case 2: gemv_avx2_rows<2>(w, x, xsum.data(), bias, y); break;
    case 3: gemv_avx2_rows<3>(w, x, xsum.data(), bias, y); break;
    default: gemv_avx2_rows<4>(w, x, xsum.data(), bias, y); break;
  }
}

#endif


}  // namespace aotllm
