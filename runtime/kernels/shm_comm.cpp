// Collectives between the ranks of one host through shared memory.
//
// A gloo all-reduce of one 576-wide row costs 1-2 ms on loopback and a decode step has
// about 60 of them; through shared memory it is a copy, a flag, a wait and a sum.
// Every rank writes its tensor into its own slot, publishes a sequence number, waits
// until every rank has published it, and reduces all slots in rank order (so every rank
// gets bitwise the same result). Slots are double-buffered by the sequence number's
// parity: a rank only publishes call n after it has read call n-1, so nobody overwrites
// a slot another rank may still read.
//
// A group without a shared-memory segment (ranks on several hosts, or none set up) falls
// back to torch's functional collectives on the process group of the same name, so the
// compiled program is the same everywhere and the transport is chosen at load time.
#include "aoti_shim.h"
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr int64_t kMaxRanks = 16;
constexpr int64_t kLine = 64;

struct alignas(kLine) Flag {
  std::atomic<uint64_t> seq;
  int64_t pid;
};

struct Group {
  int64_t rank = 0, size = 1, slot_bytes = 0;
  uint64_t seq = 0;
  char* base = nullptr;
  size_t length = 0;
  Flag* flags() const { return reinterpret_cast<Flag*>(base); }
  char* slot(int64_t parity, int64_t r) const {
    return base + kMaxRanks * sizeof(Flag) + (parity * size + r) * slot_bytes;
  }
};

std::mutex g_mutex;
std::map<std::string, Group> g_groups;

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// Whether a process still runs: it exists and is not a zombie waiting to be reaped.
bool alive(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;  // no procfs: trust kill()
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* state = std::strrchr(buf, ')');  // "pid (comm) S ..."
  return state == nullptr || !(state[2] == 'Z' || state[2] == 'X');
}

// Wait until every rank has published `seq`; a dead peer is an error, not a hang.
void wait_all(const Group& g, uint64_t seq) {
  auto* flags = g.flags();
  auto last_check = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < g.size; ++r) {
    int64_t spins = 0;
    while (flags[r].seq.load(std::memory_order_acquire) < seq) {
      if (++spins < 2000) {
        cpu_relax();
        continue;
      }
      sched_yield();  // on a host with fewer cores than threads, let the peer run
      auto now = std::chrono::steady_clock::now();
      if (now - last_check > std::chrono::milliseconds(100)) {
        last_check = now;
        TORCH_CHECK(alive(flags[r].pid), "shared-memory collective: rank ", r, " (pid ",
                    flags[r].pid, ") is gone");
      }
    }
  }
}

Group* find(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_groups.find(name);
  return it == g_groups.end() ? nullptr : &it->second;
}

// Publish `x` into this rank's slot for the next call; returns the call's sequence number.
uint64_t publish(Group& g, const at::Tensor& x) {
  const int64_t nbytes = x.numel() * x.element_size();
  TORCH_CHECK(nbytes <= g.slot_bytes, "shared-memory collective: ", nbytes,
              " bytes exceed the slot of ", g.slot_bytes);
  const uint64_t seq = ++g.seq;
  std::memcpy(g.slot(seq % 2, g.rank), x.data_ptr(), nbytes);
  g.flags()[g.rank].seq.store(seq, std::memory_order_release);
  wait_all(g, seq);
  return seq;
}

template <typename scalar_t>
void sum_slots(const Group& g, uint64_t seq, int64_t n, scalar_t* out) {
  // Accumulate in float32 for 16-bit types, in rank order: identical on every rank.
  constexpr int64_t kChunk = 1024;
  float acc[kChunk];
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t len = std::min(kChunk, n - start);
    std::fill(acc, acc + len, 0.f);
    for (int64_t r = 0; r < g.size; ++r) {
      const auto* src = reinterpret_cast<const scalar_t*>(g.slot(seq % 2, r)) + start;
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) acc[i] += static_cast<float>(src[i]);
    }
    for (int64_t i = 0; i < len; ++i) out[start + i] = static_cast<scalar_t>(acc[i]);
  }
}

at::Tensor call(const char* name, std::vector<c10::IValue> args) {
  // Boxed: the string arguments' C++ types differ across torch versions.
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  op.callBoxed(&args);
  return args.at(0).toTensor();
}

