// y = x W^T (+ b) with W quantized and stored at build time in pair panels: the "panels16q"
// layouts of AVX2 targets and "rowsqh" of AVX512-BF16 ones (contract/layout.py;
// runtime/models/panels.py pack_qpanels writes it). This file is the AVX2 kernel and the op;
// AVX-512 targets run qpanel_vnni.h, and bf16 batches qpanel_amx.h where AMX is (where AMX
// is built for but not granted, bf16 prompts beyond kVnniMaxRows rows dequantize W once for
// oneDNN's GEMM). Panels of 16
// output columns, K-major, each column's weights interleaved by pairs of k: one 32-byte row
// (int8; 16 bytes for int4) holds a pair of k for all 16 columns.
//
// Why: with the row-major weights of layout 1 (quant_int16.h), every run of 32 weights is
// dotted with an input row and its integer sum scaled on its own: two loads of x, two
// `vpmaddwd`, an add, a conversion and an FMA per run and row, 4 products an instruction,
// and the weights widened again for every pass of 8 rows. Here a pair of x's int16 values
// is broadcast once (one `vpbroadcastd`) and multiplied into 16 columns by two `vpmaddwd`
// of weights widened once for up to kRowsQ rows; the sums are scaled once per run for 16
// columns. Measured (SmolLM2's 30 layers of linears, 2 threads, Zen 3, interleaved, ms; "here"
// is this kernel's first version, the same inner loop for groups of 32 only; the op itself
// is in bench/quant_kernels.py and bench/results/latest/quant.md):
//            1 row   4 rows   8 rows   16 rows   143 rows
//   int8 rows 10.5    16.6     35.5     68.6      339      (quant_int16.h, quant_panel.h)
//   int8 here  8.7    10.7     17.3     28.9      209
//   int4 rows  8.2    17.2     29.0     58.9      271      (quant_int4_pairs.h)
//   int4 here  6.5    12.0     19.7     34.0      260
//   bf16 panels 17.3  18.3     27.5     46.4      281      (panel_linear.cpp)
//
// x is requantized per run of 32: to int16 against int8 weights, as on the row path
// (quant_int16.h: an error 128x below the input's own bf16 rounding), and to int8 against
// int4 weights (llama.cpp's Q8_0 activations: a step 16x below the int4 weights' own; see
// quantize_runs_int8). float32 inputs, which would notice it, and targets without AVX2 take
// the weights dequantized to float32 and at::linear (correct, not fast: builds choose these
// layouts for 16-bit models only, on targets with a fast path).
//
// int4 zero points: symmetric (no mins) takes 8 x the run's sum of int8 x off its integer
// sums; with mins (Q4_1), each run adds min x (the run's float sum of x), the float term of
// W = q * s + min.
//
// int4 calls with more rows than one pass unpack each panel to quads once
// (unpack_int4_quads): a pass over the stored nibbles reorders them for every 3 rows.
#include "aoti_shim.h"
#include "parallel.h"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "pair_kernel.h"
#include "prefetch.h"
#include "qpanel_amx.h"
#include "qpanel_dequant.h"
#include "qpanel_vnni.h"
#include "quant_int16.h"
#include "quant_weight.h"

#include <algorithm>
#include <optional>
#include <vector>

