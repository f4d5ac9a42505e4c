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
// int8: a pair is 32 bytes, sign-extended to one vector (`vpmovsxbw`). int4: a pair is 16
// bytes (byte i = value i | value i + 16 << 4, value e = 2j + k % 2): two pairs at a time are
// zero-extended to words, `and 15` gives columns 0-7 of both pairs and `>> 4` columns 8-15;
// x is laid out once per call so that lanes 0-7 multiply the first pair and lanes 8-15 the
// second (PairX4), and the two halves of each sum are added at the end of the run. The
// symmetric zero point (8) comes off the run's sum as 8 x the run's sum of int16 x.
// Calls with more rows than an int4 pass takes unpack each int4 panel to int8 pairs once.
//
// No int32 overflow: a lane sums at most 32 products of |w| <= 128 and |x| <= 32767 a run
// (2^27), the zero-point correction at most 8 x 32 x 32767 (2^23).
#pragma once

#include "parallel.h"
#include "quant_weight.h"

#include <algorithm>
#include <vector>

namespace aotllm {

// An int4 panel (K / 2 pairs of 16 bytes) as int8 pairs (32 bytes each, the int8 layout):
// low nibbles are values 0..15 of a pair, high nibbles 16..31; the symmetric zero point
// (8) subtracted here, so the int8 pass computes the very integer sums the int4 pass does.
// Done once per panel when a call has more rows than one int4 pass takes: the int4 pass
// widens the nibbles again for every pass of rows (a 128-token prompt: tens of times).
#if defined(__AVX2__)
template <bool kSym>
inline void unpack_int4_panel(const uint8_t* wp, int64_t K, int8_t* dst) {
  const __m128i m4 = _mm_set1_epi8(15), zp = _mm_set1_epi8(kSym ? 8 : 0);
  for (int64_t t = 0; t < K / 2; ++t) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + t * 16));
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(b, m4), zp);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), m4), zp);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + t * 32), lo);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + t * 32 + 16), hi);
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t kVCols = 16;   // contract/layout.py PANEL_COLUMNS
constexpr int64_t kVRows8 = 8;   // input rows an int8 pass (8 int32 + 8 float accumulators)
// Input rows an int4 pass (two int32 accumulators a row); more rows unpack the panel to int8
// pairs once. Two passes of 4 nibbles instead: level at 8 rows, slower at 16 (int4, ms: 8 rows
// 10.7-11.0 unpacked / 9.8-11.7; 16 rows 15.2-16.1 / 17.3-21.6).
constexpr int64_t kVRows4 = 4;

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

