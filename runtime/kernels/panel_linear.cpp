// y = x W^T (+ b) with W prepacked at build time in panels of 16 output columns, K-major:
// the weight layout an aoti engine chooses on CPU targets without a native bf16 dot
// product (AVX2, AVX-512F; contract/layout.py WEIGHT_LAYOUTS, "panels16").
//
// Why: a decode step multiplies 1-16 rows by every weight. Row-major weights leave two
// choices on these targets: dot products (one horizontal sum per output, and the band's
// widening to float32 buffered per call: tile_gemm.h) or outer products after a transpose
// per call. Stored K-major in panels, the outer-product kernel reads the weights straight
// from memory, widens 16 of them per k in registers and multiplies them into up to 5 rows
// (10 accumulators): no transpose, no buffer, no horizontal sums. Measured (SmolLM2's 30
// layers of linears, bf16, 2 threads, AVX2 Zen 3): 16 rows 44.3 -> 31.0 ms (77 -> 110
// GFLOP/s), 4 rows 23.5 -> 14.8 ms, 64 rows 130 -> 111 ms; 1 row on par (memory bound).
//
// Layout: W [N, K] holds the same numbers as the row-major weight in another order: panel
// p (columns 16p .. 16p+nr, nr = min(16, N - 16p)) is the block at W + 16pK, element
// [k][j] at 16pK + k * nr + j. Shape, dtype and size are those of the row-major weight, so
// sharding, binding and hashing do not change; only this op reads it
// (runtime/models/panels.py pack_panels writes it, at build time).
//
// x [..., K] (bf16, fp16 or float32), w [N, K] in panels (the same dtype), b [N] or none
// -> [..., N] in x's dtype, or float32 with `float_out` (the LM head's logits); float32
// accumulation.
#include "aoti_shim.h"
#include "parallel.h"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "panel_kernel.h"
#include "prefetch.h"
#include "store_panel.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

using namespace aotllm;  // NOLINT: the micro-kernel (panel_kernel.h)

// A panel of nr columns the vector kernel does not take (a short last panel, or any panel
// on a target without AVX2): plain loops over the same layout.
template <typename W, typename Y>
void panel_scalar(const float* x, int64_t M, int64_t K, const W* p, int64_t nr, Y* y,
                  int64_t N, int64_t n0, const float* bias) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < nr; ++j) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * to_float(p[k * nr + j]);
      y[m * N + n0 + j] = static_cast<Y>(acc + (bias ? bias[n0 + j] : 0.f));
    }
  }
}

// y [M, N] in the weights' (and inputs') dtype or float32 (Y), rounded once from the float32
// sums: written here rather than by a cast of a float32 result afterwards (one copy less).
template <typename W, typename Y>
void panel_gemm(const float* x, int64_t M, int64_t K, int64_t N, const W* w, const float* bias,
                Y* y) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  // Rows split evenly into passes of at most kRows (AVX2's 16 rows: 4 x 4, not 5 + 5 + 5 + 1).
  const int64_t passes = (M + kRows - 1) / kRows, rows = (M + passes - 1) / passes;
#if defined(__AVX2__) && defined(__FMA__)
  // The vector kernel reads its rows packed (pack_rows); one row is packed as it is.
  std::vector<float> packed(M > 1 ? M * K : 0);
  if (M > 1) pack_rows(x, M, K, rows, packed.data());
  const float* xp = M > 1 ? packed.data() : x;
  // A few rows take the full panels kGroupPanels at a time (panel_group); chunks start on a
  // group so that every group but the last chunk's tail is whole.
  const bool grouped = M <= kGroupRows;
  const int64_t full = N / kPanel, grain = grouped ? kGroupPanels : 1;
#else
  const int64_t grain = 1;
