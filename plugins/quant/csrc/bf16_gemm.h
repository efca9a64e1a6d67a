// The bf16 GEMM behind kiln::linear_bf16's batched rows at the `amx` ISA level:
//
//   out[m, n] = sum_k bf16(x[m, k]) * w[n, k] (+ bias[n])   x: [M, K] float32, w: [N, K] bf16,
//                                                            out: [M, N] float32
//
// on AMX-BF16 tiles, products of bf16 pairs summed in float32: the plan computes in bf16, as
// its precision says, where the CPU has the tiles. The layout is int8_gemm.h's in bytes: the
// weight is the A operand straight from memory (16 rows x 32 k a tile, no re-layout), x is
// rounded to bf16 (to nearest even) and packed once per call as the B tiles (2 k a dword),
// each C tile stored transposed into out. Weights are read once per call whatever M is. A
// row's result depends on its own x only (no sum runs across rows).
//
// Elsewhere (no tiles, or shapes they do not take) the caller keeps its float path.
#pragma once

#include "int8_gemm.h"   // KILN_INT8_GEMM_AMX, amx_ready, pack_b, amx_row_blocks

#if KILN_INT8_GEMM_AMX && defined(__AMX_BF16__)
#define KILN_BF16_GEMM_AMX 1
#else
#define KILN_BF16_GEMM_AMX 0
#endif

namespace kiln_bf16 {

// Whether bf16_gemm takes these shapes: 32 weight rows a task, 32 k a tile row.
inline bool bf16_gemm_on_tiles(int64_t M, int64_t N, int64_t K) {
#if KILN_BF16_GEMM_AMX
  return M > 0 && N >= 32 && K >= 32 && K % 32 == 0 && kiln_int8::amx_ready();
#else
  (void)M, (void)N, (void)K;
  return false;
#endif
}

#if KILN_BF16_GEMM_AMX
// out [M, N] float32 (see the top of this file); x [M, K] float32 contiguous. The caller has
// checked bf16_gemm_on_tiles.
inline void bf16_gemm(const at::Tensor& x, const uint16_t* w, int64_t N, int64_t K,
                      const float* bias, float* out) {
  const int64_t M = x.size(0);
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();
  const int8_t* xbytes = static_cast<const int8_t*>(xb.data_ptr());
  const int8_t* wbytes = reinterpret_cast<const int8_t*>(w);
  const kiln_int8::BTiles b = kiln_int8::pack_b(xbytes, M, 2 * K);
  kiln_int8::amx_row_blocks<true>(wbytes, 2 * K, b.data(), M, N,
                                  kiln_int8::StoreAcc{reinterpret_cast<int32_t*>(out), N});
  // the last N % 32 weight rows (at most 31): float sums of the same bf16 products
  const auto* xh = static_cast<const c10::BFloat16*>(xb.data_ptr());
  const auto* wh = reinterpret_cast<const c10::BFloat16*>(w);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = N / 32 * 32; n < N; ++n) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += float(xh[m * K + k]) * float(wh[n * K + k]);
      out[m * N + n] = s;
    }
  if (bias)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) out[m * N + n] += bias[n];
}
#endif

}  // namespace kiln_bf16