namespace {

using namespace aotllm;  // NOLINT: QWeight, half_to_float, quantize_runs_int16

constexpr int64_t kCols = 16;  // contract/layout.py PANEL_COLUMNS
// Input rows up to which the AVX-512 integer passes (qpanel_vnni.h) beat dequantizing W
// to bf16 for oneDNN's GEMM on AMX hosts, where oneDNN takes AMX tiles. Measured (SmolLM2's
// 30 layers, int8 / int4 g32, 2 threads, Xeon with AMX, int16 x, ms, two rounds): 32 rows
// 23-25 against 33-37, 48 rows 33 against 35-40, 64 rows 42-44 against 39-43, 128 rows 76-84
// against 45-48. Without AMX, oneDNN's bf16 GEMM loses to the integer passes at every row
// count (Zen 5, AVX512-BF16, int4 with int8 x, two rounds: 64 rows 14.1-16.0 against
// 26-50, 128 rows 28.5-30.6 against 39-65, 256 rows 56-59 against 67-90; int8 128 rows 47
// against 62-64): no dequantized copy there.
constexpr int64_t kVnniMaxRows = 48;
// Input rows from which AMX (qpanel_amx.h, dequantizing each weight once a call) beats the
// VNNI passes. Measured (same 30 layers, ms, AMX / VNNI, two rounds): int8 8 rows 12.2-12.4 /
// 7.3-7.8, 16 rows 12.1 / 12.3-12.4, 32 rows 13.4-13.6 / 21.6, 128 rows 23.8-24.1 / 44-50;
// int4 8 rows 9.0-9.4 / 9.7-10.1, 16 rows 8.8-9.8 / 14.3-14.6, 128 rows 21 / 41-44. With the
// AMX dequantization prefetching (qpanel_amx.h): int8 16 rows 9.6-9.8, int4 8 rows 8.2-8.3.
constexpr int64_t kAmxMinRows8 = 16, kAmxMinRows4 = 8;
// Input rows from which int8 weights, dequantized to bf16 pair panels once a call, go through
// `vdpbf16ps` (pair_kernel.h) on AVX512-BF16 targets where AMX is not, rather than the VNNI
// passes on int16 x: x needs no requantization, and the bf16 pass reaches the instruction
// rate the integer one does not (no widening, no scaling a run). Measured (SmolLM2's 30
// layers, int8 g32, 2 threads, Zen 5, best of 5, ms, VNNI / dequantized): 8 rows 5.5 / 5.3,
// 16 rows 8.1 / 7.8, 32 rows 14.0 / 10.5, 64 rows 24.7 / 17.4, 143 rows 51.6 / 33.7 (bf16
// weights in pair panels: 35). Served (c=16, SmolLM2 from its Q8_0 GGUF): 409 -> 687
// tok/s, the build's fidelity KL against float32 0.00034 -> 0.00035.
constexpr int64_t kDpbf16MinRows8 = 16;

// W[n, k] as float32, read through the pair-panel layout (the portable path, and tests).
float value_at(const QWeight& w, int64_t n, int64_t k) {
  const int64_t p = n / kCols, j = n % kCols, g = k / w.group;
  const int64_t gi = p * kCols * w.groups + g * kCols + j;  // scales, mins in panels too
  const float s = half_to_float(w.scales[gi]);
  const int64_t e = 2 * j + k % 2;  // the value's place among the 32 of its pair of k
  const int64_t pair = p * (w.K / 2) + k / 2;
  if (!w.int4) return s * static_cast<float>(reinterpret_cast<const int8_t*>(w.q)[pair * 32 + e]);
  const uint8_t byte = w.q[pair * 16 + e % 16];
  const float v = static_cast<float>(e < 16 ? (byte & 15) : (byte >> 4));
  return v * s + (w.mins ? half_to_float(w.mins[gi]) : -8.f * s);
}

#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int64_t kRowsQ = 3;  // 3 rows: 6 int32 + 6 float accumulators, 2 weights, 1 x

// Pair t of int8 panel `wp` as int16: lo = columns 0..7 (each k, k+1), hi = columns 8..15.
inline void pair_int16(const uint8_t* wp, int64_t t, __m256i& lo, __m256i& hi) {
  lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + t * 32)));
  hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + t * 32 + 16)));
}

// What a pass over a panel prefetches of the next one: `run` bytes from `at` + r * run
// during run r, so that the passes over a panel prefetch the next one between them (the
// passes after the first read this panel from L1, and the hardware prefetcher, seeing no
// misses, did not run ahead). Measured (SmolLM2's 30 layers of linears from memory, 2
// threads, AVX2 forced on an Intel Xeon with AMX, ms, interleaved): int8 1 row 7.2-7.7 ->
// 4.9-5.3 (the floor at 22 GB/s: 5), 8 rows 13-14.7 -> 10.2-10.7, 16 rows 21-22.8 -> 18.2-18.5,
// its int8 LM head at 16 rows 5.0-5.2 -> 3.8-3.9; int4 16 rows 13.7-14.3 -> 13.0-13.2.
struct NextPanel {
  const char* at;
  int64_t run;
  void fetch(int64_t r) const { prefetch_lines(at + r * run, run); }
};

