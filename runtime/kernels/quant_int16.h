// Integer dot products for quantized weights and 16-bit inputs (bf16, fp16) on AVX2 targets,
// decode steps of up to kInt16MaxRows rows (quant_linear.cpp's layout notes; larger batches
// take the dequantized panels of quant_panel.h).
//
// x is requantized to int16 per run of 32 (one scale a run, its absmax / 32767); each run of
// 32 weights is widened to int16 once (int8: sign extension; int4: the nibbles, two runs at
// a time in quant_int4_pairs.h) and `vpmaddwd`-ed against up to 8 input rows while it is in
// registers (more rows: passes of 8); one float FMA a run and a row scales the integer sum
// by the run's combined scale (weight group scale x input run scale, made first, 8 at a
// time for groups of 32, so that the run loop only broadcasts a float). The float path
// (quant_weight.h) converts every weight to float32 and spends a scalar fp16 scale and a
// horizontal step per group: for GGUF's groups of 32 it ran at a third of the memory's
// rate (int8 Q8_0 engine: 19.6 ms of linear_int8 a step).
//
// The error this adds, at most 2^-16 of a run's largest |x|, is 128x below the rounding the
// 16-bit input already carries (2^-9 for bf16), so float32 inputs, which would notice it,
// keep the float path. No int32 overflow: |w| <= 128 (int8) or 15 (int4) against |x| <=
// 32767, two products a lane, two lanes summed: 2^24 at most.
#pragma once

#include "parallel.h"
#include "quant_weight.h"

namespace aotllm {

#if defined(__AVX2__) && !defined(__AVX512F__)
// Input rows a pass over a weight row (their accumulators stay in registers). Measured
// (SmolLM2's 30 layers, 2 threads, interleaved): up to 8 rows one pass beats the
// dequantized panels (5 rows: 15-22 ms against 31-41, 8 rows: 22-38 against 44-60).
constexpr int64_t kInt16Rows = 8;
// Input rows a call at most, in passes of kInt16Rows over each weight row while it is in L1
// (the weights are read from memory once). Measured (engine decode steps, ms, interleaved):
// Q4_0 batch 16 110-117 with panels -> 71-91, batch 12 91-94 -> 63-79; Q8_0 batch 16
// 111-129 -> 102-114, batch 12 94-121 -> 78-91. At 24 rows the two were level, from 32
// the panels win (int4, 30 layers: 32 rows 86-118 ms against 111-143).
constexpr int64_t kInt16MaxRows = 16;

// Eight values of x as float32, from the 16-bit storage the inputs come in (no float32 copy
// of x per call: at one row that copy and its allocation cost as much as a small linear).
inline __m256 load8(const at::BFloat16* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The run of 32 values at p as four float32 vectors v; returns their largest |x|.
template <typename X>
inline float load_run(const X* p, __m256 v[4]) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx = _mm256_setzero_ps();
  for (int64_t j = 0; j < 4; ++j) {
    v[j] = load8(p + 8 * j);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// xq [M * K] int16, xs [M * K / 32] each run's scale; with `rsum`, each run's float sum
// (for the int4 zero points).
template <typename X>
inline void quantize_runs_int16(const X* x, int64_t M, int64_t K, int16_t* xq, float* xs,
                                float* rsum) {
  for (int64_t i = 0; i < M * K / kRun; ++i) {
    __m256 v[4];
    const float amax = load_run(x + i * kRun, v);
    xs[i] = amax / 32767.f;
    if (rsum) rsum[i] = aotllm::vsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
    for (int64_t j = 0; j < 4; j += 2) {
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], inv));
      // packs interleaves the two 128-bit halves; the permute puts values back in order
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * kRun + 8 * j),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
    }
  }
}

// Run r of weight row n as int16: v0 = values 0..15 of the run, v1 = values 16..31.
template <bool kInt4>
inline void run_int16(const QWeight& w, int64_t n, int64_t r, __m256i& v0, __m256i& v1) {
  if constexpr (kInt4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q + n * (w.K / 2) + r * 16));
    v0 = _mm256_cvtepu8_epi16(_mm_and_si128(b, _mm_set1_epi8(15)));
    v1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15)));
  } else {
    const uint8_t* p = w.q + n * w.K + r * kRun;
    v0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    v1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
}

// cs [MR, runs]: each run's combined scale, weight group scale x input run scale.
template <int64_t MR>
inline void combined_scales(const QWeight& w, int64_t n, const float* xs, float* cs) {
  const int64_t runs = w.K / kRun, per_group = w.group / kRun;  // groups hold whole runs
  const at::Half* sc = w.scales + n * w.groups;
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
}

