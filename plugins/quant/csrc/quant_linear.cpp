// CPU kernels for kiln::linear_int8 / int4 / fp8 / bf16 / fp32 (schemas: plugins/quant/ops.py,
// layouts: plugins/quant/formats.py). Registered for the CPU key, so they override the
// dequantize-then-matmul references once this library is loaded.
//
// Paths, all parallel over output channels (at::parallel_for; kiln::parallel_chunks at one
// row of x):
//   small M (decode, memory-bound): a GEMV that streams the packed weights once and
//     dequantizes 32 weights at a time in AVX2 registers, reused for up to 4 rows of x
//     (at one row of x, four weight rows at a time: gemv_row_group);
//     with AVX-512 VNNI, int8 (1-2 rows) and int4 (1-7 rows) decode in integers instead:
//     x as three int8 digits of fixed point against the codes on vpdpbusd (int8_dot.h);
//   large M (prefill / big batches, compute-bound): dequantize a tile of weight rows into
//     an fp32 scratch buffer that stays in L2, then at::mm on the tile (single-threaded
//     inside the parallel region).
// Without AVX2 the decoders fall back to scalar code (same results up to summation order).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../../csrc/parallel.h"
#include "../../csrc/prefetch.h"
#include "int8_dot.h"   // before the path macros below: they read KILN_INT8_DOT_VNNI
#include "int8_gemm.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KILN_QUANT_AVX2 1
#if KILN_INT8_GEMM_AMX
#define KILN_QUANT_PATH                                                                     \
  "avx2: 256-bit AVX2/FMA/F16C decoders, int8/int4 decode on avx512-vnni digits, int8 from " \
  "8 rows on amx tiles"
#elif KILN_INT8_DOT_VNNI
#define KILN_QUANT_PATH \
  "avx2: 256-bit AVX2/FMA/F16C decoders, int8/int4 decode on avx512-vnni digits"
#else
#define KILN_QUANT_PATH "avx2: 256-bit AVX2/FMA/F16C decoders"
#endif
#else
#define KILN_QUANT_AVX2 0
#define KILN_QUANT_PATH "scalar decoders"
#endif

// The code path these flags selected, read from the library's bytes by the builder
// (plugins/cpp_build.kernel_path): a vector ISA level that compiles to "scalar" fails the build.
extern "C" __attribute__((used, visibility("default")))
const char kiln_quant_kernel_path[] = "KILN_KERNEL_PATH:" KILN_QUANT_PATH;

namespace {

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

// ---- decoders: 32 weights of row n from k (k % 32 == 0), before the per-row scale ----

struct Int8Dec {
  const int8_t* q;
  int64_t K;
  static constexpr int64_t kBlockBytes = kBlock;
  const char* at(int64_t n, int64_t k) const { return reinterpret_cast<const char*>(q + n * K + k); }
  float row_scale(int64_t n) const { return scales[n]; }
  const float* scales;
  float tail(int64_t n, int64_t k) const { return float(q[n * K + k]); }
#if KILN_QUANT_AVX2
  inline void decode(int64_t n, int64_t k, vec w[4]) const {
    const int8_t* p = q + n * K + k;
    for (int j = 0; j < 4; ++j)
      w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j))));
  }
#endif
  inline void decode_scalar(int64_t n, int64_t k, float* w) const {
    for (int j = 0; j < kBlock; ++j) w[j] = float(q[n * K + k + j]);
  }
};

// fp8 E4M3 -> fp16 by bits: sign-extend the byte to 16 bits, shift left 7 (exponent and
// mantissa land in fp16's fields, the sign in bit 15), clear bit 14. The fp16 value is the
// E4M3 value * 2**-8 (exponent bias 15 vs 7), subnormals included; 256 goes into the scale.
struct Fp8Dec {
  const uint8_t* q;
  int64_t K;
  static constexpr int64_t kBlockBytes = kBlock;
  const char* at(int64_t n, int64_t k) const { return reinterpret_cast<const char*>(q + n * K + k); }
  const float* scales;
  float row_scale(int64_t n) const { return scales[n] * 256.0f; }
  float tail(int64_t n, int64_t k) const {
    return float(c10::Float8_e4m3fn(q[n * K + k], c10::Float8_e4m3fn::from_bits())) / 256.0f;
  }
#if KILN_QUANT_AVX2
  inline void decode(int64_t n, int64_t k, vec w[4]) const {
    const uint8_t* p = q + n * K + k;
    const __m256i mask = _mm256_set1_epi16(static_cast<int16_t>(0xBFFF));
    for (int h = 0; h < 2; ++h) {
      __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
      v = _mm256_and_si256(_mm256_slli_epi16(v, 7), mask);
      w[2 * h] = _mm256_cvtph_ps(_mm256_castsi256_si128(v));
      w[2 * h + 1] = _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1));
    }
  }
