// The decode-then-multiply paths of the CPU linears whose weights are decoded to float on
// the fly: linear_float.cpp (kiln::linear_fp32 / linear_bf16) and linear_weight_only.cpp
// (kiln::linear_int8 / int4 / fp8). Each file gives a decoder of its weight format (Dec: 32
// weights of row n from k into four vectors, before the row's scale) and runs it here.
//
// Paths, all parallel over output channels (at::parallel_for; kiln::parallel_chunks at one
// row of x):
//   small M (decode, memory-bound): a GEMV that streams the packed weights once and
//     dequantizes 32 weights at a time in AVX2 registers, reused for up to 4 rows of x
//     (at one row of x, four weight rows at a time: gemv_row_group);
//     (with AVX-512 VNNI, linear_weight_only.cpp's int8 and int4 multiply in integers
//     instead, x held as int8 digits);
//   large M (prefill / big batches, compute-bound): dequantize a tile of weight rows into
//     an fp32 scratch buffer that stays in L2, then at::mm on the tile (single-threaded
//     inside the parallel region).
// Without AVX2 the decoders fall back to scalar code (same results up to summation order).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "../../csrc/parallel.h"
#include "../../csrc/prefetch.h"
#include "int8_dot.h"   // before the path macros below: they read KILN_INT8_DOT_VNNI
#include "bf16_gemm.h"   // and int8_gemm.h
#include "bf16_dot.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KILN_QUANT_AVX2 1
// "bf16 from 8 rows": kiln::linear_bf16 rounds x to bf16 from 8 rows (builder/compile.py and
// the tests read this phrase)
#if KILN_BF16_GEMM_AMX
#define KILN_QUANT_BF16_PATH ", bf16 from 8 rows on amx-bf16 tiles"
#elif KILN_BF16_DOT
#define KILN_QUANT_BF16_PATH ", bf16 from 8 rows on avx512-bf16 vdpbf16ps"
#else
#define KILN_QUANT_BF16_PATH ""
#endif
#if KILN_INT8_GEMM_AMX
#define KILN_QUANT_PATH                                                                     \
  "avx2: 256-bit AVX2/FMA/F16C decoders, int8/int4 decode on avx512-vnni digits, int8 from " \
  "8 rows on amx tiles" KILN_QUANT_BF16_PATH
#elif KILN_INT8_DOT_VNNI
#define KILN_QUANT_PATH                                                                   \
  "avx2: 256-bit AVX2/FMA/F16C decoders, int8/int4 decode on avx512-vnni digits" \
  KILN_QUANT_BF16_PATH
#else
#define KILN_QUANT_PATH "avx2: 256-bit AVX2/FMA/F16C decoders"
#endif
#else
#define KILN_QUANT_AVX2 0
#define KILN_QUANT_PATH "scalar decoders"
#endif

// The library's code path (KILN_QUANT_PATH) is embedded once, by linear_weight_only.cpp.

