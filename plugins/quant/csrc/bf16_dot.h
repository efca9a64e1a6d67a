// The bf16 GEMM behind kiln::linear_bf16's batched rows on AVX-512 BF16 without AMX tiles
// (the `avx512_bf16` level, e.g. AMD Zen 4):
//
//   out[m, n] = sum_k bf16(x[m, k]) * w[n, k] (+ bias[n])   x: [M, K] float32, w: [N, K] bf16,
//                                                            out: [M, N] float32
//
// with vdpbf16ps (32 products of bf16 pairs a vector, summed in float32): the plan computes in
// bf16, as its precision says and as the AMX path (bf16_gemm.h) does. x is rounded to bf16
// (to nearest even) once per call; the weights are read as they are stored, [N, K]. Work: 4
// weight rows x up to 4 rows of x a register tile, each sum a vector over k reduced at the
// end (int8_dot.h's arrangement), parallel over chunks of weight rows; each panel of x (rows
// that fit in L2) passes over a chunk's weights, so weights come from memory once per call and
// from L2 once per further panel. A row's result is the same whichever tile or panel it is
// computed in: its sums run in one fixed order.
#pragma once

#include <ATen/ATen.h>

#include "../../csrc/hsum4.h"
#include "../../csrc/parallel.h"
#include "../../csrc/prefetch.h"

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KILN_BF16_DOT 1
#else
#define KILN_BF16_DOT 0
#endif

namespace kiln_bf16 {

#if KILN_BF16_DOT
constexpr int64_t kDotNB = 4;   // weight rows per tile
constexpr int64_t kDotMB = 4;   // rows of x per tile
constexpr int64_t kDotPrefetch = 8192;   // bytes ahead in each weight row's stream

inline float bf16_value(uint16_t h) { return float(c10::BFloat16(h, c10::BFloat16::from_bits())); }

// acc[r][j] = sum_k xb[m0 + r, k] * w[n0 + j, k] for r < MR, j < 4
template <int MR>
inline void tile_dpbf16(const uint16_t* xb, const uint16_t* w, int64_t K, const uint16_t* last,
                        int64_t m0, int64_t n0, float acc[kDotMB][kDotNB]) {
  const int64_t K32 = K - K % 32;
  __m512 a[MR][kDotNB];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < kDotNB; ++j) a[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K32; k += 32) {
    __m512bh wv[kDotNB];
    for (int j = 0; j < kDotNB; ++j) {
      const uint16_t* p = w + (n0 + j) * K + k;
      _mm_prefetch(reinterpret_cast<const char*>(std::min(p + kDotPrefetch / 2, last)),
                   _MM_HINT_T0);
      kiln::prefetch_far(p);
      wv[j] = (__m512bh)_mm512_loadu_si512(p);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + (m0 + r) * K + k);
      for (int j = 0; j < kDotNB; ++j) a[r][j] = _mm512_dpbf16_ps(a[r][j], xv, wv[j]);
    }
  }
  alignas(16) float s[MR][4];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
    _mm_store_ps(s[r], kiln::hsum4_ps(a[r][0], a[r][1], a[r][2], a[r][3]));
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < kDotNB; ++j) {
      float t = s[r][j];
      for (int64_t k = K32; k < K; ++k)
        t += bf16_value(xb[(m0 + r) * K + k]) * bf16_value(w[(n0 + j) * K + k]);
      acc[r][j] = t;
    }
}

// out[m, n0..n1) of rows of weights past the tiles' blocks: one float sum a row in k order.
inline void scalar_rows(const uint16_t* xb, const uint16_t* w, int64_t M, int64_t K, int64_t n0,
                        int64_t n1, const float* bias, float* out, int64_t N) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += bf16_value(xb[m * K + k]) * bf16_value(w[n * K + k]);
      out[m * N + n] = bias ? s + bias[n] : s;
    }
}

// out [M, N] float32 (see the top of this file); x [M, K] float32 contiguous.
inline void bf16_dot_gemm(const at::Tensor& x, const uint16_t* w, int64_t N, int64_t K,
                          const float* bias, float* out) {
  const int64_t M = x.size(0);
  const at::Tensor xt = x.to(at::kBFloat16).contiguous();
  const auto* xb = static_cast<const uint16_t*>(xt.data_ptr());
  const uint16_t* last = w + N * K - 1;
  const int64_t nblocks = (N + kDotNB - 1) / kDotNB;
  // chunks of ~32 KiB of weights (they stay in L2 while the panels of x pass), at least 4 a
  // thread (plugins/csrc/parallel.h)
  const int64_t chunk = kiln::chunk_items(nblocks, 2 * kDotNB * K, 32 << 10);
  // rows of x a panel: about 256 KiB of bf16 (a whole number of tiles)
  const int64_t panel =
      std::max<int64_t>(kDotMB, (128 << 10) / std::max<int64_t>(K, 1) / kDotMB * kDotMB);
  kiln::parallel_chunks(nblocks, chunk, [&](int64_t b0, int64_t b1) {
    float t[kDotMB][kDotNB];
    if (b1 * kDotNB > N)   // the last partial block of weight rows (N % 4): scalar
      scalar_rows(xb, w, M, K, N / kDotNB * kDotNB, N, bias, out, N);
    // whole blocks: panels of x that stay in L2, each passing over the chunk's weight rows
    const int64_t b1w = std::min(b1, N / kDotNB);
    for (int64_t p0 = 0; p0 < M; p0 += panel)
      for (int64_t nb = b0; nb < b1w; ++nb) {
        const int64_t n0 = nb * kDotNB, p1 = std::min(M, p0 + panel);
        for (int64_t m0 = p0; m0 < p1; m0 += kDotMB) {
          const int64_t mr = std::min(kDotMB, M - m0);
          switch (mr) {
            case 4: tile_dpbf16<4>(xb, w, K, last, m0, n0, t); break;
            case 3: tile_dpbf16<3>(xb, w, K, last, m0, n0, t); break;
            case 2: tile_dpbf16<2>(xb, w, K, last, m0, n0, t); break;
            default: tile_dpbf16<1>(xb, w, K, last, m0, n0, t); break;
          }
          for (int64_t r = 0; r < mr; ++r)
            for (int64_t j = 0; j < kDotNB; ++j)
              out[(m0 + r) * N + n0 + j] = bias ? t[r][j] + bias[n0 + j] : t[r][j];
        }
      }
  });
}
#endif

}  // namespace kiln_bf16
