// y = x W^T (+ b) with a bf16 W stored at build time in pair panels: the "pairs16" layout of
// bf16 engines on AMX targets (contract/layout.py; runtime/models/panels.py pack_pairs).
//
// Why: on row-major weights oneDNN's AMX GEMM repacks W into its tiles' order in every call,
// so a decode step of SmolLM2 (1-32 rows) read and wrote its weights twice: 30 layers and the
// LM head, 2 threads, 16 rows 20.4 ms against the memory's 10.5. In pair panels each run of
// 32 k of a panel is, byte for byte, the B operand of one `tdpbf16ps`, loaded from the shard
// as stored (amx_tiles.h): 16 rows 11.0 ms, 1 row 10.3 ms (row-major `vdpbf16ps` dot
// products at 1 row, linear.cpp: about the same), 32 rows 13.5 ms (oneDNN 21.2). Input rows
// are padded to whole tiles of 16; the tile unit is far from busy at these sizes.
//
// Where the tile state is refused (amx_ready), and on AVX512-BF16 targets without AMX, the
// weights go through `vdpbf16ps`: a pair of k for a panel's 16 columns is one vector,
// multiplied by a broadcast pair of x, up to 8 rows and 2 panels a pass, or 4 rows and 4
// panels (dpbf16_rows).
// Other targets and dtypes (never built so, but tests run anywhere) take plain loops over
// the same order.
//
// x [..., K], w [N, K] in pair panels (N % 16 == 0, K % 32 == 0, x's dtype), b [N] or none
// -> [..., N] in x's dtype, or float32 with `float_out` (the LM head's logits); float32 sums.
#include "aoti_shim.h"
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx_tiles.h"
#include "pair_kernel.h"
#include "parallel.h"
#include "store_panel.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kCols = aotllm::kPairCols;

// Element (n, k) of W in pair panels.
inline int64_t pair_index(int64_t K, int64_t n, int64_t k) {
  return (n / kCols) * kCols * K + (k / 2) * 2 * kCols + (n % kCols) * 2 + k % 2;
}

template <typename T, typename Y>
void pairs_generic(const T* x, const T* w, const float* bias, Y* y, int64_t M, int64_t N,
                   int64_t K) {
  at::parallel_for(0, N, kCols, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k)
          acc += static_cast<float>(x[m * K + k]) * static_cast<float>(w[pair_index(K, n, k)]);
        y[m * N + n] = static_cast<Y>(acc + (bias ? bias[n] : 0.f));
      }
  });
}

#if defined(__AVX512BF16__)
using aotllm::dpbf16_any;
using aotllm::dpbf16_pass_rows;

