// CPU kernels of the weight-only quantized linears kiln::linear_int8 / int4 / fp8 (schemas
// and references: plugins/quant/ops.py, layouts: plugins/quant/formats.py): x stays float,
// the weights are decoded on the fly (dequant_gemv.h's GEMV and tile paths) or, on AVX-512
// VNNI, multiplied in integers against x held as int8 digits (below). Registered for the CPU
// key, so they override the dequantize-then-matmul references once this library is loaded.
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <vector>

#include "dequant_gemv.h"

// The code path these flags selected, read from the library's bytes by the builder
// (plugins/cpp_build.kernel_path): a vector ISA level that compiles to "scalar" fails the build.
extern "C" __attribute__((used, visibility("default")))
const char kiln_quant_kernel_path[] = "KILN_KERNEL_PATH:" KILN_QUANT_PATH;

namespace {

using namespace kiln_gemv;

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
}


// ---- AOTInductor C shims (plugins/csrc/aoti_shim.h) ------------------------------------------
#include "../../csrc/aoti_shim.h"

KILN_LINEAR_SHIM_2(linear_int8)
KILN_LINEAR_SHIM_2(linear_fp8)

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
