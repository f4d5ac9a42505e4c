// y = x W^T (+ b) with W held quantized (contract/quant.py, layout 1):
//
//   int8  W[n, k] = scale[n, g] * q[n, k]              q int8 [N, K]
//   int4  W[n, k] = scale[n, g] * q[n, k] + min[n, g]    q 0..15, [N, K / 2] bytes: each run
//         of 32 values is 16 bytes, byte j = value j | value (j + 16) << 4 (GGUF's Q4 `qs`);
//         no min tensor: symmetric, min = -8 * scale
//   scale, min float16 [N, groups], g = k / group_size (the last group may be shorter)
//
// On AVX-512 targets, few rows (a decode step, M <= kMaxRows): each thread streams a band
// of W's rows once; every run of 32 weights is dequantized in registers (float32, scaled,
// then rounded to bf16 for bf16 inputs, exactly as the reference does) and dotted with
// every input row while it is in registers (AVX512-BF16 vdpbf16ps for bf16, FMAs for
// float32). Many rows (prefill): W is dequantized to the input dtype once and handed to
// at::linear (oneDNN, AMX where present), whose GEMM reuses each weight across the rows.
// Targets without a native bf16 dot product (AVX2, AVX-512F without BF16) take every M
// through tile_gemm.h instead (a band of rows dequantized into an L1 buffer, reused by every
// input row; oneDNN's bf16 GEMM is slow there), except on AVX2: 16-bit inputs of up to 16
// rows take integer dot products against x requantized to int16 per run of 32
// (quant_int16.h: an error 128x below the input's own bf16 rounding), and larger batches
// (float32 inputs: more than 4 rows) panels of 16 weight rows dequantized once per call
// into the outer-product kernel of linear_panel (quant_panel.h).
//
// The reference these match (runtime/quant.py, the eager engines' path): W dequantized in
// float32, cast to the model dtype, then F.linear. With `float_out` (the LM head's logits)
// the result stays in float32: the same sums, not rounded to the model dtype.
#include "aoti_shim.h"
#include "parallel.h"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "quant_int4_pairs.h"
#include "quant_panel.h"
#include "quant_weight.h"
#include "tile_gemm.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using namespace aotllm;  // NOLINT: QWeight and its readers (quant_weight.h), tile_gemm.h

constexpr int64_t kMaxRows = 16;  // M above this: dequantize, then at::linear

// y [M, N] float32 for inputs x [M, K] of any float dtype, through the tiled kernel.
void tiled(const QWeight& w, const at::Tensor& x, const float* bias, float* y, int64_t M) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  aotllm::tile_gemm(
      xf.data_ptr<float>(), M, w.K, w.N,
      [&](int64_t n, float* out) { dequant_row_vec(w, n, bf16, out); }, bias, y);
}

#if defined(__AVX512F__)
// One run of int8 row n at k, scaled by the group's scale vs: dequant_run's values.
inline void run_int8(const QWeight& w, int64_t n, int64_t k, __m512 vs, __m512& lo, __m512& hi) {
  const auto* p = reinterpret_cast<const int8_t*>(w.q) + n * w.K + k;
  lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))), vs);
  hi = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16)))), vs);
}

// One run of 32 weights of row n, starting at k (k % 32 == 0, the run inside one group):
// float32 in lo (values k..k+15) and hi (k+16..k+31).
inline void dequant_run(const QWeight& w, int64_t n, int64_t k, __m512& lo, __m512& hi) {
  const int64_t g = k / w.group;
  const float s = half_to_float(w.scales[n * w.groups + g]);
  const __m512 vs = _mm512_set1_ps(s);
  if (!w.int4) return run_int8(w, n, k, vs, lo, hi);
  const float m = w.mins ? half_to_float(w.mins[n * w.groups + g]) : -8.f * s;
  const __m512 vm = _mm512_set1_ps(m);
  const uint8_t* p = w.q + n * (w.K / 2) + k / 2;
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  const __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi32(15));
  const __m512i high = _mm512_srli_epi32(bytes, 4);
  lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low), vs, vm);
  hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), vs, vm);
}
#endif

