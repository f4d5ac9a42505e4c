// y = x W^T for any number of rows, on CPUs without a native bf16 / int8 dot product
// (AVX2, AVX-512F): W's rows are converted to float32 a band at a time into a small buffer
// that stays in L1, and every input row is multiplied against the band while it is there,
// so each weight is read from memory once per call and converted once per call, whatever M
// is. The inner block is 4 input rows x 3 weight rows: 12 vector accumulators plus 4
// loads, all in registers on AVX2's 16.
//
// Why not at::linear: on an AVX2 host oneDNN has no bf16 kernel and falls back to a path
// measured 4x slower than float32 at 16 rows (1536 x 576, 2 threads: 1.48 ms against 0.39);
// quantized weights would otherwise be dequantized to a whole bf16 matrix first.
//
// x [M, K] float32 (row-major), y [M, N] float32; `row(n, out)` writes W[n, :K] as float32.
#pragma once

#include <ATen/Parallel.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

namespace aotllm {

#if defined(__AVX512F__)
using vfloat = __m512;
constexpr int64_t kLanes = 16;
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vfloat v) { return _mm512_reduce_add_ps(v); }
inline vfloat vbcast(const float* p) { return _mm512_set1_ps(*p); }
inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__)
using vfloat = __m256;
constexpr int64_t kLanes = 8;
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vbcast(const float* p) { return _mm256_broadcast_ss(p); }
inline void vstore(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
inline float vsum(vfloat v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
#define AOTLLM_SCALAR_TILE 1
#endif

// Dot products of up to kMB rows of x with up to kNB rows of w (all float32, length K):
// out[m * ldo + n] = sum_k x[m][k] * w[n][k].
constexpr int64_t kMB = 4, kNB = 3;

template <int64_t MB, int64_t NB>
inline void micro(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* out,
                  int64_t ldo) {
  int64_t k = 0;
#ifndef AOTLLM_SCALAR_TILE
  vfloat acc[MB][NB];
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t n = 0; n < NB; ++n) acc[m][n] = vzero();
  for (; k + kLanes <= K; k += kLanes) {
    vfloat wv[NB];
    for (int64_t n = 0; n < NB; ++n) wv[n] = vload(w + n * ldw + k);
    for (int64_t m = 0; m < MB; ++m) {
      const vfloat xv = vload(x + m * ldx + k);
      for (int64_t n = 0; n < NB; ++n) acc[m][n] = vfma(xv, wv[n], acc[m][n]);
    }
  }
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t n = 0; n < NB; ++n) out[m * ldo + n] = vsum(acc[m][n]);
#else
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t n = 0; n < NB; ++n) out[m * ldo + n] = 0.f;
#endif
  for (int64_t m = 0; m < MB; ++m) {  // the tail K % lanes (everything without vectors)
    for (int64_t n = 0; n < NB; ++n) {
      float s = 0.f;
      for (int64_t kk = k; kk < K; ++kk) s += x[m * ldx + kk] * w[n * ldw + kk];
      out[m * ldo + n] += s;
    }
  }
}

// One (rows of x) x (rows of W) block, dispatched to a fixed-size micro kernel.
template <int64_t MB>
inline void micro_n(int64_t nb, const float* x, int64_t ldx, const float* w, int64_t K, float* out,
                    int64_t ldo) {
  if (nb == 3) micro<MB, 3>(x, ldx, w, K, K, out, ldo);
  else if (nb == 2) micro<MB, 2>(x, ldx, w, K, K, out, ldo);
  else micro<MB, 1>(x, ldx, w, K, K, out, ldo);
}

inline void micro_mn(int64_t mb, int64_t nb, const float* x, int64_t ldx, const float* w, int64_t K,
                     float* out, int64_t ldo) {
  switch (mb) {
    case 4: micro_n<4>(nb, x, ldx, w, K, out, ldo); break;
    case 3: micro_n<3>(nb, x, ldx, w, K, out, ldo); break;
    case 2: micro_n<2>(nb, x, ldx, w, K, out, ldo); break;
    default: micro_n<1>(nb, x, ldx, w, K, out, ldo); break;
  }
}

// Weight rows per band: a multiple of kNB whose float32 copy fits in 32 KiB (L1).
inline int64_t band_rows(int64_t K) {
  return std::max<int64_t>(kNB, (8192 / std::max<int64_t>(K, 1)) / kNB * kNB);
}

#ifndef AOTLLM_SCALAR_TILE
// Many rows: outer products instead of dot products (no horizontal sums). A band of kCols
// weight rows is packed K-major (packed[k * kCols + j] = W[n0 + j, k]); each step of k
// broadcasts one x value per row and multiplies it into two weight vectors. 6 rows x 2
// vectors = 12 accumulators, + 2 weight vectors + 1 broadcast: AVX2's 16 registers.
constexpr int64_t kCols = 2 * kLanes, kOuterRows = 6;
// Below this many rows the band packing (a transpose) costs more than the outer form saves
// (1536x576, 2 threads, AVX2: 16 rows 0.52 ms dot vs 0.67 outer; 256 rows 7.4 vs 4.2).
constexpr int64_t kOuterMinRows = 48;