namespace kiln_gemv {

constexpr int64_t kBlock = 32;     // weights decoded per step
// The GEMV's weights are also prefetched into L1 kGemvNear bytes ahead, on top of the far L2
// prefetch (plugins/csrc/prefetch.h): the fp32 plan's batch-1 step (519 MiB, never in cache),
// 4 alternating pairs on an Intel Xeon (AMX, 2 threads): 30.9 -> 27.6 ms right after a 1 GiB
// read, 29.0 -> 24.0 back to back (12 KiB ahead: the same).
constexpr int64_t kGemvNear = 4096;
constexpr int64_t kTileMinM = 8;   // rows of x from which the dequantize-tile path is used
constexpr int64_t kMaxRows = 4;    // rows of x sharing one decoded weight vector (GEMV)

#if KILN_QUANT_AVX2
using vec = __m256;
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// ---- GEMV: out[r, n] = row_scale(n) * sum_k w[n, k] x[r, k] (+ bias[n]), r < R ----

// Output n for one row of x from its sum over the first K32 weights: the K % 32 tail, the
// weight row's scale and the bias.
template <class Dec>
inline float finish_row(const Dec& d, const float* x, int64_t K32, int64_t K, int64_t n,
                        float sum, const float* bias) {
  for (int64_t k = K32; k < K; ++k) sum += d.tail(n, k) * x[k];
  return sum * d.row_scale(n) + (bias ? bias[n] : 0.0f);
}

#if KILN_QUANT_AVX2
// Each line of the weights of row n's block at k, once: 64 KiB ahead into L2, kGemvNear
// ahead into L1.
template <class Dec>
inline void prefetch_block(const Dec& d, int64_t n, int64_t k) {
  const char* p = d.at(n, k);
  if (Dec::kBlockBytes >= 64 || (reinterpret_cast<uintptr_t>(p) & 63) < Dec::kBlockBytes)
    for (int64_t b = 0; b < Dec::kBlockBytes; b += 64) {
      kiln::prefetch_far(p + b);
      _mm_prefetch(p + b + kGemvNear, _MM_HINT_T0);
    }
}

// One row of x against weight rows n .. n + 3 (decode at batch 1): each row's decoded
// weights go straight into two FMA chains of its own, x is loaded once for the four rows,
// and one horizontal reduction gives the four sums. gemv_rows<1> on one weight row at a time
// ran compute-bound at 3.3 int8 weights a cycle on an Intel Xeon core (AVX2 code, SmolLM2's
// shapes, weights in cache, one thread: its hsum and loop set-up per 576-weight row, x loaded
// again per row); this at 5.1-5.7 (eight rows with one chain each: 4.5-5.1). The AVX2 int8
// plan's batch-1 step: 6.59 -> 4.88 ms back to back, 8.25 -> 7.05 after a 1 GiB read.
constexpr int64_t kRowGroup = 4;

template <class Dec>
inline void gemv_row_group(const Dec& d, const float* x, int64_t K, int64_t n, const float* bias,
                           float* out) {
  const int64_t K32 = K - K % kBlock;
  vec acc[kRowGroup][2];
  for (int i = 0; i < kRowGroup; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K32; k += kBlock) {
    for (int i = 0; i < kRowGroup; ++i) prefetch_block(d, n + i, k);
    vec xv[4];
    for (int j = 0; j < 4; ++j) xv[j] = _mm256_loadu_ps(x + k + 8 * j);
    for (int i = 0; i < kRowGroup; ++i) {
      vec w[4];
      d.decode(n + i, k, w);
      for (int j = 0; j < 4; ++j) acc[i][j & 1] = _mm256_fmadd_ps(w[j], xv[j], acc[i][j & 1]);
    }
  }
  // [s0 s1 s2 s3] from the four rows' 8-lane sums: two rounds of pairwise adds, then the lanes
  const __m256 h01 = _mm256_hadd_ps(_mm256_add_ps(acc[0][0], acc[0][1]),
                                    _mm256_add_ps(acc[1][0], acc[1][1]));
  const __m256 h23 = _mm256_hadd_ps(_mm256_add_ps(acc[2][0], acc[2][1]),
                                    _mm256_add_ps(acc[3][0], acc[3][1]));
  const __m256 h = _mm256_hadd_ps(h01, h23);
  float sums[kRowGroup];
  _mm_storeu_ps(sums, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  for (int i = 0; i < kRowGroup; ++i) out[n + i] = finish_row(d, x, K32, K, n + i, sums[i], bias);
}
#endif

template <int R, class Dec>
inline void gemv_rows(const Dec& d, const float* x, int64_t K, int64_t n, const float* bias,
                      float* out, int64_t ldo) {
  const int64_t K32 = K - K % kBlock;
  float sums[R];
#if KILN_QUANT_AVX2
  constexpr int NA = R == 1 ? 4 : 2;  // independent FMA chains per row of x
  vec acc[R][NA];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < NA; ++a) acc[r][a] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K32; k += kBlock) {
    prefetch_block(d, n, k);
    vec w[4];
    d.decode(n, k, w);
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < R; ++r)
        acc[r][j % NA] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + r * K + k + 8 * j),
                                         acc[r][j % NA]);
  }
  for (int r = 0; r < R; ++r) {
    vec a = acc[r][0];
    for (int i = 1; i < NA; ++i) a = _mm256_add_ps(a, acc[r][i]);
    sums[r] = hsum(a);
  }
#else
  for (int r = 0; r < R; ++r) sums[r] = 0.0f;
  float w[kBlock];
  for (int64_t k = 0; k < K32; k += kBlock) {
    d.decode_scalar(n, k, w);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kBlock; ++j) sums[r] += w[j] * x[r * K + k + j];
  }
#endif
  for (int r = 0; r < R; ++r) out[r * ldo + n] = finish_row(d, x + r * K, K32, K, n, sums[r], bias);
}

template <class Dec>
void gemv(const Dec& d, const float* x, int64_t M, int64_t K, int64_t N, const float* bias,
          float* out) {
#if KILN_QUANT_AVX2
  if (M == 1) {    // groups of kRowGroup weight rows; a last N % kRowGroup one at a time
    // chunks of ~16 KiB of weights, at least 4 a thread (plugins/csrc/parallel.h: a thread
    // preempted by the server's other threads leaves its chunks to the rest)
    const int64_t groups = (N + kRowGroup - 1) / kRowGroup;
    const int64_t group_bytes = kRowGroup * (K / kBlock) * Dec::kBlockBytes;
    kiln::parallel_chunks(groups, kiln::chunk_items(groups, group_bytes, 16 << 10),
                          [&](int64_t g0, int64_t g1) {
      for (int64_t n = g0 * kRowGroup; n < std::min(N, g1 * kRowGroup); n += kRowGroup) {
        if (n + kRowGroup <= N)
          gemv_row_group(d, x, K, n, bias, out);
        else
          for (int64_t r = n; r < N; ++r) gemv_rows<1>(d, x, K, r, bias, out, N);
      }
    });
    return;
  }
#endif
  const int64_t grain = std::max<int64_t>(8, 32768 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t r = 0; r < M; r += kMaxRows) {
        const float* xr = x + r * K;
        float* o = out + r * N;
        switch (std::min<int64_t>(kMaxRows, M - r)) {
          case 4: gemv_rows<4>(d, xr, K, n, bias, o, N); break;
          case 3: gemv_rows<3>(d, xr, K, n, bias, o, N); break;
          case 2: gemv_rows<2>(d, xr, K, n, bias, o, N); break;
          default: gemv_rows<1>(d, xr, K, n, bias, o, N); break;
        }
      }
    }
  });
}