// The decode path: float32 inputs x [M, K] (bf16 inputs go through gemv_bf16 instead).
void gemv_f32(const QWeight& w, const float* x, const float* bias, float* y, int64_t M) {
  const int64_t N = w.N, K = w.K;
  aotllm::parallel_chunks(0, N, 16, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    if (K % kRun == 0 && w.group % kRun == 0) {
      for (int64_t n = begin; n < end; ++n) {
        __m512 acc[kMaxRows];
        for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += kRun) {
          __m512 lo, hi;
          dequant_run(w, n, k, lo, hi);
          for (int64_t m = 0; m < M; ++m) {
            const float* xr = x + m * K + k;
            acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), lo, acc[m]);
            acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), hi, acc[m]);
          }
        }
        const float b = bias ? bias[n] : 0.f;
        for (int64_t m = 0; m < M; ++m) y[m * N + n] = _mm512_reduce_add_ps(acc[m]) + b;
      }
      return;
    }
#endif
    std::vector<float> row(K);
    for (int64_t n = begin; n < end; ++n) {
      dequant_row(w, n, false, row.data());
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = x + m * K;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < K; ++k) acc += xr[k] * row[k];
        y[m * N + n] = acc + (bias ? bias[n] : 0.f);
      }
    }
  });
}

// The decode path for bf16 inputs; float32 outputs (rounded by the caller).
void gemv_bf16(const QWeight& w, const at::BFloat16* x, const float* bias, float* y, int64_t M) {
  const int64_t N = w.N, K = w.K;
  aotllm::parallel_chunks(0, N, 16, [&](int64_t begin, int64_t end) {
#if defined(__AVX512BF16__)
    if (K % kRun == 0 && w.group % kRun == 0) {
      if (M == 1 && !w.int4) {
        // One input row of int8 weights: a single chain of dot products per weight row is
        // latency bound; two accumulators (even and odd runs), the group's scale converted
        // once. SmolLM2's 30 layers, 2 threads, Xeon (AVX512-BF16), interleaved: 14.0-16.5 ms
        // -> 9.2-11.3. int4 gains nothing so (its unpacking is throughput bound).
        const auto* xr = reinterpret_cast<const uint16_t*>(x);
        for (int64_t n = begin; n < end; ++n) {
          __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
          for (int64_t g0 = 0; g0 < K; g0 += w.group) {
            const __m512 vs = _mm512_set1_ps(half_to_float(w.scales[n * w.groups + g0 / w.group]));
            const int64_t gend = std::min(K, g0 + w.group);
            int64_t k = g0;
            for (; k + 2 * kRun <= gend; k += 2 * kRun) {
              __m512 l0, h0, l1, h1;
              run_int8(w, n, k, vs, l0, h0);
              run_int8(w, n, k + kRun, vs, l1, h1);
              a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(xr + k),
                                    _mm512_cvtne2ps_pbh(h0, l0));
              a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(xr + k + kRun),
                                    _mm512_cvtne2ps_pbh(h1, l1));
            }
            if (k < gend) {  // an odd run left in the group (kRun divides the group)
              __m512 l0, h0;
              run_int8(w, n, k, vs, l0, h0);
              a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(xr + k),
                                    _mm512_cvtne2ps_pbh(h0, l0));
            }
          }
          y[n] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + (bias ? bias[n] : 0.f);
        }
        return;
      }
      for (int64_t n = begin; n < end; ++n) {
        __m512 acc[kMaxRows];
        for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += kRun) {
          __m512 lo, hi;
          dequant_run(w, n, k, lo, hi);
          const __m512bh wv = _mm512_cvtne2ps_pbh(hi, lo);  // lo: elements 0..15
          for (int64_t m = 0; m < M; ++m) {
            const auto* xr = reinterpret_cast<const uint16_t*>(x + m * K + k);
            acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(xr), wv);
          }
        }
        const float b = bias ? bias[n] : 0.f;
        for (int64_t m = 0; m < M; ++m) y[m * N + n] = _mm512_reduce_add_ps(acc[m]) + b;
      }
      return;
    }
#endif
    std::vector<float> row(K), xf(M * K);
    for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(x[i]);
    for (int64_t n = begin; n < end; ++n) {
      dequant_row(w, n, true, row.data());
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = xf.data() + m * K;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < K; ++k) acc += xr[k] * row[k];
        y[m * N + n] = acc + (bias ? bias[n] : 0.f);
      }
    }
  });
}