// Pass `pass` of `passes`' share of the panel after `panel` (bytes long), a run of 32 k at a
// time.
inline NextPanel next_panel(const uint8_t* panel, int64_t bytes, bool last, int64_t pass,
                            int64_t passes, int64_t runs) {
  const PanelShare share = next_panel_share(panel, bytes, last, pass, passes);
  return {share.at, (share.bytes + runs - 1) / runs};
}

// out[m][16] = rows m of x (int16 xq [MR, K], run scales xs [MR, runs]) against int8 panel p.
template <int64_t MR>
inline void panel_pass(const QWeight& w, int64_t p, const uint8_t* wp, const int16_t* xq,
                       const float* xs, float* out, const NextPanel& next) {
  const int64_t K = w.K, runs = K / kRun, per_group = w.group / kRun;
  const at::Half* sp = w.scales + p * kCols * w.groups;
  __m256 f0[MR], f1[MR];
  for (int64_t m = 0; m < MR; ++m) f0[m] = f1[m] = _mm256_setzero_ps();
  for (int64_t r = 0; r < runs; ++r) {
    next.fetch(r);
    __m256i a0[MR], a1[MR];
    for (int64_t m = 0; m < MR; ++m) a0[m] = a1[m] = _mm256_setzero_si256();
    const uint8_t* wr = wp + r * kRun * kCols;
#pragma GCC unroll 4
    for (int64_t t = 0; t < kRun / 2; ++t) {
      __m256i lo, hi;
      pair_int16(wr, t, lo, hi);
      for (int64_t m = 0; m < MR; ++m) {
        const __m256i xb = _mm256_set1_epi32(
            *reinterpret_cast<const int32_t*>(xq + m * K + r * kRun + 2 * t));
        a0[m] = _mm256_add_epi32(a0[m], _mm256_madd_epi16(lo, xb));
        a1[m] = _mm256_add_epi32(a1[m], _mm256_madd_epi16(hi, xb));
      }
    }
    const int64_t g = r / per_group;
    const auto* sg = reinterpret_cast<const __m128i*>(sp + g * kCols);
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(sg)), s1 = _mm256_cvtph_ps(_mm_loadu_si128(sg + 1));
    for (int64_t m = 0; m < MR; ++m) {
      const __m256 xsb = _mm256_broadcast_ss(xs + m * runs + r);
      f0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0[m]), _mm256_mul_ps(s0, xsb), f0[m]);
      f1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1[m]), _mm256_mul_ps(s1, xsb), f1[m]);
    }
  }
  for (int64_t m = 0; m < MR; ++m) {
    _mm256_storeu_ps(out + m * kCols, f0[m]);
    _mm256_storeu_ps(out + m * kCols + 8, f1[m]);
  }
}

// int4 panels take x in int8 per run of 32, as on AVX-512 (qpanel_vnni.h QuadX): the
// unsigned nibbles times x's int8 values by `vpmaddubsw` (32 products an instruction, summed
// by pairs into int16), the int16 sums added across the run (8 quads: at most 16 products of
// 15 x 127 a lane, 30480), and one `vpmaddwd` by ones a run to int32; the widened int16
// weights of the int8 path took 16 products an instruction, and a widening per 16 weights.
// SmolLM2's 30 layers, 2 threads, AVX2 forced on Zen 5, interleaved, ms: 1 row 1.8-2.3 ->
// 1.2, 4 rows 4.4-5.0 -> 3.0, 16 rows 11.8-12.9 -> 7.5-7.8, 32 rows 21.6-23.2 -> 13.5-13.7.
// xq [M * K] int8, xs [M * K / 32] each run's scale, isum each run's sum of xq; with fsum,
// each run's float sum (the mins' term).
template <typename X>
inline void quantize_runs_int8(const X* x, int64_t n_runs, int8_t* xq, float* xs,
                               int32_t* isum, float* fsum) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < n_runs; ++i) {
    __m256 v[4];
    const float amax = load_run(x + i * kRun, v);
    xs[i] = amax / 127.f;
    if (fsum) fsum[i] = aotllm::vsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i q[4];
    for (int64_t j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    isum[i] = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
    // packs interleave 128-bit halves (dwords a0-3 b0-3 c0-3 d0-3 a4-7 ...); the permute
    // puts the values back in order
    const __m256i b8 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * kRun), _mm256_permutevar8x32_epi32(b8, order));
  }
}

