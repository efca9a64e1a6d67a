// CPU kernel of kiln::linear_int8_a8 (W8A8; schema and reference: plugins/quant/ops.py).
//
//   y[m, n] = sx[m] * sw[n] * sum_k xq[m, k] * wq[n, k]  (+ bias[n])
//   xq = round_half_even(x / sx), sx = max|x[m]| / 127 (per row, at run time);
//   wq, sw: the int8 per-output-channel weights of linear_int8.
//
// The integer dot products: int8_dot.h (VNNI vpdpbusd / AVX2 vpmaddubsw / scalar).
// From kGemmMinM rows of x on, the integer GEMM is int8_gemm.h's, each 16 x 16 block of sums
// scaled into y as it is stored (StoreScaled): AMX tiles at the amx level, from 4 rows; the
// vpdpbusd GEMM at the VNNI levels, from 8 rows. SmolLM2's w13 (3072 x 576), 2 threads, Zen 4,
// best of 7 (bench/linear_kernels.py), rows of x: dot tiles / this GEMM (us): 4: 51 / 79,
// 8: 86 / 85, 12: 122 / 101, 16: 198 / 101, 32: 320 / 165. With oneDNN's _int_mm (165 us
// alone at 32 rows there) and a second pass scaling its int32 [M, N] the op took 256; _int_mm
// stays for the shapes the GEMMs do not take (K not a multiple of 64), from 4 rows. All give
// the same integers.
// Only where oneDNN has int8 micro-kernels (VNNI, AMX): on an AVX2-only host ATen's _int_mm
// falls back to a scalar loop, 0.06-0.17 GMAC/s on a Zen 2 core against the AVX2 dot
// products' tens, so the AVX2 and scalar levels keep every M on int8_dot.h's tiles (the
// tied lm_head of a W8A8 plan at 32 rows: seconds a step on _int_mm).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "int8_dot.h"
#include "int8_gemm.h"

#if KILN_INT8_GEMM_AMX
#define KILN_A8_PATH "w8a8: avx512-vnni vpdpbusd, from 4 rows amx tiles"
#elif KILN_INT8_DOT_VNNI
#define KILN_A8_PATH "w8a8: avx512-vnni vpdpbusd, from 8 rows vpdpbusd gemm"
#elif KILN_INT8_DOT_AVX2
#define KILN_A8_PATH "w8a8: avx2 vpmaddubsw"
#else
#define KILN_A8_PATH "w8a8: scalar"
#endif

extern "C" __attribute__((used, visibility("default")))
const char kiln_quant_a8_kernel_path[] = "KILN_KERNEL_PATH:" KILN_A8_PATH;

namespace {

using namespace kiln_int8;

#if KILN_INT8_GEMM_AMX
constexpr int64_t kIntMmMinM = 4;
constexpr int64_t kGemmMinM = 4;
#elif KILN_INT8_DOT_VNNI
constexpr int64_t kIntMmMinM = 4;
constexpr int64_t kGemmMinM = 8;   // a half block (8 rows of x) costs what 8 rows of dot tiles do
#else
constexpr int64_t kIntMmMinM = INT64_MAX;   // no fast int8 GEMM in oneDNN at this level
#endif

#if KILN_INT8_GEMM_AMX || KILN_INT8_DOT_VNNI
// The GEMMs' store for W8A8: each C block's columns (a row of x, 16 weight rows) scaled into
// y as they leave it, y = float(acc) * (sx[m] * sw[n]) + bias[n] with one rounding after the
// product of the scales (an FMA), the expression the other paths' loops compile to, so a
// row's bits do not depend on the path its batch takes.
struct StoreScaled {
  float* y;
  int64_t N;
  const float *sx, *sw, *b;
  void operator()(const int32_t* buf, int64_t n0, int64_t m0, int64_t cols_m) const {
    const __m512 w = _mm512_loadu_ps(sw + n0);
    const __m512 bias = b ? _mm512_loadu_ps(b + n0) : _mm512_setzero_ps();
    transpose_tile(buf, cols_m, [&](int64_t j, __m512i col) {
      const int64_t m = m0 + j;
      _mm512_storeu_ps(y + m * N + n0, _mm512_fmadd_ps(_mm512_cvtepi32_ps(col),
                                                       _mm512_mul_ps(_mm512_set1_ps(sx[m]), w),
                                                       bias));
    });
  }
};
#endif

at::Tensor linear_int8_a8(const at::Tensor& x_in, const at::Tensor& qweight,
                          const at::Tensor& scales, const c10::optional<at::Tensor>& bias_in) {
  const char* op = "kiln::linear_int8_a8";
  TORCH_CHECK(x_in.dim() == 2, op, ": x must be [M, K], got ", x_in.sizes());
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              op, ": qweight must be contiguous int8 [N, K]");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K, op, ": x has K=", K, " but the weight has K=", qweight.size(1));
  TORCH_CHECK(K < 66000, op, ": K=", K, " could overflow the int32 dot products");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              op, ": scales must be contiguous float32 [N]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x_in.scalar_type());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->numel() == N, op, ": bias has ", bias_in->numel(), " elements, expected ",
                N);
    bias = bias_in->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());

  QuantX qx = quantize_digits(x.data_ptr<float>(), M, K, 1);
  const float* sx = qx.s.data();
  const float* sw = scales.data_ptr<float>();
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();

#if KILN_INT8_GEMM_AMX || KILN_INT8_DOT_VNNI
  if (M >= kGemmMinM && (int8_gemm_on_tiles(M, N, K) || int8_gemm_on_vnni(M, N, K))) {
    // scaled as the blocks are stored: no int32 [M, N] and no second pass over it
    const int8_t* w = qweight.data_ptr<int8_t>();
    const int64_t whole = int8_blocks(w, K, qx.q.data(), M, N, StoreScaled{y, N, sx, sw, b});
    for (int64_t m = 0; m < M; ++m)   // the weight rows past the whole blocks (at most 31)
      for (int64_t n = whole; n < N; ++n)
        y[m * N + n] = std::fma(float(dot_scalar(qx.q.data() + m * K, w + n * K, 0, K)),
                                sx[m] * sw[n], b ? b[n] : 0.f);   // StoreScaled's FMA
    return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
  }
#endif
  // _int_mm for the shapes the GEMMs do not take; a [N, 1] or [1, K] weight's transpose has
  // strides oneDNN misreads (garbage, no error)
  if (M >= kIntMmMinM && K >= 8 && N >= 8 && !int8_gemm_on_vnni(M, N, K)) {
    const at::Tensor acc = int8_gemm(qx.q.data(), M, qweight.data_ptr<int8_t>(), N, K);
    const int32_t* a = acc.data_ptr<int32_t>();
    at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t n = 0; n < N; ++n)
          y[m * N + n] = float(a[m * N + n]) * (sx[m] * sw[n]) + (b ? b[n] : 0.f);
    });
    return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
  }

  qx.finish();
  dot_blocks(qx, qweight.data_ptr<int8_t>(), N, [&](int64_t n0, int64_t nr, const int32_t* acc) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < nr; ++j)
        y[m * N + n0 + j] = float(acc[m * kNB + j]) * (sx[m] * sw[n0 + j]) + (b ? b[n0 + j] : 0.f);
  });
  return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("linear_int8_a8", &linear_int8_a8);
}


// ---- AOTInductor C shim (plugins/csrc/aoti_shim.h) -------------------------------------------
#include "../../csrc/aoti_shim.h"

KILN_LINEAR_SHIM_2(linear_int8_a8)