// One call's inputs: x requantized to int16 per run of 32, as on the AVX2 path.
struct VnniX {
  const int16_t* xq;    // [M, K]
  const float* xs;      // [M, runs]: each run's scale (its absmax / 32767)
  const int32_t* isum;  // [M, runs]: each run's sum of int16 x (symmetric int4's zero point)
  const float* fsum;    // [M, runs]: each run's float sum of x (stored mins); or nullptr
  const int32_t* xe;    // [M, runs, 128]: int4 passes' x, two pairs a vector (lay_out_x4)
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

// xe [M, runs, 8, 16] int32: for each two pairs of k (2d, 2d + 1), x's pair 2d in lanes 0-7 and
// pair 2d + 1 in lanes 8-15, the lanes of the int4 pass's weight vectors.
inline void lay_out_x4(const int16_t* xq, int64_t M, int64_t K, int32_t* xe) {
  alignas(64) int32_t idx[8][16];
  for (int d = 0; d < 8; ++d)
    for (int i = 0; i < 16; ++i) idx[d][i] = 2 * d + i / 8;
  for (int64_t r = 0; r < M * K / kRun; ++r) {
    const __m512i v = _mm512_loadu_si512(xq + r * kRun);  // the run's 16 pairs as int32
    for (int d = 0; d < 8; ++d)
      _mm512_storeu_si512(xe + r * 128 + d * 16,
                          _mm512_permutexvar_epi32(_mm512_load_si512(idx[d]), v));
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
  const char* p = static_cast<const char*>(run) + kPrefetch;
  for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
}

// f[m] += the run's int32 sums c of row m, scaled (and the zero points' term); g its group.
template <int64_t MR>
inline void scale_run(const QWeight& w, int64_t p, int64_t r, int64_t g, const VnniX& x,
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

// out [MR, 16] float32: MR rows of x (from row 0 of x's arrays) against panel p as int8
// pairs at wp (stored int8, or int4 unpacked; kMins: unpacked int4 values 0..15 and mins).
template <int64_t MR>
inline void pass_int8(const QWeight& w, int64_t p, const int8_t* wp, const VnniX& x, float* out) {
  const int64_t K = w.K, runs = K / kRun;
  // One or two rows: a single chain of `vpdpwssd` a row would wait on its latency.
  constexpr int64_t U = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  __m512 f[MR];
  for (int64_t m = 0; m < MR; ++m) f[m] = _mm512_setzero_ps();
  GroupCounter gc(w);
  for (int64_t r = 0; r < runs; ++r, gc.next()) {
    __m512i acc[U * MR];
    for (int64_t i = 0; i < U * MR; ++i) acc[i] = _mm512_setzero_si512();
    const int8_t* wr = wp + r * kRun * kVCols;
    prefetch_ahead(wr, kRun * kVCols);
    const int16_t* xr = x.xq + r * kRun;
    for (int64_t t = 0; t < kRun / 2; t += U) {
#pragma GCC unroll 4
      for (int64_t u = 0; u < U; ++u) {
        const __m512i wv = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + (t + u) * 32)));
        for (int64_t m = 0; m < MR; ++m)
          acc[u * MR + m] = dot_pairs(acc[u * MR + m], wv, _mm512_set1_epi32(
              *reinterpret_cast<const int32_t*>(xr + m * K + 2 * (t + u))));
      }
    }
    for (int64_t u = 1; u < U; ++u)
      for (int64_t m = 0; m < MR; ++m) acc[m] = _mm512_add_epi32(acc[m], acc[u * MR + m]);
    scale_run<MR>(w, p, r, gc.g, x, runs, acc, f);
  }
  for (int64_t m = 0; m < MR; ++m) _mm512_storeu_ps(out + m * kVCols, f[m]);
}

// The same for panel p's int4 pairs as stored (16 bytes a pair), two pairs a step.
template <int64_t MR, bool kSym>
inline void pass_int4(const QWeight& w, int64_t p, const uint8_t* wp, const VnniX& x, float* out) {
  const int64_t K = w.K, runs = K / kRun;
  constexpr int64_t U = MR == 1 ? 2 : 1;
  const __m512i m4 = _mm512_set1_epi16(15);
  __m512 f[MR];
  for (int64_t m = 0; m < MR; ++m) f[m] = _mm512_setzero_ps();
  GroupCounter gc(w);
  for (int64_t r = 0; r < runs; ++r, gc.next()) {
    __m512i lo[U * MR], hi[U * MR];
    for (int64_t i = 0; i < U * MR; ++i) lo[i] = hi[i] = _mm512_setzero_si512();
    const uint8_t* wr = wp + r * kRun * kVCols / 2;
    prefetch_ahead(wr, kRun * kVCols / 2);
    const int32_t* xr = x.xe + r * 128;
    for (int64_t d = 0; d < 8; d += U) {
#pragma GCC unroll 2
      for (int64_t u = 0; u < U; ++u) {
        // words: byte b of pair 2d (lanes 0-7 as int32) and of pair 2d + 1 (lanes 8-15)
        const __m512i b = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + (d + u) * 32)));
        const __m512i l = _mm512_and_si512(b, m4), h = _mm512_srli_epi16(b, 4);
        for (int64_t m = 0; m < MR; ++m) {
          const __m512i xv = _mm512_loadu_si512(xr + m * runs * 128 + (d + u) * 16);
          lo[u * MR + m] = dot_pairs(lo[u * MR + m], l, xv);
          hi[u * MR + m] = dot_pairs(hi[u * MR + m], h, xv);
        }
      }
    }
    __m512i c[MR];
    for (int64_t m = 0; m < MR; ++m) {
      __m512i a = lo[m], b = hi[m];
      for (int64_t u = 1; u < U; ++u) a = _mm512_add_epi32(a, lo[u * MR + m]), b = _mm512_add_epi32(b, hi[u * MR + m]);
      // columns 0-7: lanes 0-7 + 8-15 of a; columns 8-15: the same of b
      c[m] = _mm512_add_epi32(_mm512_shuffle_i64x2(a, b, 0x44), _mm512_shuffle_i64x2(a, b, 0xEE));
      if constexpr (kSym) c[m] = _mm512_sub_epi32(c[m], _mm512_set1_epi32(8 * x.isum[m * runs + r]));
    }
    scale_run<MR>(w, p, r, gc.g, x, runs, c, f);
  }
  for (int64_t m = 0; m < MR; ++m) _mm512_storeu_ps(out + m * kVCols, f[m]);
}