#endif
  inline void decode_scalar(int64_t n, int64_t k, float* w) const {
    for (int j = 0; j < kBlock; ++j) w[j] = tail(n, k + j);
  }
};

// bf16 -> float32 by bits: the 16 bits become the high half of a float32.
struct Bf16Dec {
  const uint16_t* q;
  int64_t K;
  static constexpr int64_t kBlockBytes = 2 * kBlock;
  const char* at(int64_t n, int64_t k) const { return reinterpret_cast<const char*>(q + n * K + k); }
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
  const char* at(int64_t n, int64_t k) const { return reinterpret_cast<const char*>(q + n * K + k); }
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

// int4: 16 bytes per 32 weights, byte j = q[j] | q[16 + j] << 4; w = q * s + m, m = -z * s.
struct Int4Dec {
  const uint8_t* q;
  int64_t K;
  static constexpr int64_t kBlockBytes = kBlock / 2;
  const char* at(int64_t n, int64_t k) const { return reinterpret_cast<const char*>(q + (n * K + k) / 2); }
  const float* scales;
  const float* zeros;
  int64_t G, NG;
  float row_scale(int64_t) const { return 1.0f; }
  float tail(int64_t, int64_t) const { return 0.0f; }  // K % 32 == 0: never called
#if KILN_QUANT_AVX2
  inline void decode(int64_t n, int64_t k, vec w[4]) const {
    const int64_t g = n * NG + k / G;
    const vec s = _mm256_set1_ps(scales[g]);
    const vec m = _mm256_set1_ps(-zeros[g] * scales[g]);
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (n * K + k) / 2));
    const __m128i nib = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, nib);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), s, m);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), s, m);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), s, m);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), s, m);
  }
#endif
  inline void decode_scalar(int64_t n, int64_t k, float* w) const {
    const int64_t g = n * NG + k / G;
    const float s = scales[g], m = -zeros[g] * scales[g];
    const uint8_t* p = q + (n * K + k) / 2;
    for (int j = 0; j < 16; ++j) {
      w[j] = float(p[j] & 0x0F) * s + m;
      w[16 + j] = float(p[j] >> 4) * s + m;
    }
  }
};

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

Prepared prepare(const at::Tensor& x, int64_t N, int64_t K, const c10::optional<at::Tensor>& bias,
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

void check_rows(const at::Tensor& t, int64_t N, const char* name, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), op, ": ", name,
              " must be contiguous float32");
  TORCH_CHECK(t.size(0) == N, op, ": ", name, " has ", t.size(0), " rows, expected ", N);
}

#if KILN_INT8_DOT_VNNI
// Decode rows of linear_int8 in integers: each row of x as three int8 digits (int8_dot.h's
// quantize_digits: x ~ sx (c0 + c1 / 128 + c2 / 128^2), 2.4e-7 max|x| off), the int8 weights
// times every digit on int8_dot.h's VNNI / AVX2 dot products, and
// y = sw * sum_j s_j * (w . c_j). Three integer dot products per weight instead of decoding
// each weight to float: the dequantize-to-fp32 GEMV ran compute-bound at about 21 GB/s of
// weights on a Zen 4 core pair, this one at 42-56 GB/s (bench/linear_kernels.py). Used on
// VNNI up to kInt8DigitsMaxM rows of x: SmolLM2's w13 streamed, 2 threads, Zen 4, this vs the
// float decoder: 1 row 39 vs 62 us, 2 rows 54 vs 58, 3 rows 82 vs 70, 4 rows 94 vs 80. On
// AVX2's vpmaddubsw it was no faster at 1 row (62 vs 61 us) and slower from 2.
constexpr int kXDigits = 3;
constexpr int64_t kInt8DigitsMaxM = 2;

