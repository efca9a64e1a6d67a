// CPU kernels of kiln::linear_fp32 and kiln::linear_bf16, the linears of float weights
// (schemas and references: plugins/quant/ops.py). Registered for the CPU key, so they override
// the references once this library is loaded. Their GEMV and tile paths: dequant_gemv.h.
#include <torch/library.h>

#include "bf16_dot.h"
#include "dequant_gemv.h"
#include "gemm_f32_dot.h"

namespace {

using namespace kiln_gemv;

// bf16 -> float32 by bits: the 16 bits become the high half of a float32.
struct Bf16Dec {
  const uint16_t* q;
  int64_t K;
  static constexpr int64_t kBlockBytes = 2 * kBlock;
  const char* at(int64_t n, int64_t k) const {
    return reinterpret_cast<const char*>(q + n * K + k);
  }
  float row_scale(int64_t) const { return 1.0f; }
  float tail(int64_t n, int64_t k) const {
    return float(c10::BFloat16(q[n * K + k], c10::BFloat16::from_bits()));
  }
#if KILN_QUANT_AVX2
  inline void decode(int64_t n, int64_t k, vec w[4]) const {
    const uint16_t* p = q + n * K + k;
    for (int j = 0; j < 4; ++j)
      w[j] = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * j))), 16));
  }
#endif
  inline void decode_scalar(int64_t n, int64_t k, float* w) const {
    for (int j = 0; j < kBlock; ++j) w[j] = tail(n, k + j);
  }
};

// fp32: nothing to decode; the GEMV streams the weights at the machine's read bandwidth (MKL's
// sgemv reached about half of it on SmolLM2's shapes), large M goes to at::linear.
struct F32Dec {
  const float* q;
  int64_t K;
  static constexpr int64_t kBlockBytes = 4 * kBlock;
  const char* at(int64_t n, int64_t k) const {
    return reinterpret_cast<const char*>(q + n * K + k);
  }
  float row_scale(int64_t) const { return 1.0f; }
  float tail(int64_t n, int64_t k) const { return q[n * K + k]; }
#if KILN_QUANT_AVX2
  inline void decode(int64_t n, int64_t k, vec w[4]) const {
    const float* p = q + n * K + k;
    for (int j = 0; j < 4; ++j) w[j] = _mm256_loadu_ps(p + 8 * j);
  }
#endif
  inline void decode_scalar(int64_t n, int64_t k, float* w) const {
    for (int j = 0; j < kBlock; ++j) w[j] = q[n * K + k + j];
  }
};

// A vocabulary-wide output (the lm_head) at a decode batch's rows goes to BLAS as
// out^T = W x^T, the weight the tall left operand: MKL's sgemm is about twice as fast that way
// round on SmolLM2's 32 x 576 @ 576 x 49152 (AMD AVX2, 2 threads; docs/PERFORMANCE.md), and
// gives the same bits at 16 and 32 rows. The transposed copy of out is M x N floats.
// Where gemm_f32_dot.h's kernel runs (AVX2 builds; AVX-512 builds off Intel CPUs) it takes
// 8-64 rows (8-128 in AVX-512 builds) instead: faster there, and a row's bits do not depend
// on the batch.
constexpr int64_t kTallMinN = 16384;
constexpr int64_t kTallMaxM = 64;

// f(m0, rows) over the rows [0, M) in near-equal chunks of at most max_rows (so each has at
// least M / ceil(M / max_rows) rows): a prefill's rows through a kernel sized for a decode
// batch's, each row in a chunk it would also be computed in alone.
template <class F>
void row_chunks(int64_t M, int64_t max_rows, F&& f) {
  const int64_t chunks = (M + max_rows - 1) / max_rows, rows = (M + chunks - 1) / chunks;
  for (int64_t m0 = 0; m0 < M; m0 += rows) f(m0, std::min(rows, M - m0));
}

at::Tensor linear_fp32(const at::Tensor& x, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias) {
  const char* op = "kiln::linear_fp32";
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              op, ": weight must be contiguous float32 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  F32Dec d{weight.data_ptr<float>(), K};
#if KILN_F32_DOT
  if (x.dim() == 2 && x.size(0) >= kDotMinM && f32_dot_runs() &&
      (x.size(0) <= f32_dot_max_rows() || f32_dot_chunks())) {   // see gemm_f32_dot.h
    Prepared p = prepare(x, N, K, bias, op);
    const float* b = p.bias.defined() ? p.bias.data_ptr<float>() : nullptr;
    if (N > 0)   // chunks of at least kDotMinM rows
      row_chunks(p.x.size(0), f32_dot_max_rows(), [&](int64_t m0, int64_t mc) {
        const float* xm = p.x.data_ptr<float>() + m0 * K;
        float* om = p.out.data_ptr<float>() + m0 * N;
#if KILN_F32_BCAST
        if (f32_bcast_takes(mc, N, K)) {   // the same bits, faster on these shapes
          f32_bcast_gemm(d.q, xm, mc, K, N, b, om);
          return;
        }
#endif
        dot_gemm(d.q, xm, mc, K, N, b, om);
      });
    return p.result(x);
  }
#endif
  if (x.dim() == 2 && x.size(0) >= kTileMinM) {   // compute-bound: BLAS as it is
    Prepared p = prepare(x, N, K, bias, op);
    if (!p.bias.defined() && N >= kTallMinN && x.size(0) <= kTallMaxM)
      p.out.copy_(at::mm(weight, p.x.t()).t());
    else if (p.bias.defined())
      at::addmm_out(p.out, p.bias, p.x, weight.t());
    else
      at::mm_out(p.out, p.x, weight.t());
    return p.result(x);
  }
  return run(d, x, N, K, bias, op);
}