inline void pass_int8_any(int64_t mr, const QWeight& w, int64_t p, const int8_t* wp,
                          const VnniX& x, float* out) {
  switch (mr) {
    case 1: return pass_int8<1>(w, p, wp, x, out);
    case 2: return pass_int8<2>(w, p, wp, x, out);
    case 3: return pass_int8<3>(w, p, wp, x, out);
    case 4: return pass_int8<4>(w, p, wp, x, out);
    case 5: return pass_int8<5>(w, p, wp, x, out);
    case 6: return pass_int8<6>(w, p, wp, x, out);
    case 7: return pass_int8<7>(w, p, wp, x, out);
    default: return pass_int8<8>(w, p, wp, x, out);
  }
}

template <bool kSym>
inline void pass_int4_any(int64_t mr, const QWeight& w, int64_t p, const uint8_t* wp,
                          const VnniX& x, float* out) {
  switch (mr) {
    case 1: return pass_int4<1, kSym>(w, p, wp, x, out);
    case 2: return pass_int4<2, kSym>(w, p, wp, x, out);
    case 3: return pass_int4<3, kSym>(w, p, wp, x, out);
    default: return pass_int4<4, kSym>(w, p, wp, x, out);
  }
}

// x [M, K] bf16 or fp16 -> y [M, N] in x's dtype, rounded once from the float32 sums.
template <typename X, typename Y>
void gemm_qpanels_512(const QWeight& w, const X* x, const float* bias, Y* y, int64_t M) {
  const int64_t K = w.K, runs = K / kRun;
  thread_local std::vector<int16_t> xq;  // scratch kept between calls
  thread_local std::vector<float> xs, fsum;
  thread_local std::vector<int32_t> isum, xe;
  xq.resize(M * K);
  xs.resize(M * runs);
  isum.resize(M * runs);
  fsum.resize(w.mins ? M * runs : 0);
  quantize_runs_512(x, M * runs, xq.data(), xs.data(), isum.data(), w.mins ? fsum.data() : nullptr);
  // int4 rows in one pass take the nibbles as stored; more rows unpack each panel once.
  const bool native4 = w.int4 && M <= kVRows4;
  if (native4) {
    xe.resize(M * runs * 128);
    lay_out_x4(xq.data(), M, K, xe.data());
  }
  // Pointers, not the thread_local vectors: inside the lambda those names are the worker
  // thread's own (empty) vectors.
  const VnniX vx{xq.data(), xs.data(), isum.data(), w.mins ? fsum.data() : nullptr, xe.data()};
  aotllm::parallel_chunks(0, w.N / kVCols, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float out[kVRows8 * kVCols];
    std::vector<int8_t> buf(w.int4 && !native4 ? kVCols * K : 0);
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* wp = w.q + p * kVCols * (w.int4 ? K / 2 : K);
      const int8_t* w8 = reinterpret_cast<const int8_t*>(wp);
      if (w.int4 && !native4) {
        if (w.mins) unpack_int4_panel<false>(wp, K, buf.data());
        else unpack_int4_panel<true>(wp, K, buf.data());
        w8 = buf.data();
      }
      const int64_t step = native4 ? kVRows4 : kVRows8;
      for (int64_t m0 = 0; m0 < M; m0 += step) {
        const int64_t mr = std::min(step, M - m0);
        const VnniX xm{vx.xq + m0 * K, vx.xs + m0 * runs, vx.isum + m0 * runs,
                       vx.fsum ? vx.fsum + m0 * runs : nullptr, vx.xe + m0 * runs * 128};
        if (native4 && w.mins) pass_int4_any<false>(mr, w, p, wp, xm, out);
        else if (native4) pass_int4_any<true>(mr, w, p, wp, xm, out);
        else pass_int8_any(mr, w, p, w8, xm, out);
        for (int64_t m = 0; m < mr; ++m)
          for (int64_t j = 0; j < kVCols; ++j) {
            const int64_t n = p * kVCols + j;
            y[(m0 + m) * w.N + n] = static_cast<Y>(out[m * kVCols + j] + (bias ? bias[n] : 0.f));
          }
      }
    }
  });
}
#endif

}  // namespace aotllm
