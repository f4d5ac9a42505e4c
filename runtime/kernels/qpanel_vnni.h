// Pair panels (qpanel_linear.cpp's layout) on AVX-512 targets: one pair of k for all 16
// columns of a panel is one 512-bit vector of int16 weights, so a broadcast pair of x's
// int16 values and one `vpdpwssd` (AVX512-VNNI; `vpmaddwd` + `vpaddd` without it) take 32
// products, and a run's integer sums are scaled once for 16 columns. This is the arithmetic
// of the AVX2 kernel at twice the width and one instruction where it takes two.
//
// Why: on AVX512-BF16 / AMX hosts the row layout (quant_linear.cpp) dequantizes every run
// of 32 weights to float32 and rounds it to bf16 before `vdpbf16ps`: compute bound on two
// cores, which left int8_wo and int4_wo engines slower than bf16 ones there (stop 27: served
// c=1 0.51x and 0.65x of bf16).
//
// int8: a pair is 32 bytes, sign-extended to one vector (`vpmovsxbw`), against x's int16
// values. int4 (16 bytes a pair: byte i = value i | value i + 16 << 4, value e = 2j + k % 2)
// takes x in int8 instead and `vpdpbusd`, 4 products a lane: see QuadX below.
//
// No int32 overflow: a lane sums at most 32 products of |w| <= 128 and |x| <= 32767 a run
// (2^27).
#pragma once

#include "parallel.h"
#include "prefetch.h"
#include "store_panel.h"
#include "quant_weight.h"

#include <algorithm>
#include <vector>

namespace aotllm {

constexpr int64_t kPanelCols = 16;  // contract/layout.py PANEL_COLUMNS

#if defined(__AVX2__)
// A call's x requantized to int8 per run of 32 (the int4 passes of AVX-512 and AVX2): the
// values, each run's scale, sum of the int8 values and, for weights with mins, float sum.
struct Int8Runs {
  std::vector<int8_t> xq;
  std::vector<float> xs, fsum;
  std::vector<int32_t> isum;
  void resize(const QWeight& w, int64_t M) {
    const int64_t runs = w.K / kRun;
    xq.resize(M * w.K);
    xs.resize(M * runs);
    isum.resize(M * runs);
    fsum.resize(w.mins ? M * runs : 0);
  }
  float* fsum_or_null() { return fsum.empty() ? nullptr : fsum.data(); }
};

#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t kVCols = kPanelCols;
// Input rows a pass: int8, 8 int32 + 8 float accumulators; int4, 16 int32 + 8 float.
constexpr int64_t kVRows8 = 8;

// acc + the pairwise products of a and b's int16 values, summed by pairs.
inline __m512i dot_pairs(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

inline __m512 load16(const at::BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One call's inputs for int8 weights: x requantized to int16 per run of 32, as on the AVX2
// path.
struct VnniX {
  const int16_t* xq;    // [M, K]
  const float* xs;      // [M, runs]: each run's scale (its absmax / 32767)
  const int32_t* isum;  // [M, runs]: each run's sum of int16 x
  const float* fsum;    // nullptr (int8 weights have no mins)
};

template <typename X>
inline void quantize_runs_512(const X* x, int64_t n_runs, int16_t* xq, float* xs,
                              int32_t* isum, float* fsum) {
  for (int64_t i = 0; i < n_runs; ++i) {
    const __m512 a = load16(x + i * kRun), b = load16(x + i * kRun + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    xs[i] = amax / 32767.f;
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * kRun), _mm512_cvtsepi32_epi16(qa));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * kRun + 16), _mm512_cvtsepi32_epi16(qb));
    isum[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    if (fsum) fsum[i] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
}

// The scale (and zero point) vectors of panel p's group g: 16 columns.
inline __m512 group_vec(const at::Half* v, int64_t p, int64_t groups, int64_t g) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(v + p * kVCols * groups + g * kVCols)));
}

// Run r's group, counted rather than divided: a 64-bit division a run was a third of a
// one-row pass's time (in L1, int8: 45 -> 24 us for a 3072 x 576 weight).
struct GroupCounter {
  int64_t per_group, g = 0, left;
  explicit GroupCounter(const QWeight& w) : per_group(w.group / kRun), left(w.group / kRun) {}
  void next() {
    if (--left == 0) ++g, left = per_group;
  }
};