// From kTileMinM rows of x (prefill, big batches) the same digits go as int8 rows [3M, K]
// through int8_gemm.h (AMX tiles at the amx level, else ATen's _int_mm: oneDNN's s8 GEMM):
// the same integers, no weight decoded to float. The dequantize-tile path it replaces
// ran 1.25-1.9x slower than fp32's own sgemm at 32 rows on an AVX-512/AMX Xeon (SmolLM2's
// shapes, weights in cache), so the int8 plan's batch-32 step was slower than the fp32 plan's.
at::Tensor int8_digits(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, const char* op) {
  const int64_t N = qweight.size(0), K = qweight.size(1);
  Prepared p = prepare(x, N, K, bias, op);
  const int64_t M = p.x.size(0);
  if (M == 0 || N == 0) return p.result(x);
  kiln_int8::QuantX qx = kiln_int8::quantize_digits(p.x.data_ptr<float>(), M, K, kXDigits);
  const float* sw = scales.data_ptr<float>();
  const float* b = p.bias.defined() ? p.bias.data_ptr<float>() : nullptr;
  float* y = p.out.data_ptr<float>();
  // y[m, n] from the integer sums of row m's digits with weight row n (acc[l * stride])
  auto combine = [&](int64_t m, int64_t n, const int32_t* acc, int64_t stride) {
    float v = 0.f;
    for (int l = 0; l < kXDigits; ++l) v += float(acc[l * stride]) * qx.s[m * kXDigits + l];
    y[m * N + n] = v * sw[n] + (b ? b[n] : 0.f);
  };
  if (M <= kInt8DigitsMaxM) {
    qx.finish();
    kiln_int8::dot_blocks(qx, qweight.data_ptr<int8_t>(), N,
                          [&](int64_t n0, int64_t nr, const int32_t* acc) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < nr; ++j)
          combine(m, n0 + j, acc + m * kXDigits * kiln_int8::kNB + j, kiln_int8::kNB);
    });
  } else {
    const at::Tensor acc =
        kiln_int8::int8_gemm(qx.q.data(), M * kXDigits, qweight.data_ptr<int8_t>(), N, K);
    const int32_t* a = acc.data_ptr<int32_t>();
    at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t n = 0; n < N; ++n) combine(m, n, a + m * kXDigits * N + n, N);
    });
  }
  return p.result(x);
}

#endif

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias) {
  const char* op = "kiln::linear_int8";
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              op, ": qweight must be contiguous int8 [N, K]");
  const int64_t N = qweight.size(0), K = qweight.size(1);
  check_rows(scales, N, "scales", op);
#if KILN_INT8_DOT_VNNI
  // (_int_mm from kTileMinM rows, not for a weight under 8 rows or columns: oneDNN misreads
  // the strides of its transpose)
  if (x.dim() == 2 && K < 66000 &&
      (x.size(0) <= kInt8DigitsMaxM || (x.size(0) >= kTileMinM && K >= 8 && N >= 8)))
    return int8_digits(x, qweight, scales, bias, op);
#endif
  Int8Dec d{qweight.data_ptr<int8_t>(), K, scales.data_ptr<float>()};
  return run(d, x, N, K, bias, op);
}

at::Tensor linear_fp8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& bias) {
  const char* op = "kiln::linear_fp8";
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() &&
                  (qweight.scalar_type() == at::kFloat8_e4m3fn || qweight.scalar_type() == at::kByte),
              op, ": qweight must be contiguous float8_e4m3fn (or its uint8 bits) [N, K]");
  const int64_t N = qweight.size(0), K = qweight.size(1);
  check_rows(scales, N, "scales", op);
  Fp8Dec d{static_cast<const uint8_t*>(qweight.data_ptr()), K, scales.data_ptr<float>()};
  return run(d, x, N, K, bias, op);
}

at::Tensor linear_fp32(const at::Tensor& x, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias) {
  const char* op = "kiln::linear_fp32";
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              op, ": weight must be contiguous float32 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  if (x.dim() == 2 && x.size(0) >= kTileMinM) {   // compute-bound: BLAS as it is
    Prepared p = prepare(x, N, K, bias, op);
    if (p.bias.defined())
      at::addmm_out(p.out, p.bias, p.x, weight.t());
    else
      at::mm_out(p.out, p.x, weight.t());
    return p.result(x);
  }
  F32Dec d{weight.data_ptr<float>(), K};
  return run(d, x, N, K, bias, op);
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias) {
  const char* op = "kiln::linear_bf16";
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              op, ": weight must be contiguous bfloat16 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  Bf16Dec d{static_cast<const uint16_t*>(weight.data_ptr()), K};
  return run(d, x, N, K, bias, op);
}