// W dequantized into `out` [N, K] of dtype `dt` (float32 or bf16; float16 via float32).
void dequant_into(const QWeight& w, at::Tensor& out) {
  const int64_t N = w.N, K = w.K;
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  float* of = bf16 ? nullptr : out.data_ptr<float>();
  at::BFloat16* ob = bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  aotllm::parallel_chunks(0, N, 16, [&](int64_t begin, int64_t end) {
#if defined(__AVX512BF16__)
    if (K % kRun == 0 && w.group % kRun == 0) {
      for (int64_t n = begin; n < end; ++n) {
        for (int64_t k = 0; k < K; k += kRun) {
          __m512 lo, hi;
          dequant_run(w, n, k, lo, hi);
          if (bf16) {
            _mm512_storeu_si512(reinterpret_cast<uint16_t*>(ob + n * K + k),
                                (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
          } else {
            _mm512_storeu_ps(of + n * K + k, lo);
            _mm512_storeu_ps(of + n * K + k + 16, hi);
          }
        }
      }
      return;
    }
#endif
    std::vector<float> row(K);
    for (int64_t n = begin; n < end; ++n) {
      dequant_row(w, n, false, row.data());
      if (bf16) {
        for (int64_t k = 0; k < K; ++k) ob[n * K + k] = static_cast<at::BFloat16>(row[k]);
      } else {
        std::memcpy(of + n * K, row.data(), K * sizeof(float));
      }
    }
  });
}

QWeight check(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
              const std::optional<at::Tensor>& mins, int64_t group, bool int4) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous(), "qweight must be a contiguous 2-D tensor");
  TORCH_CHECK(q.scalar_type() == (int4 ? at::kByte : at::kChar), "qweight must be ",
              int4 ? "uint8 (packed int4)" : "int8");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2,
              "scales must be a contiguous float16 [N, groups] tensor");
  const int64_t N = q.size(0), K = x.size(-1);
  TORCH_CHECK(q.size(1) == (int4 ? K / 2 : K) && (!int4 || K % kRun == 0),
              "qweight's shape ", q.sizes(), " does not fit inputs of ", K, " features");
  TORCH_CHECK(group > 0 && scales.size(0) == N && scales.size(1) == (K + group - 1) / group,
              "scales ", scales.sizes(), " do not fit groups of ", group, " over ", K, " inputs");
  TORCH_CHECK(!int4 || group % kRun == 0, "int4 groups of ", group,
              " split a packed run of 32 values; groups must be a multiple of 32");
  if (mins.has_value()) {
    TORCH_CHECK(int4, "int8 weights take no mins");
    TORCH_CHECK(mins->sizes() == scales.sizes() && mins->scalar_type() == at::kHalf &&
                    mins->is_contiguous(),
                "mins must be float16 shaped like scales");
  }
  return QWeight{static_cast<const uint8_t*>(q.data_ptr()), scales.data_ptr<at::Half>(),
                 mins.has_value() ? mins->data_ptr<at::Half>() : nullptr,
                 N, K, scales.size(1), group, int4};
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                   const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& b,
                   int64_t group, bool int4, bool float_out) {
  const QWeight w = check(x, q, scales, mins, group, int4);
  const int64_t M = x.numel() / std::max<int64_t>(w.K, 1);
  const auto dt = x.scalar_type();
  const auto out_dt = float_out ? at::kFloat : dt;
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat || dt == at::kHalf,
              "inputs must be bfloat16, float16 or float32");
  auto out_shape = x.sizes().vec();
  out_shape.back() = w.N;
  at::Tensor bias = b.has_value() ? b->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
#if defined(__AVX2__) && !defined(__AVX512F__)
  if (dt != at::kFloat && !float_out && int16_fits(w, M)) {  // 16-bit inputs: integer dots
    // Raw pointers of x and of y made in its final shape: a decode step makes ~150 of these
    // calls, and a reshape and a view each would be two more dispatcher round trips.
    const at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
    at::Tensor y16 = at::empty(out_shape, x.options());
    if (dt == at::kBFloat16 && w.int4)
      gemm_int4_pairs(w, xc.data_ptr<at::BFloat16>(), bp, y16.data_ptr<at::BFloat16>(), M);
    else if (dt == at::kBFloat16)
      gemm_int16(w, xc.data_ptr<at::BFloat16>(), bp, y16.data_ptr<at::BFloat16>(), M);
    else if (w.int4)
      gemm_int4_pairs(w, xc.data_ptr<at::Half>(), bp, y16.data_ptr<at::Half>(), M);
    else
      gemm_int16(w, xc.data_ptr<at::Half>(), bp, y16.data_ptr<at::Half>(), M);
    return y16;
  }
#endif
  auto xc = x.reshape({M, w.K}).contiguous();
  auto y = at::empty({M, w.N}, x.options().dtype(at::kFloat));