// Quad q (k 4q .. 4q + 3) of an int4 panel as stored (pairs 2q, 2q + 1) or unpacked to quads
// (unpack_int4_quads): lo = columns 0-7, hi = 8-15, each column's 4 values in one lane.
template <bool kStored>
inline void quad_u8(const uint8_t* wp, int64_t q, __m256i& lo, __m256i& hi) {
  if constexpr (kStored) {
    // lane 0 pair 2q, lane 1 pair 2q + 1, each column's 2 values a word: the permute puts
    // columns 0-3 of both pairs in lane 0 (4-7 in lane 1), the shuffle a column's 4 together
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + q * 32));
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i order = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                           0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    lo = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(_mm256_and_si256(y, m4), 0xD8), order);
    hi = _mm256_shuffle_epi8(
        _mm256_permute4x64_epi64(_mm256_and_si256(_mm256_srli_epi16(y, 4), m4), 0xD8), order);
  } else {
    lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + q * 64));
    hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + q * 64 + 32));
  }
}

// An int4 panel as quads: 64 bytes a quad of k (4q .. 4q + 3), column j's 4 values (0..15)
// in bytes 4j .. 4j + 3, what quad_u8 makes of the stored nibbles. Done once per panel when
// a call has more rows than one pass takes: a pass over the stored nibbles reorders them
// again for every 3 rows (a 128-token prompt: tens of times).
inline void unpack_int4_quads(const uint8_t* wp, int64_t K, uint8_t* dst) {
  const __m128i m4 = _mm_set1_epi8(15);
  for (int64_t q = 0; q < K / 4; ++q) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + q * 32));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + q * 32 + 16));
    const __m128i la = _mm_and_si128(a, m4), lb = _mm_and_si128(b, m4);
    const __m128i ha = _mm_and_si128(_mm_srli_epi16(a, 4), m4), hb = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
    __m128i* o = reinterpret_cast<__m128i*>(dst + q * 64);
    _mm_storeu_si128(o, _mm_unpacklo_epi16(la, lb));
    _mm_storeu_si128(o + 1, _mm_unpackhi_epi16(la, lb));
    _mm_storeu_si128(o + 2, _mm_unpacklo_epi16(ha, hb));
    _mm_storeu_si128(o + 3, _mm_unpackhi_epi16(ha, hb));
  }
}