#if KILN_INT8_DOT_VNNI
// Decode rows of linear_int4 on VNNI, in integers: w = (q - z) s per group, so
//   y = sum_g s_g sum_k q_k x_k - sum_g s_g z_g X_g   (X_g: the group's exact sum of x).
// x is held as three digits of fixed point (int8_dot.h's quantize_digits: x ~ sx (c0 + c1 /
// 128 + c2 / 128^2), 2.4e-7 of max|x| off). The codes q (u8, 0..15) go straight into vpdpbusd
// against each digit, and the digits combine in the int32 lanes, (d0 << 14) + (d1 << 7) + d2
// (|d0| <= 4 * 15 * 127, so under 2^27): three vpdpbusd and two shifts per 64 weights, no
// decode to float; each lane is then scaled by its group's s in float. 64 weights a step:
// their 32 packed bytes broadcast to both halves of a register, the upper half shifted down
// a nibble, so the codes come in the order [0..15, 32..47, 16..31, 48..63] of the step, the
// order the digits of x are stored in. SmolLM2's w13 streamed, 2 threads, Zen 4, this vs the
// float decoder: 1 row of x 36 vs 82 us, 2 rows 63 vs 72, 3 rows 76 vs 85, 4 rows 101 vs 100,
// 7 rows 147 vs 178 (used below kTileMinM rows).
// The scales of groups g, g + 1 (G = 32) for the lanes of one 64-weight step (lanes_group:
// which of the two each lane's products belong to).
inline __m512 two_group_scales(const float* s, __m512i lanes_group) {
  const __m128 pair = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(s)));
  return _mm512_permutexvar_ps(lanes_group, _mm512_castps128_ps512(pair));
}

template <int R>
inline void int4_digits_rows(const Int4Dec& d, const kiln_int8::QuantX& x, const float* xg,
                             int64_t r0, int64_t n, const float* bias, float* out, int64_t ldo) {
  const int64_t K = d.K, G = d.G, NG = d.NG;
  const int gshift = G == 32 ? 5 : G == 64 ? 6 : 7;   // k / G without a division (G: 32, 64, 128)
  const uint8_t* p = d.q + n * K / 2;
  const float* sc = d.scales + n * NG;
  const float* zr = d.zeros + n * NG;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i lanes_group = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 64) {
    const __m512i b =
        _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k / 2)));
    const __m512i q = _mm512_and_si512(_mm512_mask_srli_epi16(b, 0xFFFF0000u, b, 4), nib);
    const __m512 s = G == 32 ? two_group_scales(sc + (k >> 5), lanes_group)
                             : _mm512_set1_ps(sc[k >> gshift]);    // G >= 64: one group
    for (int r = 0; r < R; ++r) {
      const int8_t* c = x.q.data() + (r0 + r) * kXDigits * K + k;
      __m512i acc_i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, _mm512_loadu_si512(c));
      for (int j = 1; j < kXDigits; ++j)
        acc_i = _mm512_dpbusd_epi32(_mm512_slli_epi32(acc_i, kiln_int8::kDigitBits), q,
                                    _mm512_loadu_si512(c + j * K));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc_i), s, acc[r]);
    }
  }
  // y = s_last * sum(acc) - sum_g (s_g z_g) X_g with one horizontal sum per row of x (s_last,
  // the last digit's scale, is one unit of the combined lanes)
  for (int r = 0; r < R; ++r)
    acc[r] = _mm512_mul_ps(acc[r], _mm512_set1_ps(x.s[(r0 + r) * kXDigits + kXDigits - 1]));
  for (int64_t g = 0; g < NG; g += 16) {
    const __mmask16 mk = NG - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (NG - g)) - 1);
    const __m512 sz =
        _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, sc + g), _mm512_maskz_loadu_ps(mk, zr + g));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fnmadd_ps(sz, _mm512_maskz_loadu_ps(mk, xg + (r0 + r) * NG + g), acc[r]);
  }
  const float bn = bias ? bias[n] : 0.0f;
  for (int r = 0; r < R; ++r) out[(r0 + r) * ldo + n] = _mm512_reduce_add_ps(acc[r]) + bn;
}