// The weights kPrefetch bytes ahead of a run (`bytes` long) into L1. Each thread streams its
// panels once, and the hardware prefetcher alone left a one-row pass waiting on memory:
// SmolLM2's 30 layers, 1 row, ms: int4 3.6-4.5 -> 2.0-2.8, int8 6.4 -> 4.3-5.9 (1, 2 and 4
// KiB ahead tried; 4 the best). Past a weight's end it is a hint, never a fault.
constexpr int64_t kPrefetch = 4096;
inline void prefetch_ahead(const void* run, int64_t bytes) {
  prefetch_lines(static_cast<const char*>(run) + kPrefetch, bytes);
}

// f[m] += the run's int32 sums c of row m, scaled (and the zero points' term); g its group.
template <int64_t MR, typename XR>
inline void scale_run(const QWeight& w, int64_t p, int64_t r, int64_t g, const XR& x,
                      int64_t runs, const __m512i* c, __m512* f) {
  const __m512 s = group_vec(w.scales, p, w.groups, g);
  for (int64_t m = 0; m < MR; ++m)
    f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c[m]),
                           _mm512_mul_ps(s, _mm512_set1_ps(x.xs[m * runs + r])), f[m]);
  if (w.mins) {  // + min x (the run's sum of x), in float as the reference
    const __m512 mn = group_vec(w.mins, p, w.groups, g);
    for (int64_t m = 0; m < MR; ++m)
      f[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.fsum[m * runs + r]), f[m]);
  }
}

// out [NP][MR][16] float32: MR rows of x (from row 0 of x's arrays) against the int8 pairs of
// NP panels from p (wp, the first, and those after it, kVCols * K bytes apart). Two panels a
// pass feed two `vpdpwssd` from each broadcast of x: with one, a batch's passes ran at half
// the instruction rate of `vpdpwssd` (Zen 5, 143 rows, 30 layers: 56-64 ms, where its peak,
// two instructions a cycle, would take 28; two panels: 51 ms). Integer sums are exact and
// each (row, panel)'s float sum takes the same runs in the same order, so the bits do not
// depend on NP or MR.
template <int64_t MR, int64_t NP = 1>
inline void pass_int8(const QWeight& w, int64_t p, const int8_t* wp, const VnniX& x, float* out) {
  const int64_t K = w.K, runs = K / kRun;
  // One or two rows of one panel: a single chain of `vpdpwssd` a row would wait on its
  // latency.
  constexpr int64_t U = NP > 1 ? 1 : MR == 1 ? 4 : MR == 2 ? 2 : 1;
  __m512 f[NP * MR];
  for (int64_t i = 0; i < NP * MR; ++i) f[i] = _mm512_setzero_ps();
  GroupCounter gc(w);
  for (int64_t r = 0; r < runs; ++r, gc.next()) {
    __m512i acc[U * NP * MR];
    for (int64_t i = 0; i < U * NP * MR; ++i) acc[i] = _mm512_setzero_si512();
    const int8_t* wr = wp + r * kRun * kVCols;
    for (int64_t j = 0; j < NP; ++j) prefetch_ahead(wr + j * kVCols * K, kRun * kVCols);
    const int16_t* xr = x.xq + r * kRun;
    for (int64_t t = 0; t < kRun / 2; t += U) {
#pragma GCC unroll 4
      for (int64_t u = 0; u < U; ++u) {
        __m512i wv[NP];
        for (int64_t j = 0; j < NP; ++j)
          wv[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(wr + j * kVCols * K + (t + u) * 32)));
        for (int64_t m = 0; m < MR; ++m) {
          const __m512i xb = _mm512_set1_epi32(
              *reinterpret_cast<const int32_t*>(xr + m * K + 2 * (t + u)));
          for (int64_t j = 0; j < NP; ++j)
            acc[(u * NP + j) * MR + m] = dot_pairs(acc[(u * NP + j) * MR + m], wv[j], xb);
        }
      }
    }
    for (int64_t u = 1; u < U; ++u)
      for (int64_t m = 0; m < MR; ++m) acc[m] = _mm512_add_epi32(acc[m], acc[u * MR + m]);
    for (int64_t j = 0; j < NP; ++j)
      scale_run<MR>(w, p + j, r, gc.g, x, runs, acc + j * MR, f + j * MR);
  }
  for (int64_t i = 0; i < NP * MR; ++i) _mm512_storeu_ps(out + i * kVCols, f[i]);
}

