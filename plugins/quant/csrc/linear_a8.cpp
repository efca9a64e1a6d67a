// CPU kernel of kiln::linear_int8_a8 (W8A8; schema and reference: plugins/quant/ops.py).
//
//   y[m, n] = sx[m] * sw[n] * sum_k xq[m, k] * wq[n, k]  (+ bias[n])
//   xq = round_half_even(x / sx), sx = max|x[m]| / 127 (per row, at run time);
//   wq, sw: the int8 per-output-channel weights of linear_int8.
//
// The dot products are integer (exact in int32: K * 255 * 127 < 2^31 for K < 66,000), on
// the widest int8 instructions the compile flags allow:
//   AVX-512 VNNI: vpdpbusd (u8 x s8 -> s32, 64 products per instruction). The weights are
//     offset to u8 (wq ^ 0x80) as they load; the 128 * sum_k xq[m, k] this adds is removed
//     with one sum per row of x.
//   AVX2 (also the avx512 level without VNNI): vpmaddubsw on |xq| (u8) and wq with xq's sign
//     (vpsignb; |products| <= 2 * 127 * 127, no saturation), then vpmaddwd into s32.
//   otherwise: scalar int32 loops (same integers, same result).
// Work: 4 weight rows x up to 4 rows of x per register tile, parallel over weight rows; the
// weight tile stays in L1 while every row block of x passes over it, so weights are read
// from memory once per call whatever M is.
// From kIntMmMinM rows of x on, the integer GEMM is ATen's _int_mm (oneDNN's s8 GEMM, which
// picks VNNI/AMX micro-kernels for the machine it runs on): measured on SmolLM2's w13
// (3072 x 576), 2 threads, AVX-512 VNNI host: M=1 this kernel 17 us vs 83 us; M=4 48 vs 41;
// M=32 244 vs 86 (bench_results/w8a8_vs_libraries.log). Both give the same integers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KILN_A8_PATH "w8a8: avx512-vnni vpdpbusd"
#define KILN_A8_VNNI 1
#define KILN_A8_AVX2 0
#elif defined(__AVX2__)
#include <immintrin.h>
#define KILN_A8_PATH "w8a8: avx2 vpmaddubsw"
#define KILN_A8_VNNI 0
#define KILN_A8_AVX2 1
#else
#define KILN_A8_PATH "w8a8: scalar"
#define KILN_A8_VNNI 0
#define KILN_A8_AVX2 0
#endif

extern "C" __attribute__((used, visibility("default")))
const char kiln_quant_a8_kernel_path[] = "KILN_KERNEL_PATH:" KILN_A8_PATH;

namespace {

constexpr int64_t kNB = 4;   // weight rows per tile
constexpr int64_t kMB = 4;   // rows of x per tile
constexpr int64_t kIntMmMinM = 4;

// Per-row symmetric int8 quantization of x [M, K]: q = round_half_even(x / s), s = max|x|/127
// (s = 1 for an all-zero row). Same arithmetic as the reference in ops.py.
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* s) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
    const float sc = amax > 0.f ? amax / 127.f : 1.f;
    s[m] = sc;
    int8_t* qr = q + m * K;
    for (int64_t k = 0; k < K; ++k) {
      const float v = std::nearbyint(xr[k] / sc);
      qr[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
    }
  }
}

// acc[r][j] = sum_k xq[m0 + r, k] * wq[n0 + j, k] for r < mr, j < nr.
struct Tile {
  const int8_t* xq;    // [M, K] quantized activations
  const uint8_t* xu;   // [M, K] |xq| (AVX2 only)
  const int32_t* xsum; // [M] sum of xq[m, :K - K % 64] (VNNI only)
  const int8_t* wq;    // [N, K]
  int64_t K;
};

inline int32_t dot_scalar(const int8_t* a, const int8_t* b, int64_t k0, int64_t K) {
  int32_t s = 0;
  for (int64_t k = k0; k < K; ++k) s += int32_t(a[k]) * int32_t(b[k]);
  return s;
}

#if KILN_A8_VNNI
// The four horizontal sums of a0..a3 as one vector [s0, s1, s2, s3]: a transpose-and-add
// tree (about a third of the instructions of four separate reductions).
inline __m128i hsum4x512(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
  const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
  const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
  // each 128-bit lane now holds [a0, a1, a2, a3] partial sums
  const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
  const __m256i v = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

// The weights go in as the unsigned operand, offset by 128 (w ^ 0x80 = w + 128 in u8), and
// x as the signed one: sum_k (w + 128) x = sum_k w x + 128 sum_k x, so one sum of x per row
// of x (t.xsum) removes the offset. (Offsetting x instead needs the weight rows' sums, one
// more vpdpbusd per weight vector on every call: measured 0.83 ms for SmolLM2's lm_head.)
// |(w + 128) x| <= 255 * 127, so the int32 sums are exact for K < 66,000.
template <int MR>
inline void tile_vnni(const Tile& t, int64_t m0, int64_t n0, int32_t acc[kMB][kNB]) {
  const int64_t K = t.K, K64 = K - K % 64;
  __m512i a[MR][kNB];
  for (int j = 0; j < kNB; ++j)
    for (int r = 0; r < MR; ++r) a[r][j] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t k = 0; k < K64; k += 64) {
    __m512i w[kNB];
    for (int j = 0; j < kNB; ++j)
      w[j] = _mm512_xor_si512(_mm512_loadu_si512(t.wq + (n0 + j) * K + k), flip);
    for (int r = 0; r < MR; ++r) {
      const __m512i xv = _mm512_loadu_si512(t.xq + (m0 + r) * K + k);
      for (int j = 0; j < kNB; ++j) a[r][j] = _mm512_dpbusd_epi32(a[r][j], w[j], xv);
    }
  }
  for (int r = 0; r < MR; ++r) {
    alignas(16) int32_t s[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(s), hsum4x512(a[r][0], a[r][1], a[r][2], a[r][3]));
    for (int j = 0; j < kNB; ++j)
      acc[r][j] = s[j] - 128 * t.xsum[m0 + r] +
                  dot_scalar(t.xq + (m0 + r) * K, t.wq + (n0 + j) * K, K64, K);
  }
}
#endif