template <typename Y>
void pairs_dpbf16(const at::BFloat16* x, const at::BFloat16* w, const float* bias, Y* y,
                  int64_t M, int64_t N, int64_t K) {
  const auto* xp = reinterpret_cast<const int32_t*>(x);
  const int64_t rows = dpbf16_pass_rows(M);
  // Up to 4 rows (a decode step of 1-4 sequences) take 4 panels a pass, more rows 2: four
  // chains and four streams of loads in flight, as panel_linear.cpp's panel_group, for
  // the same bits (each row and panel is one chain either way). Measured (SmolLM2's 30
  // layers of linears and its LM head from memory, 2 threads, AVX512-BF16 forced on an
  // Intel Xeon with AMX, two rounds, ms): 4 rows 18.7 -> 14.5-14.6, 2 rows 15.4-15.6 ->
  // 13.9-14.3; 1 row within the host's noise (12.5-13.7 -> 10.3-13.3).
  const int64_t group = rows <= 4 ? 4 : 2;
  // Chunks of whole groups: a pass takes a group of panels where one is left.
  aotllm::parallel_chunks(0, N / kCols, group, [&](int64_t begin, int64_t end) {
    alignas(64) float c[16 * kCols];  // [np][mr][16], np * mr <= 16
    for (int64_t p = begin, np = 0; p < end; p += np) {
      np = p + group <= end ? group : std::min<int64_t>(2, end - p);
      const char* pw = reinterpret_cast<const char*>(w + p * kCols * K);
      for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int64_t mr = std::min<int64_t>(rows, M - m0);
        const int32_t* xm = xp + m0 * K / 2;
        const bool last_of_several = m0 > 0 && m0 + mr == M;
        const char* next = last_of_several && p + np < end ? pw + np * kCols * K * 2 : nullptr;
        if (np == 4) dpbf16_any<4>(mr, xm, K, pw, c, next);
        else if (np == 2) dpbf16_any<2>(mr, xm, K, pw, c, next);
        else dpbf16_any<1>(mr, xm, K, pw, c, next);
        for (int64_t q = 0; q < np; ++q) {
          const int64_t n0 = (p + q) * kCols;
          aotllm::store_panel(c + q * mr * kCols, mr, bias ? bias + n0 : nullptr,
                              y + m0 * N + n0, N);
        }
      }
    }
  });
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
template <typename Y>
void pairs_amx(const at::BFloat16* x, const at::BFloat16* w, const float* bias, Y* y, int64_t M,
               int64_t N, int64_t K) {
  using namespace aotllm;  // NOLINT: the tiles (amx_tiles.h)
  std::vector<at::BFloat16> xpad;
  const at::BFloat16* xb = pad_rows(x, M, K, xpad);
  const int64_t Mp = (M + kTileRows - 1) / kTileRows * kTileRows;
  // One block of rows takes kAmxPanels panels a pass (amx_panels), in chunks of whole groups.
  const bool grouped = Mp == kTileRows;
  // Tiles configured and released per chunk: a few hundred cycles against a chunk's panels.
  const int64_t grain = grouped ? kAmxPanels : 1;
  aotllm::parallel_chunks(0, N / kCols, grain, [&](int64_t begin, int64_t end) {
    amx_config();
    alignas(64) float c[4 * kTileRows * kCols];
    int64_t p = begin;
    for (; grouped && p + kAmxPanels <= end; p += kAmxPanels) {
      amx_panels(K, xb, reinterpret_cast<const uint16_t*>(w + p * kCols * K), kCols * K, c);
      for (int64_t q = 0; q < kAmxPanels; ++q) {
        const int64_t n0 = (p + q) * kCols;
        aotllm::store_panel(c + q * kTileRows * kCols, M, bias ? bias + n0 : nullptr, y + n0, N);
      }
    }
    for (; p < end; ++p) {
      const auto* panel = reinterpret_cast<const uint16_t*>(w + p * kCols * K);
      for (int64_t m0 = 0; m0 < Mp; m0 += 4 * kTileRows) {
        amx_rows(Mp - m0, K, xb + m0 * K, panel, c, m0 == 0);  // later blocks: panel in cache
        aotllm::store_panel(c, std::min(M, m0 + 4 * kTileRows) - m0,
                            bias ? bias + p * kCols : nullptr, y + m0 * N + p * kCols, N);
      }
    }
    _tile_release();
  });
}
#endif

// The bf16 kernels of this target into y (bf16 or float32); false where there are none.
template <typename Y>
bool pairs_bf16(const at::BFloat16* x, const at::BFloat16* w, const float* bias, Y* y, int64_t M,
                int64_t N, int64_t K) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  if (aotllm::amx_ready()) {
    pairs_amx(x, w, bias, y, M, N, K);
    return true;
  }
#endif
#if defined(__AVX512BF16__)
  pairs_dpbf16(x, w, bias, y, M, N, K);
  return true;
#else
  return false;
#endif
}

at::Tensor linear_pairs(const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& b, bool float_out) {
  const int64_t K = x.size(-1), N = w.size(0);
  TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.is_contiguous() && N % kCols == 0 && K % 32 == 0,
              "linear_pairs: w must be a contiguous [N, ", K, "] weight in pair panels "
              "(N % 16 == 0, K % 32 == 0)");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "linear_pairs: x and w dtypes differ");
  const int64_t M = x.numel() / std::max<int64_t>(K, 1);
  const at::Tensor xc = x.reshape({M, K}).contiguous();
  const at::Tensor bf = b.has_value() ? b->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  float_out = float_out && x.scalar_type() != at::kFloat;
  at::Tensor y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  if (x.scalar_type() == at::kBFloat16) {
    const auto* xd = xc.data_ptr<at::BFloat16>();
    const auto* wd = w.data_ptr<at::BFloat16>();
    if (float_out ? pairs_bf16(xd, wd, bp, y.data_ptr<float>(), M, N, K)
                  : pairs_bf16(xd, wd, bp, y.data_ptr<at::BFloat16>(), M, N, K))
      return y.view(shape);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "linear_pairs", [&] {
    if (float_out)
      pairs_generic(xc.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), bp, y.data_ptr<float>(), M,
                    N, K);
    else
      pairs_generic(xc.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), bp, y.data_ptr<scalar_t>(),
                    M, N, K);
  });
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aotllm, m) {
  m.def("linear_pairs(Tensor x, Tensor w, Tensor? b, bool float_out=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(aotllm, CPU, m) { m.impl("linear_pairs", &linear_pairs); }

AOTI_ENTRY_POINT aoti_torch_cpu_linear_pairs(AtenTensorHandle x, AtenTensorHandle w,
                                        AtenTensorHandle* b, int32_t float_out,
                                        AtenTensorHandle* ret0) {
  using namespace aotllm::shim;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(
      { out(linear_pairs(in(x), in(w), opt(b), float_out != 0), ret0); });
}