// int4 weights take x requantized to int8 per run of 32 (llama.cpp's Q8_0 activations of
// its Q4_0 dot product): `vpdpbusd` multiplies 64 pairs of unsigned nibbles (0..15) and
// signed int8 x an instruction into 16 int32 lanes, twice the products of `vpdpwssd` on
// int16, and the nibbles need no widening past bytes. SmolLM2's 30 layers, 2 threads, Zen 5,
// interleaved, ms: 1 row 1.74-1.94 -> 1.48, 4 rows 3.3-4.0 -> 2.7, 16 rows 8.5-8.6 -> 5.8-5.9,
// 32 rows 14.7-14.8 -> 9.0. What it costs: transformers float32 on a Q4_0 checkpoint's
// weights with every decoder linear's input so rounded, against float32, on the fidelity
// text: KL 0.0025 (bfloat16's own 0.0014); another 4-bit quantization of the same model is
// KL 0.28 away. The int4 weights, not x, are an int4 engine's error. int8 weights keep
// int16 x: their own rounding is as fine as int8 x's. Measured (Zen 5, SmolLM2 built from
// its Q8_0 GGUF, the build's fidelity text against transformers float32): KL 0.00034 with
// int16 x, 0.0033 with int8 x (transformers bfloat16: 0.0011), for 143 rows in 35 ms
// instead of 51 (30 layers): an int8_wo engine would be three times further from float32
// than a bf16 one, so weight-only keeps its word.
//
// No int32 overflow: a lane sums at most 32 products of 15 x 127 a run; without VNNI,
// `vpmaddubsw`'s int16 pair sums stay below 2 x 15 x 127.
struct QuadX {
  const int8_t* xq;     // [M, K]: x / xs rounded, in [-127, 127]
  const float* xs;      // [M, runs]: each run's scale (its absmax / 127)
  const int32_t* isum;  // [M, runs]: each run's sum of int8 x (symmetric int4's zero point)
  const float* fsum;    // [M, runs]: each run's float sum of x (stored mins); or nullptr
};

template <typename X>
inline void quantize_runs_i8(const X* x, int64_t n_runs, int8_t* xq, float* xs, int32_t* isum,
                             float* fsum) {
  for (int64_t i = 0; i < n_runs; ++i) {
    const __m512 a = load16(x + i * kRun), b = load16(x + i * kRun + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    xs[i] = amax / 127.f;
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i * kRun), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i * kRun + 16), _mm512_cvtsepi32_epi8(qb));
    isum[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    if (fsum) fsum[i] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
}

// acc + the sums of four products of a's unsigned and b's signed bytes, a lane.
inline __m512i dot_quads(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, b),
                                                 _mm512_set1_epi16(1)));
#endif
}

// The stored nibbles, 64 bytes (pairs t .. t + 3, two quads of k) at a time, as two vectors
// of quads: lane 2c holds column c's 4 values of pairs t, t + 1 (quad A), lane 2c + 1 those
// of pairs t + 2, t + 3 (quad B); lo columns 0-7 (low nibbles), hi 8-15 (high nibbles).
// A pair's 128-bit block holds a column's 2 values in word c, so one `vpermw` a vector
// gathers them (word 4c + j <- block j's word c), and x's 8 int8 values of the two quads,
// broadcast as a pair of lanes (`vbroadcasti32x2`), multiply both quads at once; a column's
// two lanes are added once a run (sum_lane_pairs). An unpacked copy of each panel for batches
// (a 128-bit unpack of the nibbles to plain quads) cost as much time as the passes over it
// (perf, batch 16: 7.8 % against 7.1 %).
inline __m512i quad_word_order() {
  alignas(64) int16_t idx[32];
  for (int c = 0; c < 8; ++c)
    for (int j = 0; j < 4; ++j) idx[4 * c + j] = static_cast<int16_t>(8 * j + c);
  return _mm512_load_si512(idx);
}

