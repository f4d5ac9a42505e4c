// int4 decode rows of 16-bit inputs two runs at a time (quant_int16.h's integer dot products,
// in fewer instructions).
//
// quant_int16.h widens each run of 32 nibbles to int16 with two lane-crossing `vpmovzxbw`
// after masking and shifting its 16 bytes: five operations a run, and one int-to-float
// conversion and FMA a run. Here one 32-byte load takes two runs (lane 0: run 2p, lane 1:
// run 2p+1, the packed layout unchanged) and four in-lane operations widen all 64 nibbles:
// 16-bit word j of a lane holds bytes 2j and 2j+1, i.e. the nibbles of values 2j, 16+2j,
// 2j+1 and 17+2j of its run, so `and 15`, `>> 4 and 15`, `>> 8 and 15` and `>> 12` give
// four vectors of int16 weights. x is laid out once per call in the same order (the four
// x vectors of pair p hold, lane by lane, those values of each run), so the `vpmaddwd`s
// line up; lanes 0-3 of their sum belong to run 2p and lanes 4-7 to run 2p+1, and one
// conversion and one FMA take both runs, against a scale vector {s_2p x4, s_2p+1 x4}.
// Symmetric weights (no mins) take their zero point (-8) in the integer sum: 8 x the run's
// sum of int16 x, made once per call, is subtracted from lane 0 (run 2p) and lane 4. No int32
// overflow: a lane sums 8 products of at most 15 x 32767, the correction is at most
// 8 x 32 x 32767 (2^23).
//
// Measured (SmolLM2's rows of Q4_0, cycles a run of 32, one thread): K = 576 in L1 6.0 -> 4.6,
// K = 1536 4.9 -> 3.7, 28 MB from memory 7.7-8.1 -> 6.8-7.2; the 28 MB on two threads
// 3.8-4.7 -> 2.3-3.5 ms; `linear_int4` in a Q4_0 engine's batch-1 step 8.2-8.6 -> 6.9-7.6 ms.
#pragma once

#include "parallel.h"
#include "quant_int16.h"

namespace aotllm {

#if defined(__AVX2__) && !defined(__AVX512F__)

// One call's inputs, laid out once for all weight rows. A row of x has `slots` slots: one a
// pair of runs, and the last run alone when the count of runs is odd.
struct PairX {
  const int16_t* xp;    // [M, K]: each pair's 64 values in the weights' order, the odd run as is
  const float* xs;      // [M, slots, 8]: the runs' scales, {xs_2p x4, xs_2p+1 x4} (x8 alone)
  const int32_t* corr;  // [M, slots, 8]: 8 x each run's int16 sum in lanes 0 and 4; or nullptr
  const float* xsum;    // [M, groups]: float sums of x a group, for stored mins; or nullptr
  int64_t slots;
};

// xq [M, K] int16 in natural order (quantize_runs_int16) -> PairX's arrays.
inline void lay_out_pairs(const int16_t* xq, const float* xs, int64_t M, int64_t K,
                          bool sym, int16_t* xp, float* xs8, int32_t* corr) {
  const int64_t runs = K / kRun, pairs = runs / 2, slots = (runs + 1) / 2;
  for (int64_t m = 0; m < M; ++m) {
    const int16_t* x = xq + m * K;
    int16_t* o = xp + m * K;
    float* s = xs8 + m * slots * 8;
    int32_t* c = sym ? corr + m * slots * 8 : nullptr;
    for (int64_t r = 0; r < runs; ++r) {
      const int16_t* v = x + r * kRun;
      const int64_t p = r / 2, lane = r % 2;
      if (p < pairs) {
        int16_t* t = o + p * 64 + 8 * lane;
        for (int64_t j = 0; j < 8; ++j) {
          t[j] = v[2 * j];
          t[16 + j] = v[16 + 2 * j];
          t[32 + j] = v[2 * j + 1];
          t[48 + j] = v[17 + 2 * j];
        }
        for (int64_t j = 0; j < 4; ++j) s[p * 8 + 4 * lane + j] = xs[m * runs + r];
      } else {  // the odd run: natural order, its scale in all 8 lanes
        std::copy(v, v + kRun, o + p * 64);
        for (int64_t j = 0; j < 8; ++j) s[p * 8 + j] = xs[m * runs + r];
      }
      if (c) {
        int32_t sum = 0;
        for (int64_t j = 0; j < kRun; ++j) sum += v[j];
        if (lane == 0) std::fill(c + p * 8, c + p * 8 + 8, 0);
        c[p * 8 + 4 * lane] = 8 * sum;
      }
    }
  }
}

// Weight scales of pair p (runs 2p, 2p+1) as {s_2p x4, s_2p+1 x4}; pg runs a group.
inline __m256 pair_scales(const at::Half* sc, int64_t p, int64_t pg) {
  return _mm256_set_m128(_mm_set1_ps(half_to_float(sc[(2 * p + 1) / pg])),
                         _mm_set1_ps(half_to_float(sc[2 * p / pg])));
}

// Slot `at` of an input row's integer dot products d: the zero point off, scaled by the
// input runs' and weight groups' scales into acc.
template <bool kSym>
inline __m256 accumulate(__m256i d, const PairX& x, int64_t at, __m256 sw, __m256 acc) {
  if constexpr (kSym)
    d = _mm256_sub_epi32(d, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.corr + at)));
  return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_loadu_ps(x.xs + at)), sw, acc);
}