#endif
  aotllm::parallel_chunks(0, panels, grain, [&](int64_t p0, int64_t p1) {
    int64_t p = p0;
#if defined(__AVX2__) && defined(__FMA__)
    if (grouped) {
      float blk[kGroupPanels * kGroupRows * kPanel];  // [kGroupPanels][M][kPanel]
      for (; p + kGroupPanels <= std::min(p1, full); p += kGroupPanels) {
        panel_group(M, xp, K, w + p * kPanel * K, kPanel * K, blk);
        for (int64_t i = 0; i < kGroupPanels; ++i) {
          const int64_t n0 = (p + i) * kPanel;
          store_panel(blk + i * M * kPanel, M, bias ? bias + n0 : nullptr, y + n0, N);
        }
      }
    }
#endif
    for (; p < p1; ++p) {
      const int64_t n0 = p * kPanel, nr = std::min(kPanel, N - n0);
      const W* panel = w + n0 * K;
#if defined(__AVX2__) && defined(__FMA__)
      if (nr == kPanel) {
        float blk[kRows * kPanel];
        // The next panel is prefetched while this one is computed, 1/passes of it in each
        // pass: the passes after the first read this panel from L1, and the hardware
        // prefetcher, seeing no misses, did not run ahead. Measured on 30 layers of
        // SmolLM2 linears and its LM head from memory (AVX2 forced, 2 threads, Intel Xeon
        // with AMX): 16 rows 33 -> 26-28 ms (head 7.3 -> 5.3), 8 rows 25 -> 16-18, 1 row
        // 14 -> 10.4-12 (the floor at the measured 22 GB/s: 10).
        const int64_t bytes = kPanel * K * static_cast<int64_t>(sizeof(W));
        for (int64_t m = 0, pass = 0; m < M; m += rows, ++pass) {
          const int64_t mr = std::min(rows, M - m);
          const PanelShare next = next_panel_share(panel, bytes, p + 1 == panels, pass, passes);
          panel_block(mr, xp + m * K, K, panel, blk, false, next.at, next.bytes / K);
          store_panel(blk, mr, bias ? bias + n0 : nullptr, y + m * N + n0, N);
        }
        continue;
      }
#endif
      panel_scalar(x, M, K, panel, nr, y, N, n0, bias);
    }
  });
}

template <typename W>
void panel_gemm_to(const float* x, int64_t M, int64_t K, int64_t N, const W* w,
                   const float* bias, at::Tensor& y) {
  if (y.scalar_type() == at::kFloat) panel_gemm(x, M, K, N, w, bias, y.data_ptr<float>());
  else panel_gemm(x, M, K, N, w, bias, y.data_ptr<W>());
}

at::Tensor linear_panel(const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& b, bool float_out) {
  const int64_t K = x.size(-1), N = w.size(0);
  TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.is_contiguous(),
              "linear_panel: w must be a contiguous [N, ", K, "] panel-packed weight");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "linear_panel: x and w dtypes differ");
  const int64_t M = x.numel() / std::max<int64_t>(K, 1);
  const at::Tensor xf = x.reshape({M, K}).to(at::kFloat).contiguous();
  const at::Tensor bf = b.has_value() ? b->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  switch (w.scalar_type()) {
    case at::kBFloat16:
      panel_gemm_to(xf.data_ptr<float>(), M, K, N, w.data_ptr<at::BFloat16>(), bp, y);
      break;
    case at::kHalf:
      panel_gemm_to(xf.data_ptr<float>(), M, K, N, w.data_ptr<at::Half>(), bp, y);
      break;
    case at::kFloat:
      panel_gemm(xf.data_ptr<float>(), M, K, N, w.data_ptr<float>(), bp, y.data_ptr<float>());
      break;
    default:
      TORCH_CHECK(false, "linear_panel: unsupported dtype ", w.scalar_type());
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aotllm, m) {
  m.def("linear_panel(Tensor x, Tensor w, Tensor? b, bool float_out=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(aotllm, CPU, m) { m.impl("linear_panel", &linear_panel); }

AOTI_ENTRY_POINT aoti_torch_cpu_linear_panel(AtenTensorHandle x, AtenTensorHandle w,
                                        AtenTensorHandle* b, int32_t float_out,
                                        AtenTensorHandle* ret0) {
  using namespace aotllm::shim;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(
      { out(linear_panel(in(x), in(w), opt(b), float_out != 0), ret0); });
}