template <int64_t MR>
inline void outer(const float* x, int64_t K, const float* packed, float* out) {
  vfloat c0[MR], c1[MR];
  for (int64_t m = 0; m < MR; ++m) c0[m] = vzero(), c1[m] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const vfloat w0 = vload(packed + k * kCols), w1 = vload(packed + k * kCols + kLanes);
    for (int64_t m = 0; m < MR; ++m) {
      const vfloat xb = vbcast(x + m * K + k);
      c0[m] = vfma(xb, w0, c0[m]);
      c1[m] = vfma(xb, w1, c1[m]);
    }
  }
  for (int64_t m = 0; m < MR; ++m) {
    vstore(out + m * kCols, c0[m]);
    vstore(out + m * kCols + kLanes, c1[m]);
  }
}

inline void outer_m(int64_t mr, const float* x, int64_t K, const float* packed, float* out) {
  switch (mr) {
    case 6: outer<6>(x, K, packed, out); break;
    case 5: outer<5>(x, K, packed, out); break;
    case 4: outer<4>(x, K, packed, out); break;
    case 3: outer<3>(x, K, packed, out); break;
    case 2: outer<2>(x, K, packed, out); break;
    default: outer<1>(x, K, packed, out); break;
  }
}

template <typename RowFn>
void outer_gemm(const float* x, int64_t M, int64_t K, int64_t N, const RowFn& row,
                const float* bias, float* y) {
  const int64_t bands = (N + kCols - 1) / kCols;
  at::parallel_for(0, bands, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> rows(kCols * K), packed(K * kCols);
    float blk[kOuterRows * kCols];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kCols, nn = std::min(kCols, N - n0);
      for (int64_t j = 0; j < nn; ++j) row(n0 + j, rows.data() + j * K);
      std::fill(rows.begin() + nn * K, rows.end(), 0.f);  // a short last band: zero rows
      for (int64_t j = 0; j < kCols; ++j)
        for (int64_t k = 0; k < K; ++k) packed[k * kCols + j] = rows[j * K + k];
      for (int64_t m = 0; m < M; m += kOuterRows) {
        const int64_t mr = std::min(kOuterRows, M - m);
        outer_m(mr, x + m * K, K, packed.data(), blk);
        for (int64_t r = 0; r < mr; ++r)
          for (int64_t j = 0; j < nn; ++j)
            y[(m + r) * N + n0 + j] = blk[r * kCols + j] + (bias ? bias[n0 + j] : 0.f);
      }
    }
  });
}
#endif

// y[M, N] = x[M, K] W^T (+ bias[N]), float32; W read through `row`.
template <typename RowFn>
void tile_gemm(const float* x, int64_t M, int64_t K, int64_t N, const RowFn& row,
               const float* bias, float* y) {
#ifndef AOTLLM_SCALAR_TILE
  if (M >= kOuterMinRows) {
    outer_gemm(x, M, K, N, row, bias, y);
    return;
  }
#endif
  const int64_t band = band_rows(K);
  const int64_t bands = (N + band - 1) / band;
  at::parallel_for(0, bands, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> tile(band * K);
    float blk[kMB * kNB];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * band, nn = std::min(band, N - n0);
      for (int64_t i = 0; i < nn; ++i) row(n0 + i, tile.data() + i * K);
      for (int64_t m = 0; m < M; m += kMB) {
        const int64_t mb = std::min(kMB, M - m);
        for (int64_t j = 0; j < nn; j += kNB) {
          const int64_t nb = std::min(kNB, nn - j);
          micro_mn(mb, nb, x + m * K, K, tile.data() + j * K, K, blk, kNB);
          for (int64_t r = 0; r < mb; ++r)
            for (int64_t c = 0; c < nb; ++c)
              y[(m + r) * N + n0 + j + c] = blk[r * kNB + c] + (bias ? bias[n0 + j + c] : 0.f);
        }
      }
    }
  });
}

// bf16 bits -> float32 (exact), n values.
inline void bf16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t k = 0;
#if defined(__AVX512F__)
  for (; k + 16 <= n; k += 16) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(src + k)));
    _mm512_storeu_ps(dst + k, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
  }
#elif defined(__AVX2__)
  for (; k + 8 <= n; k += 8) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(src + k)));
    _mm256_storeu_ps(dst + k, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
  }
#endif
  for (; k < n; ++k) {
    const uint32_t u = static_cast<uint32_t>(src[k]) << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    dst[k] = f;
  }
}

// float32 rounded to the nearest bf16 (ties to even) and back, in place: what a cast to
// bf16 and back does, for finite values.
inline void round_through_bf16(float* v, int64_t n) {
#pragma omp simd
  for (int64_t k = 0; k < n; ++k) {
    uint32_t u;
    __builtin_memcpy(&u, &v[k], 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    __builtin_memcpy(&v[k], &u, 4);
  }
}

}  // namespace aotllm
