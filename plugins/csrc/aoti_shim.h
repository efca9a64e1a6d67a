// AOTInductor C shims of kiln's CPU custom ops.
//
// A compiled CPU plan calls each kiln op as
//   AOTITorchError aoti_torch_cpu_<op>(AtenTensorHandle ... | AtenTensorHandle* (Tensor?) |
//                                       int64_t (int) | double (float), AtenTensorHandle* ret0)
// (builder/compile.py lists them in aot_inductor.custom_ops_to_c_shims, declarations from the
// op schemas: plugins/shims.py) instead of AOTInductor's proxy executor, which boxed every call
// into an IValue stack from a JSON description of its arguments. A shim calls the op through
// the dispatcher's unboxed path, so it reaches whichever library registered the op's CPU
// kernel, as the proxy executor did: a process that loaded two ISA builds of one library
// resolves aoti_torch_cpu_<op> to either copy and still runs the registered kernel. The
// libraries are loaded RTLD_GLOBAL (plugins/cpp_build.py) so a plan's model .so finds them.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <optional>

#define KILN_AOTI_SHIM extern "C" __attribute__((visibility("default"), used)) AOTITorchError

namespace kiln_shim {

inline at::Tensor& tensor(AtenTensorHandle h) {
  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(h);
}

inline std::optional<at::Tensor> optional(AtenTensorHandle* h) {
  return h ? std::optional<at::Tensor>(tensor(*h)) : std::nullopt;
}

inline AtenTensorHandle result(at::Tensor t) {
  return torch::aot_inductor::new_tensor_handle(std::move(t));
}

// The op's unboxed handle (looked up once per shim, at its first call).
template <class Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using Opt = const std::optional<at::Tensor>&;
using T = const at::Tensor&;

}  // namespace kiln_shim

// The shim of a linear op `kiln::NAME(Tensor x, Tensor <each of ...>, Tensor? bias) -> Tensor`
// (the weight's tensors: qweight, scales and mins; qweight and scales; or the float weight).
#define KILN_LINEAR_SHIM_3(NAME)                                                               \
  KILN_AOTI_SHIM aoti_torch_cpu_##NAME(AtenTensorHandle x, AtenTensorHandle w0,                \
                                       AtenTensorHandle w1, AtenTensorHandle w2,               \
                                       AtenTensorHandle* bias, AtenTensorHandle* ret0) {       \
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({                                               \
      static const auto op = kiln_shim::op<at::Tensor(kiln_shim::T, kiln_shim::T, kiln_shim::T, \
                                                      kiln_shim::T, kiln_shim::Opt)>(          \
          "kiln::" #NAME);                                                                     \
      *ret0 = kiln_shim::result(op.call(kiln_shim::tensor(x), kiln_shim::tensor(w0),           \
                                        kiln_shim::tensor(w1), kiln_shim::tensor(w2),          \
                                        kiln_shim::optional(bias)));                           \
    });                                                                                        \
  }
#define KILN_LINEAR_SHIM_2(NAME)                                                               \
  KILN_AOTI_SHIM aoti_torch_cpu_##NAME(AtenTensorHandle x, AtenTensorHandle w0,                \
                                       AtenTensorHandle w1, AtenTensorHandle* bias,            \
                                       AtenTensorHandle* ret0) {                               \
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({                                               \
      static const auto op = kiln_shim::op<at::Tensor(kiln_shim::T, kiln_shim::T,             \
                                                      kiln_shim::T, kiln_shim::Opt)>(          \
          "kiln::" #NAME);                                                                     \
      *ret0 = kiln_shim::result(op.call(kiln_shim::tensor(x), kiln_shim::tensor(w0),           \
                                        kiln_shim::tensor(w1), kiln_shim::optional(bias)));    \
    });                                                                                        \
  }
#define KILN_LINEAR_SHIM_1(NAME)                                                               \
  KILN_AOTI_SHIM aoti_torch_cpu_##NAME(AtenTensorHandle x, AtenTensorHandle w0,                \
                                       AtenTensorHandle* bias, AtenTensorHandle* ret0) {       \
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({                                               \
      static const auto op =                                                                   \
          kiln_shim::op<at::Tensor(kiln_shim::T, kiln_shim::T, kiln_shim::Opt)>("kiln::" #NAME); \
      *ret0 = kiln_shim::result(                                                               \
          op.call(kiln_shim::tensor(x), kiln_shim::tensor(w0), kiln_shim::optional(bias)));    \
    });                                                                                        \
  }
