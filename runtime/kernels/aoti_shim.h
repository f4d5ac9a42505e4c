// The C entry points a compiled package calls our ops through (aoti_torch_cpu_<op>).
//
// Without them AOTInductor reaches a custom op through its proxy executor: per call it builds
// a stack of IValues from the op's serialized description, dispatches it boxed, and unboxes
// the result (SmolLM2's decode step: 181 calls; entry points took its one-sequence step from
// 6.08 to 5.93 ms on a 2-core Zen 5, the program alone 5.64 -> 5.49). A package compiled
// with `aot_inductor.custom_ops_to_c_shims` (pipeline/compile/aoti.py, from
// runtime/kernels/__init__.py c_shims) calls `aoti_torch_cpu_<op>` with the C ABI of
// torch's own shims instead: a Tensor is an AtenTensorHandle, a Tensor? an AtenTensorHandle*
// (null for None), an int int64_t, a bool int32_t, a float double, a str const char*, and the
// result is written to a last AtenTensorHandle*. The symbols resolve at the package's load
// against this library, which runtime/kernels/__init__.py loads RTLD_GLOBAL for that.
// tests/runtime/test_kernel_shims.py checks each definition against its op's schema.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <optional>
#include <utility>

#define AOTI_ENTRY_POINT extern "C" __attribute__((visibility("default"))) AOTITorchError

namespace aotllm::shim {

inline const at::Tensor& in(AtenTensorHandle h) {
  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(h);
}

inline std::optional<at::Tensor> opt(AtenTensorHandle* h) {
  return torch::aot_inductor::pointer_to_optional<at::Tensor>(h);
}

inline void out(at::Tensor t, AtenTensorHandle* ret) {
  *ret = torch::aot_inductor::new_tensor_handle(std::move(t));
}

}  // namespace aotllm::shim