// ---- tile path: dequantize rows [n0, n0 + nt) to fp32, then at::mm ----

template <class Dec>
void dequant_rows(const Dec& d, int64_t K, int64_t n0, int64_t nt, float* dst) {
  const int64_t K32 = K - K % kBlock;
  for (int64_t i = 0; i < nt; ++i) {
    const int64_t n = n0 + i;
    float* row = dst + i * K;
    const float rs = d.row_scale(n);
#if KILN_QUANT_AVX2
    const vec vs = _mm256_set1_ps(rs);
    for (int64_t k = 0; k < K32; k += kBlock) {
      vec w[4];
      d.decode(n, k, w);
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(row + k + 8 * j, _mm256_mul_ps(w[j], vs));
    }
#else
    for (int64_t k = 0; k < K32; k += kBlock) {
      d.decode_scalar(n, k, row + k);
      for (int j = 0; j < kBlock; ++j) row[k + j] *= rs;
    }
#endif
    for (int64_t k = K32; k < K; ++k) row[k] = d.tail(n, k) * rs;
  }
}

template <class Dec>
void tiled(const Dec& d, const at::Tensor& x, int64_t K, int64_t N, const float* bias,
           at::Tensor& out) {
  const int64_t M = x.size(0);
  // A tile of about 192 KiB of fp32 weights: stays in L2 while at::mm reads it.
  const int64_t nt_max = std::max<int64_t>(16, (49152 / std::max<int64_t>(K, 1)) / 16 * 16);
  const int64_t ntiles = (N + nt_max - 1) / nt_max;
  at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
    at::Tensor wbuf = at::empty({nt_max, K}, x.options());
    at::Tensor obuf = at::empty({M * nt_max}, x.options());
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * nt_max, nt = std::min(nt_max, N - n0);
      dequant_rows(d, K, n0, nt, wbuf.data_ptr<float>());
      at::Tensor o = obuf.narrow(0, 0, M * nt).view({M, nt});  // contiguous [M, nt]
      at::mm_out(o, x, wbuf.narrow(0, 0, nt).t());
      const float* op = obuf.data_ptr<float>();
      float* dst = out.data_ptr<float>();
      for (int64_t r = 0; r < M; ++r)
        for (int64_t i = 0; i < nt; ++i)
          dst[r * N + n0 + i] = op[r * nt + i] + (bias ? bias[n0 + i] : 0.0f);
    }
  });
}

// ---- op entry points ----

struct Prepared {
  at::Tensor x;     // [M, K] float32 contiguous
  at::Tensor out;   // [M, N] float32
  at::Tensor bias;  // [N] float32 contiguous, or undefined

  // What the op returns: out in the dtype of the caller's x.
  at::Tensor result(const at::Tensor& x_in) const {
    return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
  }
};

inline Prepared prepare(const at::Tensor& x, int64_t N, int64_t K, const c10::optional<at::Tensor>& bias,
                 const char* op) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be [M, K], got ", x.sizes());
  TORCH_CHECK(x.size(1) == K, op, ": x has K=", x.size(1), " but the weight has K=", K);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  Prepared p;
  p.x = x.to(at::kFloat).contiguous();
  p.out = at::empty({x.size(0), N}, p.x.options());
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, op, ": bias has ", bias->numel(), " elements, expected ", N);
    p.bias = bias->to(at::kFloat).contiguous();
  }
  return p;
}

template <class Dec>
at::Tensor run(const Dec& d, const at::Tensor& x, int64_t N, int64_t K,
               const c10::optional<at::Tensor>& bias, const char* op) {
  Prepared p = prepare(x, N, K, bias, op);
  const float* b = p.bias.defined() ? p.bias.data_ptr<float>() : nullptr;
  const int64_t M = p.x.size(0);
  if (M > 0 && N > 0) {
    if (M >= kTileMinM)
      tiled(d, p.x, K, N, b, p.out);
    else
      gemv(d, p.x.data_ptr<float>(), M, K, N, b, p.out.data_ptr<float>());
  }
  return p.result(x);
}

inline void check_rows(const at::Tensor& t, int64_t N, const char* name, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), op, ": ", name,
              " must be contiguous float32");
  TORCH_CHECK(t.size(0) == N, op, ": ", name, " has ", t.size(0), " rows, expected ", N);
}

}  // namespace kiln_gemv
