// AMX basics shared by the kernels that multiply bf16 rows by weights in pair panels: the
// quantized ones (qpanel_amx.h: each run dequantized into a B tile) and the bf16 ones
// (pair_linear.cpp: each run *is* a B tile, read from the shard as stored).
//
// A run of a pair panel (16 pairs of k x 16 columns x 2 bf16, 1 KiB) is, byte for byte, the
// B operand of one `tdpbf16ps`; an A tile is 16 input rows x 32 bf16 (one run of k), loaded
// straight from x with the row stride K. The tile registers are per thread: every parallel
// chunk loads its configuration first (oneDNN's GEMMs on the same threads load their own).
#pragma once

#include <ATen/ATen.h>
#include "prefetch.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace aotllm {

constexpr int64_t kTileK = 32;        // k a run covers (16 pairs)
constexpr int64_t kTileElems = 512;   // bf16 values a B tile holds
constexpr int64_t kTileRows = 16;     // input rows an A (and C) tile holds
constexpr int64_t kAmxPrefetch = 2048;  // bf16 values ahead (4 KiB) of streamed B tiles

inline bool amx_ready() {
  // ARCH_REQ_XCOMP_PERM (0x1023), XFEATURE_XTILEDATA (18): the process may use the tiles
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// Tiles 0-3: C (16 rows x 16 float32), 4: B (16 pairs x 16 columns x 2 bf16), 5-6: A (16
// rows x 32 bf16), 7: B (amx_panels). All 64 bytes x 16 rows.
inline void amx_config() {
  alignas(64) uint8_t cfg[64];
  std::memset(cfg, 0, sizeof(cfg));
  cfg[0] = 1;  // palette 1
  for (int t = 0; t < 8; ++t) {
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
  const char* a = reinterpret_cast<const char*>(xb + r * kTileK);
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

// c [16 NB, 16] float32 = NB blocks of 16 rows of xb [., K] x one panel's K / 32 B tiles.
// `stream`: the panel is read from memory (not a buffer in cache), so it is prefetched
// 4 KiB ahead of the tile unit, which otherwise waits on every run.
template <int NB>
inline void amx_group(int64_t K, const at::BFloat16* xb, const uint16_t* panel, float* c,
                      bool stream) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  for (int64_t r = 0; r < K / kTileK; ++r) {
    if (stream) {
      prefetch_lines(panel + r * kTileElems + kAmxPrefetch, 1024);  // the run 4 KiB ahead
    }
    amx_blocks<NB>(xb, K, r, panel + r * kTileElems);
  }
  _tile_stored(0, c, 64);
  if constexpr (NB > 1) _tile_stored(1, c + 256, 64);
  if constexpr (NB > 2) _tile_stored(2, c + 512, 64);
  if constexpr (NB > 3) _tile_stored(3, c + 768, 64);
}

// Panels one block of 16 rows (a decode step of 1-16 sequences) takes at once.
constexpr int64_t kAmxPanels = 4;

// c [kAmxPanels][16, 16] float32 = one block of 16 rows of xb [16, K] x kAmxPanels panels
// (panel q at panel + q * stride), each panel's runs in order into its own C tile: the same
// bits as amx_group<1> a panel. Why: one panel a pass reads one stream, its B tile loads
// waiting one after another on memory (a load into tile 4 waits for the product that reads
// the last one); four panels are four streams, which the hardware prefetchers follow, and
// nothing is prefetched by hand (a 4 KiB prefetch into L1 or L2, tried on top, was slower).
// Measured (SmolLM2's 30 layers of linears and its LM head from memory, 2 threads, Intel
// Xeon with AMX, two rounds, ms): 16 rows 15.8-16.6 -> 14.3-14.7, 4 rows 14.9-15.3 ->
// 14.0-14.6, 1 row 14.7-15.0 -> 14.4-14.5.
inline void amx_panels(int64_t K, const at::BFloat16* xb, const uint16_t* panel,
                       int64_t stride, float* c) {
  static_assert(kAmxPanels == 4, "C tiles 0-3, one a panel");
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t r = 0; r < K / kTileK; ++r) {
    const uint16_t* b = panel + r * kTileElems;
    _tile_loadd(5, xb + r * kTileK, K * 2);
    _tile_loadd(4, b, 64);
    _tile_dpbf16ps(0, 5, 4);
    _tile_loadd(6, b + stride, 64);
    _tile_dpbf16ps(1, 5, 6);
    _tile_loadd(7, b + 2 * stride, 64);
    _tile_dpbf16ps(2, 5, 7);
    _tile_loadd(4, b + 3 * stride, 64);
    _tile_dpbf16ps(3, 5, 4);
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  _tile_stored(2, c + 512, 64);
  _tile_stored(3, c + 768, 64);
}

// x [M, K] with its rows padded to whole tiles (zeros, in `buf`), or x itself when they are.
inline const at::BFloat16* pad_rows(const at::BFloat16* x, int64_t M, int64_t K,
                                    std::vector<at::BFloat16>& buf) {
  const int64_t Mp = (M + kTileRows - 1) / kTileRows * kTileRows;
  if (Mp == M) return x;
  buf.assign(Mp * K, at::BFloat16(0.f));
  std::memcpy(buf.data(), x, M * K * sizeof(at::BFloat16));
  return buf.data();
}

// amx_group for the NB = min(4, rows / 16) its row block needs.
inline void amx_rows(int64_t rows, int64_t K, const at::BFloat16* xb, const uint16_t* panel,
                     float* c, bool stream) {
  switch (std::min<int64_t>(4, rows / kTileRows)) {
    case 1: amx_group<1>(K, xb, panel, c, stream); break;
    case 2: amx_group<2>(K, xb, panel, c, stream); break;
    case 3: amx_group<3>(K, xb, panel, c, stream); break;
    default: amx_group<4>(K, xb, panel, c, stream); break;
  }
}

}  // namespace aotllm
#endif