// out[m][16] = rows m of x (int8 xq [MR, K], xs, isum, fsum [MR, runs]) against int4 panel p.
template <int64_t MR, bool kStored, bool kSym>
inline void quad_pass(const QWeight& w, int64_t p, const uint8_t* wp, const int8_t* xq,
                      const float* xs, const int32_t* isum, const float* fsum, float* out,
                      const NextPanel& next) {
  const int64_t K = w.K, runs = K / kRun, per_group = w.group / kRun;
  const at::Half* sp = w.scales + p * kCols * w.groups;
  const at::Half* mp = w.mins ? w.mins + p * kCols * w.groups : nullptr;
  const __m256i ones = _mm256_set1_epi16(1);
  // The float sums live in `out` between runs (a load and a store a row per run of 32 k):
  // held in registers beside the int16 sums, 3 rows took all 16 of AVX2's and GCC spilled
  // inside the inner loop (10-16 stack stores per 6 vpmaddubsw).
  for (int64_t m = 0; m < MR * kCols; ++m) out[m] = 0.f;
  for (int64_t r = 0; r < runs; ++r) {
    next.fetch(r);
    __m256i a0[MR], a1[MR];
#pragma GCC unroll 4
    for (int64_t m = 0; m < MR; ++m) a0[m] = a1[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int64_t q = 0; q < kRun / 4; ++q) {
      __m256i lo, hi;
      quad_u8<kStored>(wp, r * kRun / 4 + q, lo, hi);
#pragma GCC unroll 4
      for (int64_t m = 0; m < MR; ++m) {
        const __m256i xb = _mm256_set1_epi32(
            *reinterpret_cast<const int32_t*>(xq + m * K + r * kRun + 4 * q));
        a0[m] = _mm256_add_epi16(a0[m], _mm256_maddubs_epi16(lo, xb));
        a1[m] = _mm256_add_epi16(a1[m], _mm256_maddubs_epi16(hi, xb));
      }
    }
    const int64_t g = r / per_group;
    const auto* sg = reinterpret_cast<const __m128i*>(sp + g * kCols);
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(sg)), s1 = _mm256_cvtph_ps(_mm_loadu_si128(sg + 1));
    __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
    if (mp) {  // + min x (sum of the run's x), in float as the reference
      const auto* mg = reinterpret_cast<const __m128i*>(mp + g * kCols);
      m0 = _mm256_cvtph_ps(_mm_loadu_si128(mg));
      m1 = _mm256_cvtph_ps(_mm_loadu_si128(mg + 1));
    }
#pragma GCC unroll 4
    for (int64_t m = 0; m < MR; ++m) {
      __m256i c0 = _mm256_madd_epi16(a0[m], ones), c1 = _mm256_madd_epi16(a1[m], ones);
      if constexpr (kSym) {  // the zero point: (q - 8) x = q x - 8 x
        const __m256i z = _mm256_set1_epi32(8 * isum[m * runs + r]);
        c0 = _mm256_sub_epi32(c0, z);
        c1 = _mm256_sub_epi32(c1, z);
      }
      const __m256 xsb = _mm256_broadcast_ss(xs + m * runs + r);
      __m256 f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c0), _mm256_mul_ps(s0, xsb),
                                  _mm256_loadu_ps(out + m * kCols));
      __m256 f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c1), _mm256_mul_ps(s1, xsb),
                                  _mm256_loadu_ps(out + m * kCols + 8));
      if (mp) {
        const __m256 sb = _mm256_broadcast_ss(fsum + m * runs + r);
        f0 = _mm256_fmadd_ps(m0, sb, f0);
        f1 = _mm256_fmadd_ps(m1, sb, f1);
      }
      _mm256_storeu_ps(out + m * kCols, f0);
      _mm256_storeu_ps(out + m * kCols + 8, f1);
    }
  }
}

template <bool kStored, bool kSym>
inline void quad_rows(int64_t mr, const QWeight& w, int64_t p, const uint8_t* wp,
                      const int8_t* xq, const float* xs, const int32_t* isum, const float* fsum,
                      float* out, const NextPanel& next) {
  switch (mr) {
    case 3: return quad_pass<3, kStored, kSym>(w, p, wp, xq, xs, isum, fsum, out, next);
    case 2: return quad_pass<2, kStored, kSym>(w, p, wp, xq, xs, isum, fsum, out, next);
    default: return quad_pass<1, kStored, kSym>(w, p, wp, xq, xs, isum, fsum, out, next);
  }
}