#if defined(__AVX2__) && !defined(__AVX512F__)
  if (M > kFewRows && panel_fits(w)) {  // batches: panels dequantized once per call
    const at::Tensor xf = xc.to(at::kFloat).contiguous();
    gemm_quant_panels(w, xf.data_ptr<float>(), M, bp, y.data_ptr<float>());
    return y.to(out_dt).view(out_shape);
  }
  if (M <= kFewRows) {
    const at::Tensor xf = xc.to(at::kFloat).contiguous();
    gemv_avx2(w, xf.data_ptr<float>(), bp, y.data_ptr<float>(), M);
    return y.to(out_dt).view(out_shape);
  }
#endif
#if !defined(__AVX512BF16__)
#if defined(__AVX512F__)
  const bool take_tiled = dt != at::kFloat || M > kMaxRows;  // gemv_f32 has AVX-512 here
#else
  const bool take_tiled = true;
#endif
  if (take_tiled) {
    tiled(w, xc, bp, y.data_ptr<float>(), M);
    return y.to(out_dt).view(out_shape);
  }
#endif
  if (M > kMaxRows) {
    at::Tensor wd = at::empty({w.N, w.K}, x.options().dtype(dt == at::kBFloat16 ? dt : at::kFloat));
    dequant_into(w, wd);
    if (!float_out) return at::linear(x, wd.to(dt), b);
    // float32 logits rows of a prompt: the weights as the model dtype rounds them, float32 sums
    const auto bf = b.has_value() ? std::optional<at::Tensor>(b->to(at::kFloat)) : std::nullopt;
    return at::linear(x.to(at::kFloat), wd.to(dt).to(at::kFloat), bf);
  }
  if (dt == at::kBFloat16) {
    gemv_bf16(w, xc.data_ptr<at::BFloat16>(), bp, y.data_ptr<float>(), M);
  } else {
    auto xf = xc.to(at::kFloat).contiguous();
    gemv_f32(w, xf.data_ptr<float>(), bp, y.data_ptr<float>(), M);
  }
  return y.to(out_dt).view(out_shape);
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                       const std::optional<at::Tensor>& b, int64_t group, bool float_out) {
  return qlinear(x, q, scales, std::nullopt, b, group, false, float_out);
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& b,
                       int64_t group, bool float_out) {
  return qlinear(x, q, scales, mins, b, group, true, float_out);
}

at::Tensor dequantize(const at::Tensor& q, const at::Tensor& scales,
                      const std::optional<at::Tensor>& mins, int64_t k, int64_t group,
                      bool int4, at::ScalarType dt) {
  const QWeight w = check(at::empty({0, k}), q, scales, mins, group, int4);
  at::Tensor out = at::empty({w.N, w.K}, q.options().dtype(dt == at::kBFloat16 ? dt : at::kFloat));
  dequant_into(w, out);
  return out.to(dt);
}

// The whole weight, dequantized as the kernels see it (tests; int4 when `bits` is 4).
at::Tensor dequantize_op(const at::Tensor& q, const at::Tensor& scales,
                         const std::optional<at::Tensor>& mins, int64_t k, int64_t group,
                         int64_t bits, at::ScalarType dtype) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  return dequantize(q, scales, mins, k, group, bits == 4, dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aotllm, m) {
  m.def("linear_int8(Tensor x, Tensor qweight, Tensor scales, Tensor? b, int group_size, "
        "bool float_out=False) -> Tensor");
  m.def("linear_int4(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? b, "
        "int group_size, bool float_out=False) -> Tensor");
  m.def("dequantize(Tensor qweight, Tensor scales, Tensor? mins, int k, int group_size, int bits, "
        "ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(aotllm, CPU, m) {
  m.impl("linear_int8", &linear_int8);
  m.impl("linear_int4", &linear_int4);
  m.impl("dequantize", &dequantize_op);
}

AOTI_ENTRY_POINT aoti_torch_cpu_linear_int8(AtenTensorHandle x, AtenTensorHandle qweight,
                                       AtenTensorHandle scales, AtenTensorHandle* b,
                                       int64_t group_size, int32_t float_out,
                                       AtenTensorHandle* ret0) {
  using namespace aotllm::shim;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    out(linear_int8(in(x), in(qweight), in(scales), opt(b), group_size, float_out != 0), ret0);
  });
}

AOTI_ENTRY_POINT aoti_torch_cpu_linear_int4(AtenTensorHandle x, AtenTensorHandle qweight,
                                       AtenTensorHandle scales, AtenTensorHandle* mins,
                                       AtenTensorHandle* b, int64_t group_size,
                                       int32_t float_out, AtenTensorHandle* ret0) {
  using namespace aotllm::shim;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    out(linear_int4(in(x), in(qweight), in(scales), opt(mins), opt(b), group_size,
                    float_out != 0), ret0);
  });
}