// Pair p of one weight row (its 32 bytes in b) against MR input rows.
template <int64_t MR, bool kSym>
inline void pair_dots(__m256i b, const PairX& x, int64_t K, int64_t p, __m256 sw, __m256* acc) {
  const __m256i m4 = _mm256_set1_epi16(15);
  const __m256i v0 = _mm256_and_si256(b, m4);
  const __m256i v1 = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
  const __m256i v2 = _mm256_and_si256(_mm256_srli_epi16(b, 8), m4);
  const __m256i v3 = _mm256_srli_epi16(b, 12);
  for (int64_t m = 0; m < MR; ++m) {
    const auto* xr = reinterpret_cast<const __m256i*>(x.xp + m * K + p * 64);
    const __m256i d = _mm256_add_epi32(
        _mm256_add_epi32(_mm256_madd_epi16(v0, _mm256_loadu_si256(xr)),
                         _mm256_madd_epi16(v1, _mm256_loadu_si256(xr + 1))),
        _mm256_add_epi32(_mm256_madd_epi16(v2, _mm256_loadu_si256(xr + 2)),
                         _mm256_madd_epi16(v3, _mm256_loadu_si256(xr + 3))));
    acc[m] = accumulate<kSym>(d, x, (m * x.slots + p) * 8, sw, acc[m]);
  }
}

// One weight row n against MR input rows -> out[MR] (float32 sums).
template <int64_t MR, bool kSym>
inline void rows_int4_pairs(const QWeight& w, int64_t n, const PairX& x, float* out) {
  const int64_t K = w.K, runs = K / kRun, pairs = runs / 2, pg = w.group / kRun;
  const at::Half* sc = w.scales + n * w.groups;
  const uint8_t* q = w.q + n * (K / 2);
  // With one or two input rows, one FMA chain a row would wait on its latency every pair:
  // two accumulators a row then. More rows are chains enough, and AVX2's 16 registers
  // would spill a second set.
  constexpr int64_t U = MR <= 2 ? 2 : 1;
  __m256 acc[U][MR];
  for (int64_t u = 0; u < U; ++u)
    for (int64_t m = 0; m < MR; ++m) acc[u][m] = _mm256_setzero_ps();
  auto bytes = [&](int64_t p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + p * 32));
  };
  int64_t p = 0;
  if (pg == 1) {  // a scale a run (GGUF's groups of 32): eight scales, four pairs, at a time
    const __m256i i0 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i two = _mm256_set1_epi32(2);
    for (; p + 4 <= pairs; p += 4) {
      const __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 2 * p)));
      __m256i idx = i0;
      for (int64_t u = 0; u < 4; ++u, idx = _mm256_add_epi32(idx, two))
        pair_dots<MR, kSym>(bytes(p + u), x, K, p + u, _mm256_permutevar8x32_ps(s8, idx), acc[u % U]);
    }
  }
  for (; p < pairs; ++p) pair_dots<MR, kSym>(bytes(p), x, K, p, pair_scales(sc, p, pg), acc[p % U]);
  if (runs % 2) {  // the odd run, widened as quant_int16.h does, in all 8 lanes
    __m256i v0, v1;
    run_int16<true>(w, n, runs - 1, v0, v1);
    const __m256 sw = _mm256_set1_ps(half_to_float(sc[(runs - 1) / pg]));
    for (int64_t m = 0; m < MR; ++m) {
      const auto* xr = reinterpret_cast<const __m256i*>(x.xp + m * K + pairs * 64);
      const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(v0, _mm256_loadu_si256(xr)),
                                         _mm256_madd_epi16(v1, _mm256_loadu_si256(xr + 1)));
      acc[0][m] = accumulate<kSym>(d, x, (m * x.slots + pairs) * 8, sw, acc[0][m]);
    }
  }
  for (int64_t m = 0; m < MR; ++m) out[m] = aotllm::vsum(U == 2 ? _mm256_add_ps(acc[0][m], acc[U - 1][m]) : acc[0][m]);
  if constexpr (!kSym) {  // stored mins: + sum_g min_g sum(x_g)
    const at::Half* mn = w.mins + n * w.groups;
    for (int64_t m = 0; m < MR; ++m) {
      const float* xg = x.xsum + m * w.groups;
      __m256 e = _mm256_setzero_ps();
      int64_t g = 0;
      for (; g + 8 <= w.groups; g += 8)
        e = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + g))),
                            _mm256_loadu_ps(xg + g), e);
      float extra = aotllm::vsum(e);
      for (; g < w.groups; ++g) extra += half_to_float(mn[g]) * xg[g];
      out[m] += extra;
    }
  }
}