// One int8 weight row n against MR input rows (xq, xs start at the block's first row); int4
// rows take quant_int4_pairs.h, two runs at a time.
template <int64_t MR>
inline void rows_int16(const QWeight& w, int64_t n, const int16_t* xq, const float* xs,
                       float* cs, float* out) {
  const int64_t K = w.K, runs = K / kRun;
  combined_scales<MR>(w, n, xs, cs);
  // With one or two input rows, a single accumulator a row would wait on the FMA's latency
  // every run (perf: most samples on it); U runs a pass keep U chains in flight.
  constexpr int64_t U = MR <= 2 ? 2 : 1;
  __m256 acc[U * MR];
  for (int64_t i = 0; i < U * MR; ++i) acc[i] = _mm256_setzero_ps();
  int64_t r = 0;
  for (; r < runs; r += U) {
    if (U > 1 && r + U > runs) break;
#pragma GCC unroll 2
    for (int64_t u = 0; u < U; ++u) {
      __m256i v0, v1;
      run_int16<false>(w, n, r + u, v0, v1);
      for (int64_t m = 0; m < MR; ++m) {
        const auto* xr = reinterpret_cast<const __m256i*>(xq + m * K + (r + u) * kRun);
        const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(v0, _mm256_loadu_si256(xr)),
                                           _mm256_madd_epi16(v1, _mm256_loadu_si256(xr + 1)));
        acc[u * MR + m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d),
                                          _mm256_broadcast_ss(cs + m * runs + r + u), acc[u * MR + m]);
      }
    }
  }
  for (; r < runs; ++r) {  // an odd run left when U = 2
    __m256i v0, v1;
    run_int16<false>(w, n, r, v0, v1);
    for (int64_t m = 0; m < MR; ++m) {
      const auto* xr = reinterpret_cast<const __m256i*>(xq + m * K + r * kRun);
      const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(v0, _mm256_loadu_si256(xr)),
                                         _mm256_madd_epi16(v1, _mm256_loadu_si256(xr + 1)));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_broadcast_ss(cs + m * runs + r), acc[m]);
    }
  }
  for (int64_t m = 0; m < MR; ++m) {
    __m256 a = acc[m];
    for (int64_t u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[u * MR + m]);
    out[m] = aotllm::vsum(a);
  }
}

inline void rows_int16_any(int64_t mr, const QWeight& w, int64_t n, const int16_t* xq,
                           const float* xs, float* cs, float* out) {
  switch (mr) {
    case 1: return rows_int16<1>(w, n, xq, xs, cs, out);
    case 2: return rows_int16<2>(w, n, xq, xs, cs, out);
    case 3: return rows_int16<3>(w, n, xq, xs, cs, out);
    case 4: return rows_int16<4>(w, n, xq, xs, cs, out);
    case 5: return rows_int16<5>(w, n, xq, xs, cs, out);
    case 6: return rows_int16<6>(w, n, xq, xs, cs, out);
    case 7: return rows_int16<7>(w, n, xq, xs, cs, out);
    default: return rows_int16<8>(w, n, xq, xs, cs, out);
  }
}

// x [M, K] bf16 or fp16, M <= kInt16MaxRows, K multiple of 32 (int16_fits), against int8
// weights -> y [M, N] in x's dtype, rounded once from the float32 sums.
template <typename X>
inline void gemm_int16(const QWeight& w, const X* x, const float* bias, X* y, int64_t M) {
  const int64_t K = w.K, runs = K / kRun;
  // Scratch kept between calls (a decode step makes hundreds of these calls).
  thread_local std::vector<int16_t> xq;
  thread_local std::vector<float> xs;
  xq.resize(M * K);
  xs.resize(M * runs);
  quantize_runs_int16(x, M, K, xq.data(), xs.data(), nullptr);
  // Pointers, not the thread_local vectors: inside the lambda those names would be the
  // worker thread's own (empty) vectors.
  const int16_t* xqp = xq.data();
  const float* xsp = xs.data();
  aotllm::parallel_chunks(0, w.N, 16, [&](int64_t begin, int64_t end) {
    float out[kInt16MaxRows];
    thread_local std::vector<float> cs;
    cs.resize(kInt16Rows * runs);
    for (int64_t n = begin; n < end; ++n) {
      // kInt16Rows input rows a pass (accumulators in registers); the weight row is in L1
      // for the next pass.
      for (int64_t m0 = 0; m0 < M; m0 += kInt16Rows)
        rows_int16_any(std::min(kInt16Rows, M - m0), w, n, xqp + m0 * K, xsp + m0 * runs,
                       cs.data(), out + m0);
      for (int64_t m = 0; m < M; ++m) y[m * w.N + n] = static_cast<X>(out[m] + (bias ? bias[n] : 0.f));
    }
  });
}

inline bool int16_fits(const QWeight& w, int64_t M) {
  return M <= kInt16MaxRows && w.K % kRun == 0 && w.group % kRun == 0;
}
#endif

}  // namespace aotllm
