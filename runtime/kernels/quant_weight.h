// The quantized weight layout of contract/quant.py as the kernels read it (QWeight), its
// row dequantizers, and the AVX2 decode-row kernel (quant_linear.cpp's layout notes apply).
#pragma once

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
// Decode rows on AVX2 (M <= kFewRows): W is read once and dequantized in registers, with
// each group's scale (and zero point) factored out of its dot product, as llama.cpp does:
// x . W_g = s_g (x . q_g) + min_g sum(x_g). The band-tiled kernel, which writes every
// weight to a float32 buffer first, measured 2-4x slower than this at one row.
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
  at::parallel_for(0, w.N, 16, [&](int64_t begin, int64_t end) {
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

// int4 weights, 16-bit inputs (bf16, fp16), decode rows: x is requantized to int16 per run
// of 32 (one scale a run, its absmax / 32767) and every run's dot product is integer
// (vpmaddwd of the nibbles widened to int16 against x), scaled once a run in float32. The
// float path above converts every nibble to float32 (~21 instructions per 32 weights) and
// was compute bound: SmolLM2 Q4_1 engine, linear_int4 per decode step 12.9-15.0 -> 8.2-8.5
// ms (torch.profiler, same hour). int8 weights keep the float path: they were already read at
// the memory's rate there, and this one measured no faster. The error this adds, at most
// 2^-16 of a run's largest |x|, is 128x below the rounding the 16-bit input already carries
// (2^-9 for bf16), so float32 inputs, which would notice it, keep the float path too.
inline void quantize_runs_int16(const float* x, int64_t M, int64_t K, int16_t* xq, float* xs) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t i = 0; i < M * K / kRun; ++i) {
    const float* p = x + i * kRun;
    __m256 mx = _mm256_setzero_ps();
    for (int64_t j = 0; j < kRun; j += 8)
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(p + j)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    xs[i] = amax / 32767.f;
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
    for (int64_t j = 0; j < kRun; j += 16) {
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + j), inv));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + j + 8), inv));
      // packs interleaves the two 128-bit halves; the permute puts values back in order
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * kRun + j),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
    }
  }
}

// One int4 weight row n against MR int16 input rows; each run's 32 weights are widened to
// int16 once and reused by every input row. `cs` [MR, runs] is scratch for the runs'
// combined scales (weight group scale x input run scale), made first so that the loop over
// the runs only broadcasts one float a run: with groups of 32 (GGUF Q4) the per-run scalar
// work (half -> float, multiply) otherwise cost as much as the dot products.
template <int64_t MR>
inline void row16_avx2(const QWeight& w, int64_t n, const int16_t* xq, const float* xs,
                       const float* xsum, float* cs, float* out) {
  const int64_t K = w.K, runs = K / kRun, groups = w.groups;
  const at::Half* sc = w.scales + n * groups;
  const int64_t per_group = w.group / kRun;  // int4 groups hold whole runs
  for (int64_t m = 0; m < MR; ++m) {
    float* c = cs + m * runs;
    const float* x_s = xs + m * runs;
    int64_t r = 0;
    if (per_group == 1) {  // a scale a run: eight at a time
      for (; r + 8 <= runs; r += 8)
        _mm256_storeu_ps(c + r, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(
                                                  reinterpret_cast<const __m128i*>(sc + r))),
                                              _mm256_loadu_ps(x_s + r)));
    }
    for (int64_t g = r / per_group; r < runs; ++g) {  // the rest, a group at a time
      const float sg = half_to_float(sc[g]);
      for (const int64_t r_end = std::min(runs, r + per_group); r < r_end; ++r) c[r] = sg * x_s[r];
    }
  }
  __m256 acc[MR];
  for (int64_t m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t r = 0; r < runs; ++r) {
    // the run's weights 0..15 (low nibbles) and 16..31 (high nibbles) as int16
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q + n * (K / 2) + r * 16));
    const __m256i v0 = _mm256_cvtepu8_epi16(_mm_and_si128(b, _mm_set1_epi8(15)));
    const __m256i v1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15)));
    for (int64_t m = 0; m < MR; ++m) {
      const auto* xr = reinterpret_cast<const __m256i*>(xq + m * K + r * kRun);
      // 15 x 32767, two to a lane: no int32 overflow
      const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(v0, _mm256_loadu_si256(xr)),
                                         _mm256_madd_epi16(v1, _mm256_loadu_si256(xr + 1)));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_broadcast_ss(cs + m * runs + r),
                               acc[m]);
    }
  }
  for (int64_t m = 0; m < MR; ++m) {
    // The zero points: sum_g min_g * sum(x_g), min_g the stored min or -8 s_g (symmetric).
    const at::Half* mn = w.mins ? w.mins + n * groups : sc;
    const float* xg = xsum + m * groups;
    __m256 e = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
      e = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + g))),
                          _mm256_loadu_ps(xg + g), e);
    float extra = aotllm::vsum(e);
    for (; g < groups; ++g) extra += half_to_float(mn[g]) * xg[g];
    out[m] = aotllm::vsum(acc[m]) + (w.mins ? extra : -8.f * extra);
  }
}

template <int64_t MR>
inline void gemv16_avx2_rows(const QWeight& w, const int16_t* xq, const float* xs,
                             const float* xsum, const float* bias, float* y) {
  at::parallel_for(0, w.N, 16, [&](int64_t begin, int64_t end) {
    float out[MR];
    std::vector<float> cs(MR * (w.K / kRun));
    for (int64_t n = begin; n < end; ++n) {
      row16_avx2<MR>(w, n, xq, xs, xsum, cs.data(), out);
      for (int64_t m = 0; m < MR; ++m) y[m * w.N + n] = out[m] + (bias ? bias[n] : 0.f);
    }
  });
}

// x [M, K] float32 (the 16-bit input widened), M <= kFewRows; int4 weights.
inline void gemv16_avx2(const QWeight& w, const float* x, const float* bias, float* y,
                        int64_t M) {
  const int64_t K = w.K, G = w.group, groups = w.groups;
  std::vector<int16_t> xq(M * K);
  std::vector<float> xs(M * K / kRun), xsum(M * groups);
  quantize_runs_int16(x, M, K, xq.data(), xs.data());
  group_sums(x, M, K, G, groups, xsum.data());
  switch (M) {
    case 1: gemv16_avx2_rows<1>(w, xq.data(), xs.data(), xsum.data(), bias, y); break;
    case 2: gemv16_avx2_rows<2>(w, xq.data(), xs.data(), xsum.data(), bias, y); break;
    case 3: gemv16_avx2_rows<3>(w, xq.data(), xs.data(), xsum.data(), bias, y); break;
    default: gemv16_avx2_rows<4>(w, xq.data(), xs.data(), xsum.data(), bias, y); break;
  }
}
#endif


}  // namespace aotllm