at::Tensor int4_digits_gemv(const Int4Dec& d, const at::Tensor& x, int64_t N,
                            const c10::optional<at::Tensor>& bias, const char* op) {
  const int64_t K = d.K;
  Prepared p = prepare(x, N, K, bias, op);
  const int64_t M = p.x.size(0);
  if (M == 0 || N == 0) return p.result(x);
  const float* xp = p.x.data_ptr<float>();
  const kiln_int8::QuantX xd = kiln_int8::quantize_digits(xp, M, K, kXDigits, /*permute64=*/true);
  std::vector<float> xg(M * d.NG, 0.0f);   // sums of x per group
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < d.NG; ++g) {
      const float* xk = xp + m * K + g * d.G;
      float sum = 0.0f;
      for (int64_t i = 0; i < d.G; ++i) sum += xk[i];
      xg[m * d.NG + g] = sum;
    }
  const float* b = p.bias.defined() ? p.bias.data_ptr<float>() : nullptr;
  float* y = p.out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(8, 32768 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t r = 0; r < M; r += 4) {
        switch (std::min<int64_t>(4, M - r)) {
          case 4: int4_digits_rows<4>(d, xd, xg.data(), r, n, b, y, N); break;
          case 3: int4_digits_rows<3>(d, xd, xg.data(), r, n, b, y, N); break;
          case 2: int4_digits_rows<2>(d, xd, xg.data(), r, n, b, y, N); break;
          default: int4_digits_rows<1>(d, xd, xg.data(), r, n, b, y, N); break;
        }
      }
  });
  return p.result(x);
}
#endif

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& zeros, int64_t group_size,
                       const c10::optional<at::Tensor>& bias) {
  const char* op = "kiln::linear_int4";
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              op, ": qweight must be contiguous uint8 [N, K/2]");
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  TORCH_CHECK(group_size == 32 || group_size == 64 || group_size == 128, op,
              ": group_size must be 32, 64 or 128, got ", group_size);
  TORCH_CHECK(K % group_size == 0, op, ": group_size ", group_size, " does not divide K=", K);
  check_rows(scales, N, "scales", op);
  check_rows(zeros, N, "zeros", op);
  TORCH_CHECK(scales.numel() == N * (K / group_size) && zeros.numel() == scales.numel(), op,
              ": scales/zeros must be [N, K/group_size] = [", N, ", ", K / group_size, "]");
  Int4Dec d{qweight.data_ptr<uint8_t>(), K, scales.data_ptr<float>(), zeros.data_ptr<float>(),
            group_size, K / group_size};
#if KILN_INT8_DOT_VNNI
  if (x.dim() == 2 && x.size(0) < kTileMinM && K % 64 == 0 && K < 66000)
    return int4_digits_gemv(d, x, N, bias, op);
#endif
  return run(d, x, N, K, bias, op);
}

}  // namespace

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("linear_int8", &linear_int8);
  m.impl("linear_int4", &linear_int4);
  m.impl("linear_fp8", &linear_fp8);
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_fp32", &linear_fp32);
}


// ---- AOTInductor C shims (plugins/csrc/aoti_shim.h) ------------------------------------------
#include "../../csrc/aoti_shim.h"

KILN_LINEAR_SHIM_2(linear_int8)
KILN_LINEAR_SHIM_2(linear_fp8)
KILN_LINEAR_SHIM_1(linear_bf16)
KILN_LINEAR_SHIM_1(linear_fp32)

KILN_AOTI_SHIM aoti_torch_cpu_linear_int4(AtenTensorHandle x, AtenTensorHandle qweight,
                                          AtenTensorHandle scales, AtenTensorHandle zeros,
                                          int64_t group_size, AtenTensorHandle* bias,
                                          AtenTensorHandle* ret0) {
  using kiln_shim::T;
  using kiln_shim::tensor;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    static const auto op =
        kiln_shim::op<at::Tensor(T, T, T, T, int64_t, kiln_shim::Opt)>("kiln::linear_int4");
    *ret0 = kiln_shim::result(op.call(tensor(x), tensor(qweight), tensor(scales), tensor(zeros),
                                      group_size, kiln_shim::optional(bias)));
  });
}