// Columns 0-15 of a run's int32 sums: lanes 2c and 2c + 1 of lo (columns 0-7), of hi (8-15).
inline __m512i sum_lane_pairs(__m512i lo, __m512i hi) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return _mm512_add_epi32(_mm512_permutex2var_epi32(lo, even, hi),
                          _mm512_permutex2var_epi32(lo, odd, hi));
}

// out [MR, 16] float32: MR rows of x against panel p's int4 pairs as stored (16 bytes a pair).
template <int64_t MR, bool kSym>
inline void pass_int4(const QWeight& w, int64_t p, const uint8_t* wp, const QuadX& x, float* out) {
  const int64_t K = w.K, runs = K / kRun;
  // One or two rows: two chains of `vpdpbusd` a vector, or a row waits on their latency.
  constexpr int64_t U = MR <= 2 ? 2 : 1;
  const __m512i m4 = _mm512_set1_epi8(15), order = quad_word_order();
  __m512 f[MR];
  for (int64_t m = 0; m < MR; ++m) f[m] = _mm512_setzero_ps();
  GroupCounter gc(w);
  for (int64_t r = 0; r < runs; ++r, gc.next()) {
    __m512i lo[U * MR], hi[U * MR];
    for (int64_t i = 0; i < U * MR; ++i) lo[i] = hi[i] = _mm512_setzero_si512();
    const uint8_t* wr = wp + r * kRun * kVCols / 2;
    prefetch_ahead(wr, kRun * kVCols / 2);
    const int8_t* xr = x.xq + r * kRun;
    for (int64_t t = 0; t < 4; t += U) {
#pragma GCC unroll 2
      for (int64_t u = 0; u < U; ++u) {
        const __m512i z = _mm512_loadu_si512(wr + (t + u) * 64);
        const __m512i wl = _mm512_permutexvar_epi16(order, _mm512_and_si512(z, m4));
        const __m512i wh = _mm512_permutexvar_epi16(order, _mm512_and_si512(_mm512_srli_epi16(z, 4), m4));
        for (int64_t m = 0; m < MR; ++m) {
          const __m512i xv = _mm512_broadcast_i32x2(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(xr + m * K + 8 * (t + u))));
          lo[u * MR + m] = dot_quads(lo[u * MR + m], wl, xv);
          hi[u * MR + m] = dot_quads(hi[u * MR + m], wh, xv);
        }
      }
    }
    __m512i c[MR];
    for (int64_t m = 0; m < MR; ++m) {
      __m512i a = lo[m], b = hi[m];
      for (int64_t u = 1; u < U; ++u) a = _mm512_add_epi32(a, lo[u * MR + m]), b = _mm512_add_epi32(b, hi[u * MR + m]);
      c[m] = sum_lane_pairs(a, b);
      if constexpr (kSym) c[m] = _mm512_sub_epi32(c[m], _mm512_set1_epi32(8 * x.isum[m * runs + r]));
    }
    scale_run<MR>(w, p, r, gc.g, x, runs, c, f);
  }
  for (int64_t m = 0; m < MR; ++m) _mm512_storeu_ps(out + m * kVCols, f[m]);
}

// Input rows a pass of two int8 panels: 12 int32 + 12 float accumulators.
constexpr int64_t kVRows8x2 = 6;

// pass_int8<mr, NP> for 1 <= mr <= MR (counted down): kVRows8 rows over one panel,
// kVRows8x2 over two.
template <int64_t NP = 1, int64_t MR = NP == 1 ? kVRows8 : kVRows8x2>
inline void pass_int8_any(int64_t mr, const QWeight& w, int64_t p, const int8_t* wp,
                          const VnniX& x, float* out) {
  if constexpr (MR > 1) {
    if (mr < MR) return pass_int8_any<NP, MR - 1>(mr, w, p, wp, x, out);
  }
  pass_int8<MR, NP>(w, p, wp, x, out);
}

template <bool kSym>
inline void pass_int4_any(int64_t mr, const QWeight& w, int64_t p, const uint8_t* wp,
                          const QuadX& x, float* out) {
  switch (mr) {
    case 1: return pass_int4<1, kSym>(w, p, wp, x, out);
    case 2: return pass_int4<2, kSym>(w, p, wp, x, out);
    case 3: return pass_int4<3, kSym>(w, p, wp, x, out);
    case 4: return pass_int4<4, kSym>(w, p, wp, x, out);
    case 5: return pass_int4<5, kSym>(w, p, wp, x, out);
    case 6: return pass_int4<6, kSym>(w, p, wp, x, out);
    case 7: return pass_int4<7, kSym>(w, p, wp, x, out);
    default: return pass_int4<8, kSym>(w, p, wp, x, out);
  }
}

