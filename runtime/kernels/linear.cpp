// y = x W^T (+ b) for the few rows a decode step has: weight-streaming GEMV.
//
// At decode a linear layer is bound by reading its weights once; a GEMM library tuned for
// large M reads them at well under the memory bandwidth here. Each thread streams a band
// of W's rows and computes every input row's dot product with each weight row while it is
// in cache, in float32 (bf16 pairs through AVX512-BF16's dot-product instruction where the
// target has it). Larger M goes to at::linear (oneDNN, AMX where present), except on
// targets without a native bf16 dot product (AVX2, AVX-512F), where oneDNN's bf16 path is
// slow (measured 4x slower than float32 at 16 rows on an AVX2 host) and the band-tiled
// kernel of tile_gemm.h takes them instead (3.5-4.5x faster than oneDNN there).
//
// x [M, K], w [N, K] (row-major, contiguous), b [N] or none -> [M, N] in x's dtype, or in
// float32 with `float_out` (the LM head: logits leave the engine in float32, as TensorRT-LLM's
// `logits_dtype`; a bf16 rounding of the logits ties tokens a bf16 step apart, 1/8 at |logit|
// 16, and flipped SmolLM2's first answer token on the demo question). float_out rows beyond
// kMaxRows take the same kernels in passes of kMaxRows rows: at::linear has no bf16 -> float32
// GEMM on CPU.
#include "aoti_shim.h"
#include "parallel.h"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tile_gemm.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 4;  // M above this: at::linear or the tiled kernel (measured:
                                 // oneDNN wins from 8 rows; on AVX2 the row-wise loop below
                                 // streams weights faster than the tiled kernel up to 2-4)

template <typename scalar_t, typename Y>
void gemv_generic(const scalar_t* x, const scalar_t* w, const scalar_t* b, Y* y,
                  int64_t M, int64_t N, int64_t K) {
  aotllm::parallel_chunks(0, N, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(M * K);
    for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(x[i]);
    for (int64_t n = begin; n < end; ++n) {
      const scalar_t* wr = w + n * K;
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = &xf[m * K];
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < K; ++k) acc += xr[k] * static_cast<float>(wr[k]);
        if (b != nullptr) acc += static_cast<float>(b[n]);
        y[m * N + n] = static_cast<Y>(acc);
      }
    }
  });
}

#if defined(__AVX512BF16__)
// bf16 x bf16 -> fp32 with vdpbf16ps: 32 products per instruction; K % 32 tails masked.
// Any M: the rows in passes of kMaxRows, each weight row reused from L1 by every pass.
template <typename Y>
void gemv_bf16(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* b, Y* y,
               int64_t M, int64_t N, int64_t K) {
  aotllm::parallel_chunks(0, N, 64, [&](int64_t begin, int64_t end) {
    const int64_t full = K / 32 * 32;
    const __mmask32 tail = static_cast<__mmask32>((1ull << (K - full)) - 1);
    for (int64_t n = begin; n < end; ++n) {
      const auto* wr = reinterpret_cast<const uint16_t*>(w + n * K);
      const float bias = b != nullptr ? static_cast<float>(b[n]) : 0.f;
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t mr = std::min(kMaxRows, M - m0);
        const auto* xm = reinterpret_cast<const uint16_t*>(x + m0 * K);
        __m512 acc[kMaxRows];
        for (int64_t m = 0; m < mr; ++m) acc[m] = _mm512_setzero_ps();
        for (int64_t k = 0; k < full; k += 32) {
          const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k);
          for (int64_t m = 0; m < mr; ++m) {
            acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(xm + m * K + k), wv);
          }
        }
        if (full < K) {
          const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + full);
          for (int64_t m = 0; m < mr; ++m) {
            acc[m] = _mm512_dpbf16_ps(
                acc[m], (__m512bh)_mm512_maskz_loadu_epi16(tail, xm + m * K + full), wv);
          }
        }
        for (int64_t m = 0; m < mr; ++m) {
          y[(m0 + m) * N + n] = static_cast<Y>(_mm512_reduce_add_ps(acc[m]) + bias);
        }
      }
    }
  });
}
#endif

#if !defined(__AVX512BF16__)
// bf16 x bf16 for M > kMaxRows: x and W's bands widened to float32, float32 accumulation.
at::Tensor linear_bf16_tiled(const at::Tensor& x, const at::Tensor& w,
                             const std::optional<at::Tensor>& b, int64_t M, int64_t N,
                             int64_t K, bool float_out) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // [M, K]
  const at::Tensor bf = b.has_value() ? b->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  aotllm::tile_gemm(
      xf.data_ptr<float>(), M, K, N,
      [&](int64_t n, float* out) { aotllm::bf16_to_f32(wp + n * K, out, K); },
      bp, y.data_ptr<float>());
  return float_out ? y : y.to(at::kBFloat16);
}
#endif

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                  bool float_out) {
  float_out = float_out && x.scalar_type() != at::kFloat;  // float32 rows are float32 already
  const int64_t K = x.size(-1), N = w.size(0);
  const int64_t M = x.numel() / std::max<int64_t>(K, 1);
#if !defined(__AVX512BF16__)
  if (M > kMaxRows && x.dim() == 2 && x.scalar_type() == at::kBFloat16 &&
      w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.dim() == 2 && w.size(1) == K) {
    return linear_bf16_tiled(x, w, b, M, N, K, float_out);
  }
#endif
  const bool ours = x.dim() == 2 && w.is_contiguous() && w.scalar_type() == x.scalar_type() &&
                    (!b.has_value() || b->scalar_type() == x.scalar_type()) &&
                    (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat);
  if (!ours || (M > kMaxRows && !float_out)) {
    if (!float_out) return at::linear(x, w, b);
    // Shapes no engine makes (float16, a batched x): float32 arithmetic throughout.
    const auto bf = b.has_value() ? std::optional<at::Tensor>(b->to(at::kFloat)) : std::nullopt;
    return at::linear(x.to(at::kFloat), w.to(at::kFloat), bf);
  }
  auto xc = x.contiguous();
  auto out = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  const at::Tensor bc = b.has_value() ? b->contiguous() : at::Tensor();
  const void* bp = bc.defined() ? bc.data_ptr() : nullptr;
  if (x.scalar_type() == at::kBFloat16) {
    const auto* xd = xc.data_ptr<at::BFloat16>();
    const auto* wd = w.data_ptr<at::BFloat16>();
    const auto* bd = static_cast<const at::BFloat16*>(bp);
#if defined(__AVX512BF16__)
    if (float_out) gemv_bf16(xd, wd, bd, out.data_ptr<float>(), M, N, K);
    else gemv_bf16(xd, wd, bd, out.data_ptr<at::BFloat16>(), M, N, K);
#else
    if (float_out) gemv_generic(xd, wd, bd, out.data_ptr<float>(), M, N, K);
    else gemv_generic(xd, wd, bd, out.data_ptr<at::BFloat16>(), M, N, K);
#endif
  } else {
    gemv_generic(xc.data_ptr<float>(), w.data_ptr<float>(), static_cast<const float*>(bp),
                 out.data_ptr<float>(), M, N, K);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aotllm, m) { m.def("linear(Tensor x, Tensor w, Tensor? b, bool float_out=False) -> Tensor"); }

TORCH_LIBRARY_IMPL(aotllm, CPU, m) { m.impl("linear", &linear); }

AOTI_ENTRY_POINT aoti_torch_cpu_linear(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* b,
                                  int32_t float_out, AtenTensorHandle* ret0) {
  using namespace aotllm::shim;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(
      { out(linear(in(x), in(w), opt(b), float_out != 0), ret0); });
}
