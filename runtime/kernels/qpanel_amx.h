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
// The tile registers are per thread: every parallel chunk loads its configuration first
// (oneDNN's GEMMs on the same threads load their own). The kernel asks Linux for the tile
// state once (arch_prctl); where that is refused the caller takes the VNNI passes.
#pragma once

#include "qpanel_dequant.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

namespace aotllm {

inline bool amx_ready() {
  // ARCH_REQ_XCOMP_PERM (0x1023), XFEATURE_XTILEDATA (18): the process may use the tiles
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// Tiles 0-3: C (16 rows x 16 float32), 4: B (16 pairs x 16 columns x 2 bf16), 5-6: A (16
// rows x 32 bf16).
inline void amx_config() {
  alignas(64) uint8_t cfg[64];
  std::memset(cfg, 0, sizeof(cfg));
  cfg[0] = 1;  // palette 1
  for (int t = 0; t < 7; ++t) {
    cfg[16 + 2 * t] = 64;  // bytes a row
    cfg[48 + t] = 16;      // rows
  }
  _tile_loadconfig(cfg);
}

// C tiles 0..NB-1 += x's row blocks (16 rows each, stride K) x run r's B tile.
template <int NB>
inline void amx_blocks(const at::BFloat16* xb, int64_t K, int64_t r, const uint16_t* tile) {
  _tile_loadd(4, tile, 64);
  const int64_t stride = K * 2;
  const char* a = reinterpret_cast<const char*>(xb + r * kRun);
  _tile_loadd(5, a, stride);
  _tile_dpbf16ps(0, 5, 4);
  if constexpr (NB > 1) {
    _tile_loadd(6, a + 16 * stride, stride);
    _tile_dpbf16ps(1, 6, 4);
  }
  if constexpr (NB > 2) {
    _tile_loadd(5, a + 32 * stride, stride);
    _tile_dpbf16ps(2, 5, 4);
  }
  if constexpr (NB > 3) {
    _tile_loadd(6, a + 48 * stride, stride);
    _tile_dpbf16ps(3, 6, 4);
  }
}

template <int NB>
inline void amx_group(const QWeight& w, int64_t p, const at::BFloat16* xb, const uint16_t* panel,
                      float* c) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  for (int64_t r = 0; r < w.K / kRun; ++r) amx_blocks<NB>(xb, w.K, r, panel + r * 512);
  _tile_stored(0, c, 64);
  if constexpr (NB > 1) _tile_stored(1, c + 256, 64);
  if constexpr (NB > 2) _tile_stored(2, c + 512, 64);
  if constexpr (NB > 3) _tile_stored(3, c + 768, 64);
}

// x [M, K] bf16 -> y [M, N] bf16; amx_ready() and w's layout as qpanels_fit.
inline void gemm_qpanels_amx(const QWeight& w, const at::BFloat16* x, const float* bias,
                             at::BFloat16* y, int64_t M) {
  const int64_t K = w.K, runs = K / kRun, Mp = (M + 15) / 16 * 16;
  // x with its rows padded to whole tiles (zeros)
  thread_local std::vector<at::BFloat16> xpad;
  const at::BFloat16* xb = x;
  if (Mp != M) {
    xpad.assign(Mp * K, at::BFloat16(0.f));
    std::memcpy(xpad.data(), x, M * K * sizeof(at::BFloat16));
    xb = xpad.data();
  }
  at::parallel_for(0, w.N / kVCols, 1, [&](int64_t begin, int64_t end) {
    amx_config();
    std::vector<uint16_t> panel(runs * 512 + 32);
    uint16_t* pb = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(panel.data()) + 63) & ~uintptr_t(63));
    alignas(64) float c[64 * kVCols];
    for (int64_t p = begin; p < end; ++p) {
      GroupCounter gc(w);
      for (int64_t r = 0; r < runs; ++r, gc.next()) dequant_run_tile(w, p, r, gc.g, pb + r * 512);
      for (int64_t m0 = 0; m0 < Mp; m0 += 64) {
        const int nb = static_cast<int>(std::min<int64_t>(4, (Mp - m0) / 16));
        const at::BFloat16* xm = xb + m0 * K;
        switch (nb) {
          case 1: amx_group<1>(w, p, xm, pb, c); break;
          case 2: amx_group<2>(w, p, xm, pb, c); break;
          case 3: amx_group<3>(w, p, xm, pb, c); break;
          default: amx_group<4>(w, p, xm, pb, c); break;
        }
        for (int64_t m = m0; m < std::min(M, m0 + 64); ++m)
          for (int64_t j = 0; j < kVCols; ++j) {
            const int64_t n = p * kVCols + j;
            y[m * w.N + n] = static_cast<at::BFloat16>(c[(m - m0) * kVCols + j] + (bias ? bias[n] : 0.f));
          }
      }
    }
    _tile_release();
  });
}

}  // namespace aotllm
#endif
