// Run an AOTInductor package as a custom op, so that Python releases the GIL meanwhile.
//
// torch's own Python binding of the package loader (`boxed_run`) holds the GIL for the
// whole step; rank 0's HTTP thread then cannot parse a request, tokenize a prompt or write
// a token to a client until the step is over. Calls through `torch.ops` release the GIL,
// so the engine calls the same loader through these ops instead.
#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using Loader = torch::inductor::AOTIModelPackageLoader;
std::mutex g_mutex;
std::vector<std::unique_ptr<Loader>> g_loaders;

Loader& get(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(g_loaders.size()) && g_loaders[handle],
              "no AOTInductor package with handle ", handle);
  return *g_loaders[handle];
}

int64_t package_load(std::string path, int64_t device_index) {
  auto loader = std::make_unique<Loader>(path, "model", false, 1,
                                         static_cast<c10::DeviceIndex>(device_index));
  std::lock_guard<std::mutex> lock(g_mutex);
  g_loaders.push_back(std::move(loader));
  return static_cast<int64_t>(g_loaders.size()) - 1;
}

std::vector<std::string> package_constant_fqns(int64_t handle) {
  return get(handle).get_constant_fqns();
}

// Bind weights the caller keeps alive (user managed: no copy).
void package_load_constants(int64_t handle, std::vector<std::string> names,
                            std::vector<at::Tensor> values) {
  TORCH_CHECK(names.size() == values.size(), "one tensor per constant name");
  std::unordered_map<std::string, at::Tensor> constants;
  for (size_t i = 0; i < names.size(); ++i) constants.emplace(names[i], values[i]);
  get(handle).load_constants(constants, false, true, true);
}

std::vector<at::Tensor> package_run(int64_t handle, std::vector<at::Tensor> inputs) {
  return get(handle).boxed_run(std::move(inputs));
}

void package_release(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (handle >= 0 && handle < static_cast<int64_t>(g_loaders.size())) g_loaders[handle].reset();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aotllm, m) {
  m.def("package_load(str path, int device_index) -> int");
  m.def("package_constant_fqns(int handle) -> str[]");
  m.def("package_load_constants(int handle, str[] names, Tensor[] values) -> ()");
  m.def("package_run(int handle, Tensor[] inputs) -> Tensor[]");
  m.def("package_release(int handle) -> ()");
}

TORCH_LIBRARY_IMPL(aotllm, CatchAll, m) {
  m.impl("package_load", &package_load);
  m.impl("package_constant_fqns", &package_constant_fqns);
  m.impl("package_load_constants", &package_load_constants);
  m.impl("package_run", &package_run);
  m.impl("package_release", &package_release);
}