// int8 weights: x [M, K] bf16 or fp16 -> y [M, N] in x's dtype (or float32: Y), rounded once
// from the float32 sums.
template <typename X, typename Y>
void gemm_qpanels_int8(const QWeight& w, const X* x, const float* bias, Y* y, int64_t M) {
  const int64_t K = w.K, runs = K / kRun;
  thread_local std::vector<int16_t> xq;  // scratch kept between calls
  thread_local std::vector<float> xs;
  xq.resize(M * K);
  xs.resize(M * runs);
  quantize_runs_int16(x, M, K, xq.data(), xs.data(), nullptr);
  // Pointers, not the thread_local vectors: inside the lambda those names are the worker
  // thread's own (empty) vectors.
  const int16_t* xqp = xq.data();
  const float* xsp = xs.data();
  aotllm::parallel_chunks(0, w.N / kCols, 1, [&](int64_t begin, int64_t end) {
    float out[kRowsQ * kCols];
    const int64_t passes = (M + kRowsQ - 1) / kRowsQ;
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* wp = w.q + p * kCols * K;
      const bool last = p + 1 == w.N / kCols;
      for (int64_t m0 = 0; m0 < M; m0 += kRowsQ) {
        const int64_t mr = std::min(kRowsQ, M - m0);
        const NextPanel next = next_panel(wp, kCols * K, last, m0 / kRowsQ, passes, runs);
        switch (mr) {
          case 3: panel_pass<3>(w, p, wp, xqp + m0 * K, xsp + m0 * runs, out, next); break;
          case 2: panel_pass<2>(w, p, wp, xqp + m0 * K, xsp + m0 * runs, out, next); break;
          default: panel_pass<1>(w, p, wp, xqp + m0 * K, xsp + m0 * runs, out, next);
        }
        store_panel(out, mr, bias ? bias + p * kCols : nullptr, y + m0 * w.N + p * kCols,
                    w.N);
      }
    }
  });
}

// int4 weights, likewise: one pass of rows reads the nibbles as stored; more rows unpack
// each panel to quads once (the stored nibbles were reordered again for every pass).
template <bool kSym, typename X, typename Y>
void gemm_qpanels_int4(const QWeight& w, const X* x, const float* bias, Y* y, int64_t M) {
  const int64_t K = w.K, runs = K / kRun;
  thread_local Int8Runs xr;  // scratch kept between calls
  xr.resize(w, M);
  quantize_runs_int8(x, M * runs, xr.xq.data(), xr.xs.data(), xr.isum.data(), xr.fsum_or_null());
  // Pointers, not the thread_local scratch: inside the lambda that name is the worker
  // thread's own (empty) one.
  const int8_t* xqp = xr.xq.data();
  const float* xsp = xr.xs.data();
  const int32_t* isp = xr.isum.data();
  const float* fsp = xr.fsum_or_null();
  const bool unpack = M > kRowsQ;
  aotllm::parallel_chunks(0, w.N / kCols, 1, [&](int64_t begin, int64_t end) {
    float out[kRowsQ * kCols];
    std::vector<uint8_t> buf(unpack ? kCols * K : 0);
    const int64_t passes = (M + kRowsQ - 1) / kRowsQ;
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* wp = w.q + p * kCols * K / 2;
      const bool last = p + 1 == w.N / kCols;
      if (unpack) unpack_int4_quads(wp, K, buf.data());
      for (int64_t m0 = 0; m0 < M; m0 += kRowsQ) {
        const int64_t mr = std::min(kRowsQ, M - m0);
        const float* fm = fsp ? fsp + m0 * runs : nullptr;
        const NextPanel next = next_panel(wp, kCols * K / 2, last, m0 / kRowsQ, passes, runs);
        if (unpack)
          quad_rows<false, kSym>(mr, w, p, buf.data(), xqp + m0 * K, xsp + m0 * runs,
                                 isp + m0 * runs, fm, out, next);
        else
          quad_rows<true, kSym>(mr, w, p, wp, xqp + m0 * K, xsp + m0 * runs, isp + m0 * runs,
                                fm, out, next);
        store_panel(out, mr, bias ? bias + p * kCols : nullptr, y + m0 * w.N + p * kCols,
                    w.N);
      }
    }
  });
}

template <typename X, typename Y>
void gemm_qpanels_any(const QWeight& w, const X* x, const float* bias, Y* y, int64_t M) {
  if (!w.int4) return gemm_qpanels_int8(w, x, bias, y, M);
  if (w.mins) return gemm_qpanels_int4<false>(w, x, bias, y, M);
  return gemm_qpanels_int4<true>(w, x, bias, y, M);
}
#endif

