// Software prefetch of what a kernel reads next (weights, the next block of the KV cache), a
// cache line at a time.
//
// Why, for weights: each thread streams its panels from memory once. When a panel is read more than once
// (several passes of rows over it), the passes after the first hit L1, and the hardware
// prefetcher, seeing no misses, does not run ahead to the next panel; when it is read once
// by a short one-row pass, the prefetcher ramps up too late. Both left the kernels waiting on
// memory (the measurements are at the callers: panel_linear.cpp, qpanel_linear.cpp,
// qpanel_vnni.h).
#pragma once

#include <cstdint>

namespace aotllm {

// [p, p + bytes) into L1. A hint, never a fault: past a weight's end too.
inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(c + l, 0, 3);
}

struct PanelShare {
  const char* at;
  int64_t bytes;
};

// What pass `pass` of the `passes` over a panel (`bytes` long) prefetches of the panel after
// it: its share, 1/passes, so that the passes between them fetch all of it. The last panel
// prefetches itself (in cache by then).
inline PanelShare next_panel_share(const void* panel, int64_t bytes, bool last, int64_t pass,
                                   int64_t passes) {
  const int64_t share = (bytes + passes - 1) / passes;
  const char* next = static_cast<const char*>(panel) + (last ? 0 : bytes);
  return {next + pass * share, share};
}

}  // namespace aotllm
