// Pair panels (qpanel_linear.cpp's layout) through AMX on targets that have it: batches of bf16
// rows (decode batches, prompt chunks) against quantized weights.
//
// A run of a panel (16 pairs of k x 16 columns) is, value for value, the B operand of one AMX
// `tdpbf16ps` (16 rows of 16 columns x 2 bf16: a pair of k for each column): the panel is
// dequantized run by run into that tile's bytes (q x s (+ min), rounded once to bf16 as the
// reference rounds W) and multiplied into up to 4 tiles of 16 input rows at once, float32
// sums in the C tiles. Each weight is dequantized once per call, and the multiply runs at
// the tile unit's rate instead of 32 products an instruction; no W^T [K, N] written to memory
// and read back by oneDNN (qpanel_vnni.h dequant_qpanels_kn), no repacking per call.
//
// The tiles' set-up and multiply are amx_tiles.h's. The kernel asks Linux for the tile state
// once (amx_ready); where that is refused the caller takes the VNNI passes.
#pragma once

#include "parallel.h"
#include "amx_tiles.h"
#include "qpanel_dequant.h"
#include "store_panel.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
namespace aotllm {

// x [M, K] bf16 -> y [M, N] bf16 or float32 (Y); amx_ready() and w's layout as qpanels_fit.
template <typename Y>
void gemm_qpanels_amx(const QWeight& w, const at::BFloat16* x, const float* bias, Y* y,
                      int64_t M) {
  const int64_t K = w.K, runs = K / kRun, Mp = (M + 15) / 16 * 16;
  thread_local std::vector<at::BFloat16> xpad;
  const at::BFloat16* xb = pad_rows(x, M, K, xpad);
  aotllm::parallel_chunks(0, w.N / kVCols, 1, [&](int64_t begin, int64_t end) {
    amx_config();
    std::vector<uint16_t> panel(runs * 512 + 32);
    uint16_t* pb = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(panel.data()) + 63) & ~uintptr_t(63));
    alignas(64) float c[64 * kVCols];
    for (int64_t p = begin; p < end; ++p) {
      GroupCounter gc(w);
      for (int64_t r = 0; r < runs; ++r, gc.next()) dequant_run_tile(w, p, r, gc.g, pb + r * 512);
      for (int64_t m0 = 0; m0 < Mp; m0 += 64) {
        amx_rows(Mp - m0, K, xb + m0 * K, pb, c, false);  // the panel is in cache: no prefetch
        store_panel(c, std::min(M, m0 + 64) - m0, bias ? bias + p * kVCols : nullptr,
                    y + m0 * w.N + p * kVCols, w.N);
      }
    }
    _tile_release();
  });
}

}  // namespace aotllm
#endif