at::Tensor fallback(const char* op, const at::Tensor& x, const std::string& group,
                    int64_t size) {
  at::Tensor out = std::strcmp(op, "all_reduce") == 0
      ? call("_c10d_functional::all_reduce", {x, std::string("sum"), group})
      : call("_c10d_functional::all_gather_into_tensor", {x, size, group});
  return call("_c10d_functional::wait_tensor", {out});
}

at::Tensor all_reduce(const at::Tensor& x, std::string group, int64_t size) {
  Group* g = find(group);
  if (g == nullptr) return fallback("all_reduce", x, group, size);
  auto xc = x.contiguous();
  const uint64_t seq = publish(*g, xc);
  auto out = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "shm_all_reduce",
                                  [&] { sum_slots<scalar_t>(*g, seq, xc.numel(),
                                                            out.data_ptr<scalar_t>()); });
  return out;
}

at::Tensor all_gather(const at::Tensor& x, std::string group, int64_t size) {
  Group* g = find(group);
  if (g == nullptr) return fallback("all_gather", x, group, size);
  auto xc = x.contiguous();
  const uint64_t seq = publish(*g, xc);
  std::vector<int64_t> shape(xc.sizes().begin(), xc.sizes().end());
  shape[0] *= g->size;
  auto out = at::empty(shape, xc.options());
  const int64_t nbytes = xc.numel() * xc.element_size();
  for (int64_t r = 0; r < g->size; ++r) {
    std::memcpy(static_cast<char*>(out.data_ptr()) + r * nbytes, g->slot(seq % 2, r), nbytes);
  }
  return out;
}

// Attach this process to a segment (rank 0 creates it first): `name` as shm_open takes.
void shm_init(std::string group, std::string name, int64_t rank, int64_t size,
              int64_t slot_bytes, bool create) {
  TORCH_CHECK(size >= 1 && size <= kMaxRanks && rank >= 0 && rank < size, "bad group shape");
  slot_bytes = (slot_bytes + kLine - 1) / kLine * kLine;
  const size_t length = kMaxRanks * sizeof(Flag) + 2 * size * slot_bytes;
  int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "shm_open(", name, ") failed: ", std::strerror(errno));
  if (create) TORCH_CHECK(ftruncate(fd, static_cast<off_t>(length)) == 0, "ftruncate failed");
  void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  TORCH_CHECK(base != MAP_FAILED, "mmap of ", name, " failed: ", std::strerror(errno));
  Group g;
  g.rank = rank;
  g.size = size;
  g.slot_bytes = slot_bytes;
  g.base = static_cast<char*>(base);
  g.length = length;
  g.flags()[rank].pid = getpid();
  std::lock_guard<std::mutex> lock(g_mutex);
  auto old = g_groups.find(group);
  if (old != g_groups.end()) munmap(old->second.base, old->second.length);
  g_groups[group] = g;
}

void shm_unlink_name(std::string name) { shm_unlink(name.c_str()); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(aotllm, m) {
  m.def("all_reduce(Tensor x, str group, int size) -> Tensor");
  m.def("all_gather(Tensor x, str group, int size) -> Tensor");
  m.def("shm_init(str group, str name, int rank, int size, int slot_bytes, bool create) -> ()");
  m.def("shm_unlink(str name) -> ()");
}

TORCH_LIBRARY_IMPL(aotllm, CPU, m) {
  m.impl("all_reduce", &all_reduce);
  m.impl("all_gather", &all_gather);
}

AOTI_ENTRY_POINT aoti_torch_cpu_all_reduce(AtenTensorHandle x, const char* group, int64_t size,
                                      AtenTensorHandle* ret0) {
  using namespace aotllm::shim;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({ out(all_reduce(in(x), group, size), ret0); });
}

AOTI_ENTRY_POINT aoti_torch_cpu_all_gather(AtenTensorHandle x, const char* group, int64_t size,
                                      AtenTensorHandle* ret0) {
  using namespace aotllm::shim;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({ out(all_gather(in(x), group, size), ret0); });
}

TORCH_LIBRARY_IMPL(aotllm, CatchAll, m) {
  m.impl("shm_init", &shm_init);
  m.impl("shm_unlink", &shm_unlink_name);
}
