// Work shared out in small chunks taken from one counter, instead of at::parallel_for's one
// static slice a thread.
//
// Why: at::parallel_for (OpenMP) gives each thread range / threads up front. When the cores
// are contended (a neighbour process, the load generator, a pod's CPU quota) the scheduler
// takes a core from one of our threads for a time slice, and every parallel region then waits
// for that thread's whole slice: a Gemma 3 270M decode step went from 21 to 50 ms beside one
// busy process on 2 cores (AMD EPYC Zen 4), where a fair share of the cores would give about
// 32. Here a thread that is not running holds at most one chunk; the running ones take the
// rest (llama.cpp's ggml threads take matmul chunks from a shared counter the same way).
//
// `f(b, e)` may be called many times per thread: per-thread set-up (AMX tile configuration)
// goes inside it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace aotllm {

// Chunks per thread: enough that a stalled thread holds a small share, few enough that the
// counter and each chunk's start (a panel's first cache lines) cost nothing measurable.
constexpr int64_t kChunksPerThread = 8;

// at::parallel_for's contract: f(b, e) over disjoint ranges that cover [begin, end), each at
// least `grain` long (but the last), all of them in the calling thread when there is one
// thread, a range of at most one grain, or when already inside a parallel region.
template <typename F>
void parallel_chunks(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  grain = std::max<int64_t>(grain, 1);
  if (threads <= 1 || n <= grain) {
    f(begin, end);
    return;
  }
  // A whole number of grains a chunk, so every chunk starts on a grain (a kernel may work
  // 16 rows or a panel at a time from its `b`).
  const int64_t want = n / (threads * kChunksPerThread);
  const int64_t chunk = std::max<int64_t>(grain, (want + grain - 1) / grain * grain);
  const int64_t chunks = (n + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  // One index a thread: each thread that runs the body pulls chunks until none are left.
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      f(begin + c * chunk, std::min(end, begin + (c + 1) * chunk));
    }
  });
}

}  // namespace aotllm
