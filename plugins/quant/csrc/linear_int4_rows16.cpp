// CPU kernel of kiln::linear_int4_rows16 (weight-only on int4_a8 weights: x stays float;
// schema and reference: plugins/quant/ops.py). The kernels: int4_a8_blocks.h, with each group
// of x held as kRows16Digits int8 digits of fixed point.
#include <torch/library.h>

#include "int4_a8_blocks.h"

namespace {

// Digits of x in linear_int4_rows16 (weight-only). Two hold each group of x within 3.1e-5 of
// its max|x| (bfloat16 activations: 2e-3 of each value); a third (2.4e-7) cost a third more
// integer work: 30 streamed SmolLM2 w13 matrices at one row of x, 2 threads, an Intel Xeon
// (AMX), 2 digits against 3: AVX2 0.93 vs 1.17 ms (in cache 0.79 vs 1.04), VNNI 0.81 vs 0.86
// (0.44 vs 0.53); W4A8 (one digit) 0.72 and 0.79.
constexpr int kRows16Digits = 2;

at::Tensor linear_int4_rows16(const at::Tensor& x, const at::Tensor& qweight,
                              const at::Tensor& scales, const at::Tensor& mins,
                              const c10::optional<at::Tensor>& bias) {
  return kiln_int4_a8::run<kRows16Digits>("kiln::linear_int4_rows16", x, qweight, scales, mins,
                                          bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("linear_int4_rows16", &linear_int4_rows16);
}


// ---- AOTInductor C shim (plugins/csrc/aoti_shim.h) -------------------------------------------
#include "../../csrc/aoti_shim.h"

KILN_LINEAR_SHIM_3(linear_int4_rows16)