#if defined(__AVX512BF16__)
// int8 weights x bf16 x [M, K] -> y [M, N]: each panel dequantized once a call (q x s, rounded
// once to bf16, as the AMX path does: dequant_run_tile) into a thread's buffer of two panels,
// then the bf16 engines' pair pass over it (pair_kernel.h).
template <typename Y>
void gemm_qpanels_dpbf16(const QWeight& w, const at::BFloat16* x, const float* bias, Y* y,
                         int64_t M) {
  const int64_t K = w.K, runs = K / kRun;
  const auto* xp = reinterpret_cast<const int32_t*>(x);
  const int64_t rows = dpbf16_pass_rows(M);
  aotllm::parallel_chunks(0, w.N / kCols, 2, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> buf(2 * runs * 512 + 32);
    uint16_t* pb = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
    alignas(64) float c[16 * kCols];  // [np][mr][16]
    for (int64_t p = begin, np = 0; p < end; p += np) {
      np = std::min<int64_t>(2, end - p);
      for (int64_t q = 0; q < np; ++q) {
        GroupCounter gc(w);
        for (int64_t r = 0; r < runs; ++r, gc.next())
          dequant_run_tile(w, p + q, r, gc.g, pb + q * runs * 512 + r * 512);
      }
      const char* pw = reinterpret_cast<const char*>(pb);
      for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int64_t mr = std::min(rows, M - m0);
        if (np == 2) dpbf16_any<2>(mr, xp + m0 * K / 2, K, pw, c, nullptr);
        else dpbf16_any<1>(mr, xp + m0 * K / 2, K, pw, c, nullptr);
        for (int64_t q = 0; q < np; ++q)
          store_panel(c + q * mr * kCols, mr, bias ? bias + (p + q) * kCols : nullptr,
                      y + m0 * w.N + (p + q) * kCols, w.N);
      }
    }
  });
}
#endif

// The integer passes of this target: AVX-512's (qpanel_vnni.h) or AVX2's (above).
#if defined(__AVX512F__) && defined(__AVX512BW__)
template <typename X, typename Y>
void gemm_integer(const QWeight& w, const X* x, const float* bias, Y* y, int64_t M) {
  gemm_qpanels_512(w, x, bias, y, M);
}
#elif defined(__AVX2__)
template <typename X, typename Y>
void gemm_integer(const QWeight& w, const X* x, const float* bias, Y* y, int64_t M) {
  gemm_qpanels_any(w, x, bias, y, M);
}
#endif

at::Tensor linear_qpanel(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                         const std::optional<at::Tensor>& mins,
                         const std::optional<at::Tensor>& b, int64_t group, bool float_out) {
  const bool int4 = q.scalar_type() == at::kByte;
  TORCH_CHECK(int4 || q.scalar_type() == at::kChar, "qweight must be int8 or uint8 (int4)");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && scales.is_contiguous() &&
                  scales.scalar_type() == at::kHalf && scales.size(0) == q.size(0),
              "qweight [N, K or K/2] and float16 scales [N, groups], contiguous");
  const int64_t N = q.size(0), K = int4 ? 2 * q.size(1) : q.size(1);
  TORCH_CHECK(N % kCols == 0 && K % kRun == 0 && group % kRun == 0 && group > 0 &&
                  scales.size(1) == (K + group - 1) / group,
              "pair panels need N % 16 == 0, K and the group size multiples of 32");
  TORCH_CHECK(x.size(-1) == K, "x's last dimension must be K");
  TORCH_CHECK(!mins.has_value() || (int4 && mins->sizes() == scales.sizes() &&
                                    mins->scalar_type() == at::kHalf && mins->is_contiguous()),
              "mins: int4 only, float16 shaped like scales");
  const QWeight w{static_cast<const uint8_t*>(q.data_ptr()), scales.data_ptr<at::Half>(),
                  mins.has_value() ? mins->data_ptr<at::Half>() : nullptr,
                  N, K, scales.size(1), group, int4};
  const auto dt = x.scalar_type();
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  const int64_t M = x.numel() / K;
  // `float_out`: y in float32 (the LM head's logits), rounded from the same float32 sums.
  const auto y_options = x.options().dtype(float_out ? at::kFloat : dt);