#if KILN_A8_AVX2
inline int32_t hsum256(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

template <int MR>
inline void tile_avx2(const Tile& t, int64_t m0, int64_t n0, int32_t acc[kMB][kNB]) {
  // 16 ymm registers: rows of x two at a time (8 accumulators + 4 weights + x, |x|, tmp).
  const int64_t K = t.K, K32 = K - K % 32;
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int r0 = 0; r0 < MR; r0 += 2) {
    const int rr = std::min(2, MR - r0);
    __m256i a[2][kNB];
    for (int r = 0; r < 2; ++r)
      for (int j = 0; j < kNB; ++j) a[r][j] = _mm256_setzero_si256();
    for (int64_t k = 0; k < K32; k += 32) {
      __m256i w[kNB];
      for (int j = 0; j < kNB; ++j)
        w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.wq + (n0 + j) * K + k));
      for (int r = 0; r < rr; ++r) {
        const int64_t row = (m0 + r0 + r) * K + k;
        const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.xq + row));
        const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.xu + row));
        for (int j = 0; j < kNB; ++j) {
          const __m256i p = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(w[j], xs));
          a[r][j] = _mm256_add_epi32(a[r][j], _mm256_madd_epi16(p, ones16));
        }
      }
    }
    for (int r = 0; r < rr; ++r)
      for (int j = 0; j < kNB; ++j)
        acc[r0 + r][j] = hsum256(a[r][j]) + dot_scalar(t.xq + (m0 + r0 + r) * K,
                                                       t.wq + (n0 + j) * K, K32, K);
  }
}
#endif

template <int MR>
inline void tile(const Tile& t, int64_t m0, int64_t n0, int32_t acc[kMB][kNB]) {
#if KILN_A8_VNNI
  tile_vnni<MR>(t, m0, n0, acc);
#elif KILN_A8_AVX2
  tile_avx2<MR>(t, m0, n0, acc);
#else
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < kNB; ++j)
      acc[r][j] = dot_scalar(t.xq + (m0 + r) * t.K, t.wq + (n0 + j) * t.K, 0, t.K);
#endif
}

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
    TORCH_CHECK(bias_in->numel() == N, op, ": bias has ", bias_in->numel(), " elements, expected ", N);
    bias = bias_in->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());

  std::vector<int8_t> xq(M * K);
  // what the own kernel (below kIntMmMinM rows) reads besides xq
  std::vector<uint8_t> xu(M < kIntMmMinM && KILN_A8_AVX2 ? M * K : 0);
  std::vector<int32_t> xsum(M < kIntMmMinM && KILN_A8_VNNI ? M : 0);
  std::vector<float> sx(M);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1)),
                   [&](int64_t m0, int64_t m1) {
    quantize_rows(xp + m0 * K, m1 - m0, K, xq.data() + m0 * K, sx.data() + m0);
  });
  for (int64_t i = 0; i < int64_t(xu.size()); ++i) xu[i] = uint8_t(std::abs(int(xq[i])));
  for (int64_t m = 0; m < int64_t(xsum.size()); ++m) {
    int32_t sum = 0;
    for (int64_t k = 0; k < K - K % 64; ++k) sum += xq[m * K + k];
    xsum[m] = sum;
  }
  const Tile t{xq.data(), xu.data(), xsum.data(), qweight.data_ptr<int8_t>(), K};
  const float* sw = scales.data_ptr<float>();
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();

  if (M >= kIntMmMinM) {
    const at::Tensor acc = at::_int_mm(at::from_blob(xq.data(), {M, K}, at::kChar), qweight.t());
    const int32_t* a = acc.data_ptr<int32_t>();
    at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t n = 0; n < N; ++n)
          y[m * N + n] = float(a[m * N + n]) * (sx[m] * sw[n]) + (b ? b[n] : 0.f);
    });
    return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
  }

  const int64_t nblocks = (N + kNB - 1) / kNB;
  at::parallel_for(0, nblocks, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)),
                   [&](int64_t b0, int64_t b1) {
    int32_t acc[kMB][kNB];
    for (int64_t nb = b0; nb < b1; ++nb) {
      const int64_t n0 = nb * kNB;
      if (n0 + kNB > N) {   // last partial block of weight rows: scalar
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = n0; n < N; ++n)
            y[m * N + n] = float(dot_scalar(t.xq + m * K, t.wq + n * K, 0, K)) * (sx[m] * sw[n]) +
                           (b ? b[n] : 0.f);
        continue;
      }
      for (int64_t m0 = 0; m0 < M; m0 += kMB) {
        const int64_t mr = std::min(kMB, M - m0);
        switch (mr) {
          case 4: tile<4>(t, m0, n0, acc); break;
          case 3: tile<3>(t, m0, n0, acc); break;
          case 2: tile<2>(t, m0, n0, acc); break;
          default: tile<1>(t, m0, n0, acc); break;
        }
        for (int64_t r = 0; r < mr; ++r)
          for (int64_t j = 0; j < kNB; ++j) {
            const int64_t n = n0 + j;
            y[(m0 + r) * N + n] = float(acc[r][j]) * (sx[m0 + r] * sw[n]) + (b ? b[n] : 0.f);
          }
      }
    }
  });
  return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("linear_int8_a8", &linear_int8_a8);
}