// int8 weights: x [M, K] bf16 or fp16 -> y [M, N] in x's dtype, rounded once from the float32
// sums.
template <typename X, typename Y>
void gemm_int8_512(const QWeight& w, const X* x, const float* bias, Y* y, int64_t M) {
  const int64_t K = w.K, runs = K / kRun;
  thread_local std::vector<int16_t> xq;  // scratch kept between calls
  thread_local std::vector<float> xs;
  thread_local std::vector<int32_t> isum;
  xq.resize(M * K);
  xs.resize(M * runs);
  isum.resize(M * runs);
  quantize_runs_512(x, M * runs, xq.data(), xs.data(), isum.data(), nullptr);
  // Pointers, not the thread_local vectors: inside the lambda those names are the worker
  // thread's own (empty) vectors.
  const VnniX vx{xq.data(), xs.data(), isum.data(), nullptr};
  // Panels two at a time (a grain of 2), an odd last one alone.
  aotllm::parallel_chunks(0, w.N / kVCols, 2, [&](int64_t begin, int64_t end) {
    alignas(64) float out[2 * kVRows8 * kVCols];
    for (int64_t p = begin; p < end; p += 2) {
      const int64_t np = std::min<int64_t>(2, end - p);
      const int64_t rows = np == 2 ? kVRows8x2 : kVRows8;
      const int8_t* wp = reinterpret_cast<const int8_t*>(w.q + p * kVCols * K);
      for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int64_t mr = std::min(rows, M - m0);
        const VnniX xm{vx.xq + m0 * K, vx.xs + m0 * runs, vx.isum + m0 * runs, nullptr};
        if (np == 2) pass_int8_any<2>(mr, w, p, wp, xm, out);
        else pass_int8_any<1>(mr, w, p, wp, xm, out);
        for (int64_t j = 0; j < np; ++j)
          store_panel(out + j * mr * kVCols, mr, bias ? bias + (p + j) * kPanelCols : nullptr,
                      y + m0 * w.N + (p + j) * kPanelCols, w.N);
      }
    }
  });
}

// int4 weights, likewise, kVRows8 rows a pass over the nibbles as stored.
template <typename X, typename Y>
void gemm_int4_512(const QWeight& w, const X* x, const float* bias, Y* y, int64_t M) {
  const int64_t K = w.K, runs = K / kRun;
  thread_local Int8Runs xr;  // scratch kept between calls
  xr.resize(w, M);
  quantize_runs_i8(x, M * runs, xr.xq.data(), xr.xs.data(), xr.isum.data(), xr.fsum_or_null());
  const QuadX vx{xr.xq.data(), xr.xs.data(), xr.isum.data(), xr.fsum_or_null()};
  aotllm::parallel_chunks(0, w.N / kVCols, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float out[kVRows8 * kVCols];
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* wp = w.q + p * kVCols * K / 2;
      for (int64_t m0 = 0; m0 < M; m0 += kVRows8) {
        const int64_t mr = std::min(kVRows8, M - m0);
        const QuadX xm{vx.xq + m0 * K, vx.xs + m0 * runs, vx.isum + m0 * runs,
                       vx.fsum ? vx.fsum + m0 * runs : nullptr};
        if (w.mins) pass_int4_any<false>(mr, w, p, wp, xm, out);
        else pass_int4_any<true>(mr, w, p, wp, xm, out);
        store_panel(out, mr, bias ? bias + p * kPanelCols : nullptr,
                    y + m0 * w.N + p * kPanelCols, w.N);
      }
    }
  });
}

template <typename X, typename Y>
void gemm_qpanels_512(const QWeight& w, const X* x, const float* bias, Y* y, int64_t M) {
  if (w.int4) gemm_int4_512(w, x, bias, y, M);
  else gemm_int8_512(w, x, bias, y, M);
}
#endif

}  // namespace aotllm