#if KILN_BF16_DOT && KILN_F32_BCAST
#define KILN_BF16_BCAST 1
// bf16 on int8_gemm.h's broadcast GEMM (a dword of x's B tiles and of a weight row holds two
// k, one vdpbf16ps each): where 512-bit vectors run at full width (AMD Zen 5) vdpbf16ps
// retires two a cycle and the dot tiles' horizontal sums and x reloads cost more than the
// products; there it runs at every row count from kTileMinM (a row's bits do not depend on the
// batch: one chain of vdpbf16ps a lane, over k in order). x's rows go in near-equal chunks of
// at most kBf16BcastRows (their B tiles stay in L2); the weight rows past the last block of 16
// take bf16_dot.h's scalar sums.
constexpr int64_t kBf16BcastRows = 256;
inline bool bf16_bcast_takes(int64_t N, int64_t K) {
  return N >= 16 && K % 32 == 0 && cpu_amd_full_width_512();
}

void bf16_bcast_gemm(const at::Tensor& x, const uint16_t* w, int64_t N, int64_t K,
                     const float* bias, float* out) {
  const at::Tensor xt = x.to(at::kBFloat16).contiguous();
  const auto* xb = static_cast<const uint16_t*>(xt.data_ptr());
  row_chunks(x.size(0), kBf16BcastRows, [&](int64_t m0, int64_t mc) {
    const kiln_int8::BTiles b =
        kiln_int8::pack_b(reinterpret_cast<const int8_t*>(xb + m0 * K), mc, 2 * K);
    kiln_int8::vnni_row_blocks<kiln_int8::Dp::kBf16>(reinterpret_cast<const int8_t*>(w), 2 * K,
                                                     b.data(), mc, N,
                                                     kiln_int8::StoreF32{out + m0 * N, N, bias});
  });
  if (N % 16) kiln_bf16::scalar_rows(xb, w, x.size(0), K, N / 16 * 16, N, bias, out, N);
}
#else
#define KILN_BF16_BCAST 0
#endif

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias) {
  const char* op = "kiln::linear_bf16";
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              op, ": weight must be contiguous bfloat16 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  Bf16Dec d{static_cast<const uint16_t*>(weight.data_ptr()), K};
#if KILN_BF16_GEMM_AMX
  // a batch's rows (prefill, decode batches) in bf16 on the tiles (bf16_gemm.h); fewer rows
  // stream the weights through the float GEMV, which reads them at the same rate
  if (x.dim() == 2 && x.size(0) >= kTileMinM &&
      kiln_bf16::bf16_gemm_on_tiles(x.size(0), N, K)) {
    Prepared p = prepare(x, N, K, bias, op);
    kiln_bf16::bf16_gemm(p.x, d.q, N, K, p.bias.defined() ? p.bias.data_ptr<float>() : nullptr,
                         p.out.data_ptr<float>());
    return p.result(x);
  }
#endif
#if KILN_BF16_DOT
  // without the tiles: the same rows in bf16 on vdpbf16ps (bf16_dot.h), or where 512-bit
  // vectors run at full width on the broadcast GEMM (bf16_bcast_gemm)
  if (x.dim() == 2 && x.size(0) >= kTileMinM && K >= 32) {
    Prepared p = prepare(x, N, K, bias, op);
    const float* b = p.bias.defined() ? p.bias.data_ptr<float>() : nullptr;
#if KILN_BF16_BCAST
    if (bf16_bcast_takes(N, K)) {
      bf16_bcast_gemm(p.x, d.q, N, K, b, p.out.data_ptr<float>());
      return p.result(x);
    }
#endif
    kiln_bf16::bf16_dot_gemm(p.x, d.q, N, K, b, p.out.data_ptr<float>());
    return p.result(x);
  }
#endif
  return run(d, x, N, K, bias, op);
}

}  // namespace

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_fp32", &linear_fp32);
}


// ---- AOTInductor C shims (plugins/csrc/aoti_shim.h) ------------------------------------------
#include "../../csrc/aoti_shim.h"

KILN_LINEAR_SHIM_1(linear_bf16)
KILN_LINEAR_SHIM_1(linear_fp32)