#if (defined(__AVX512F__) && defined(__AVX512BW__)) || defined(__AVX2__)
  if (dt == at::kBFloat16 || dt == at::kHalf) {
    const at::Tensor bias = b.has_value() ? b->to(at::kFloat).contiguous() : at::Tensor();
    const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
    const at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (M >= (int4 ? kAmxMinRows4 : kAmxMinRows8) && dt == at::kBFloat16 && amx_ready()) {
      at::Tensor y = at::empty(out_shape, y_options);
      if (float_out) gemm_qpanels_amx(w, xc.data_ptr<at::BFloat16>(), bp, y.data_ptr<float>(), M);
      else gemm_qpanels_amx(w, xc.data_ptr<at::BFloat16>(), bp, y.data_ptr<at::BFloat16>(), M);
      return y;
    }
    // AMX not granted to this process: prompts dequantize once for oneDNN's GEMM (bf16 out
    // only; float32 logits rows of a prompt take the integer passes below).
    if (M > kVnniMaxRows && dt == at::kBFloat16 && !float_out) {
      at::Tensor wt = at::empty({K, N}, x.options());
      dequant_qpanels_kn(w, wt.data_ptr<at::BFloat16>());
      return at::linear(xc, wt.t(), b);
    }
#endif
#if defined(__AVX512BF16__)
    if (!int4 && M >= kDpbf16MinRows8 && dt == at::kBFloat16) {
      at::Tensor y = at::empty(out_shape, y_options);
      if (float_out) gemm_qpanels_dpbf16(w, xc.data_ptr<at::BFloat16>(), bp, y.data_ptr<float>(), M);
      else gemm_qpanels_dpbf16(w, xc.data_ptr<at::BFloat16>(), bp, y.data_ptr<at::BFloat16>(), M);
      return y;
    }
#endif
    at::Tensor y = at::empty(out_shape, y_options);
    if (float_out && dt == at::kBFloat16)
      gemm_integer(w, xc.data_ptr<at::BFloat16>(), bp, y.data_ptr<float>(), M);
    else if (float_out)
      gemm_integer(w, xc.data_ptr<at::Half>(), bp, y.data_ptr<float>(), M);
    else if (dt == at::kBFloat16)
      gemm_integer(w, xc.data_ptr<at::BFloat16>(), bp, y.data_ptr<at::BFloat16>(), M);
    else
      gemm_integer(w, xc.data_ptr<at::Half>(), bp, y.data_ptr<at::Half>(), M);
    return y;
  }
#endif
  at::Tensor wf = at::empty({N, K}, x.options().dtype(at::kFloat));
  float* wd = wf.data_ptr<float>();
  aotllm::parallel_chunks(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < K; ++k) wd[n * K + k] = value_at(w, n, k);
  });
  const auto bf = b.has_value() ? std::optional<at::Tensor>(b->to(at::kFloat)) : std::nullopt;
  const at::Tensor y = at::linear(x.to(at::kFloat), wf, bf);
  return float_out ? y : y.to(dt);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aotllm, m) {
  m.def("linear_qpanel(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? b, "
        "int group_size, bool float_out=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(aotllm, CPU, m) { m.impl("linear_qpanel", &linear_qpanel); }

AOTI_ENTRY_POINT aoti_torch_cpu_linear_qpanel(AtenTensorHandle x, AtenTensorHandle qweight,
                                         AtenTensorHandle scales, AtenTensorHandle* mins,
                                         AtenTensorHandle* b, int64_t group_size,
                                         int32_t float_out, AtenTensorHandle* ret0) {
  using namespace aotllm::shim;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    out(linear_qpanel(in(x), in(qweight), in(scales), opt(mins), opt(b), group_size,
                      float_out != 0), ret0);
  });
}
