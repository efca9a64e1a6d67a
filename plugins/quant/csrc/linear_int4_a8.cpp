// CPU kernel of kiln::linear_int4_a8 (W4A8: int4_a8 weights, x quantized per group of 32 at
// run time; schema and reference: plugins/quant/ops.py). The kernels: int4_a8_blocks.h, with
// one digit of x (and, at the amx level, AMX tiles from kAmxMinRows rows).
#include <torch/library.h>

#include "int4_a8_blocks.h"

// The code path these flags selected (plugins/cpp_build.kernel_path).
extern "C" __attribute__((used, visibility("default")))
const char kiln_quant_w4a8_kernel_path[] = "KILN_KERNEL_PATH:" KILN_W4A8_PATH;

namespace {

at::Tensor linear_int4_a8(const at::Tensor& x, const at::Tensor& qweight,
                          const at::Tensor& scales, const at::Tensor& mins,
                          const c10::optional<at::Tensor>& bias) {
  return kiln_int4_a8::run<1>("kiln::linear_int4_a8", x, qweight, scales, mins, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("linear_int4_a8", &linear_int4_a8);
}


// ---- AOTInductor C shim (plugins/csrc/aoti_shim.h) -------------------------------------------
#include "../../csrc/aoti_shim.h"

KILN_LINEAR_SHIM_3(linear_int4_a8)