template <bool kSym>
inline void rows_int4_pairs_any(int64_t mr, const QWeight& w, int64_t n, const PairX& x,
                                float* out) {
  switch (mr) {
    case 1: return rows_int4_pairs<1, kSym>(w, n, x, out);
    case 2: return rows_int4_pairs<2, kSym>(w, n, x, out);
    case 3: return rows_int4_pairs<3, kSym>(w, n, x, out);
    case 4: return rows_int4_pairs<4, kSym>(w, n, x, out);
    case 5: return rows_int4_pairs<5, kSym>(w, n, x, out);
    case 6: return rows_int4_pairs<6, kSym>(w, n, x, out);
    case 7: return rows_int4_pairs<7, kSym>(w, n, x, out);
    default: return rows_int4_pairs<8, kSym>(w, n, x, out);
  }
}

// x [M, K] bf16 or fp16 (int16_fits) against int4 weights -> y [M, N] in x's dtype.
template <typename X>
inline void gemm_int4_pairs(const QWeight& w, const X* x, const float* bias, X* y, int64_t M) {
  const int64_t K = w.K, runs = K / kRun, groups = w.groups, per_group = w.group / kRun;
  const int64_t slots = (runs + 1) / 2;
  const bool sym = w.mins == nullptr;
  // Scratch kept between calls (a decode step makes hundreds of these calls).
  thread_local std::vector<int16_t> xq, xp;
  thread_local std::vector<float> xs, rsum, xsum, xs8;
  thread_local std::vector<int32_t> corr;
  xq.resize(M * K);
  xp.resize(M * K);
  xs.resize(M * runs);
  xs8.resize(M * slots * 8);
  corr.resize(sym ? M * slots * 8 : 0);
  rsum.resize(sym ? 0 : M * runs);
  quantize_runs_int16(x, M, K, xq.data(), xs.data(), sym ? nullptr : rsum.data());
  lay_out_pairs(xq.data(), xs.data(), M, K, sym, xp.data(), xs8.data(), corr.data());
  if (!sym) {
    xsum.assign(M * groups, 0.f);  // groups hold whole runs
    for (int64_t m = 0; m < M; ++m)
      for (int64_t r = 0; r < runs; ++r) xsum[m * groups + r / per_group] += rsum[m * runs + r];
  }
  // Pointers (in px), not the thread_local vectors: inside the lambda those names would be
  // each worker thread's own vectors.
  const PairX px{xp.data(), xs8.data(), sym ? corr.data() : nullptr, sym ? nullptr : xsum.data(),
                 slots};
  aotllm::parallel_chunks(0, w.N, 16, [&](int64_t begin, int64_t end) {
    float out[kInt16MaxRows];
    for (int64_t n = begin; n < end; ++n) {
      // Eight input rows at most a pass (the accumulators stay in registers); the weight
      // row is in L1 for the next eight.
      for (int64_t m0 = 0; m0 < M; m0 += kInt16Rows) {
        const int64_t at = m0 * slots * 8;
        const PairX part{px.xp + m0 * K, px.xs + at, sym ? px.corr + at : nullptr,
                         sym ? nullptr : px.xsum + m0 * groups, slots};
        const int64_t mr = std::min(kInt16Rows, M - m0);
        if (sym) rows_int4_pairs_any<true>(mr, w, n, part, out + m0);
        else rows_int4_pairs_any<false>(mr, w, n, part, out + m0);
      }
      for (int64_t m = 0; m < M; ++m) y[m * w.N + n] = static_cast<X>(out[m] + (bias ? bias[n] : 0.f));
    }
  });
}

#endif

}  // namespace aotllm
