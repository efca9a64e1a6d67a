// The kernels of the int4_a8 weight format (16 rows interleaved; layout:
// plugins/quant/formats.py "int4_a8"), run by its two CPU ops: kiln::linear_int4_a8 (W4A8,
// linear_int4_a8.cpp) and kiln::linear_int4_rows16 (the same weights times float activations,
// linear_int4_rows16.cpp); schemas and references: plugins/quant/ops.py.
//
//   y[m, n] = sum_g  d[n, g] * sx[m, g] * I[m, n, g]  +  mn[n, g] * cx[m, g]   (+ bias[n])
//   I[m, n, g] = sum_{k in group g} xq[m, k] * q[n, k]     (exact int32: 32 * 127 * 15)
//   xq = round_half_even(x / sx), sx[m, g] = max|x[m, group g]| / 127 (run time, per group
//   of 32: llama.cpp's Q8_1), cx[m, g] = sx[m, g] * sum_{k in g} xq[m, k];
//   q in 0..15, d (scale) and mn (group minimum) float16: llama.cpp's Q4_1.
// linear_int4_rows16 is weight-only: x of each group is held as ND = 2 int8 digits of fixed
// point, x ~ sx (c0 + c1 / 128) (c0 in -127..127, c1 in -64..64: at most 3.1e-5 of the
// group's max|x| off, 1 / (2 * 127 * 128); kRows16Digits in linear_int4_rows16.cpp), each
// digit multiplied like W4A8's one and combined in the int32 lanes, I = (I0 << 7) + I1
// (|I0| <= 32 * 15 * 127, so under 2^23; the kernels also take ND = 3, 2.4e-7 off), and cx
// the group's float sum of x.
// The same loops with twice the integer dot products: the float decoder this replaces
// (linear_weight_only.cpp's int4, [N, K/2] layout, fp32 scales) took 1.4-2.9x as long on
// SmolLM2's shapes (2 threads, 1 to 128 rows of x, Zen 4; with three digits then).
//
// The weights are interleaved 16 rows at a time, so one register of int32 lanes holds the
// 16 rows' sums and the per-group scales load as one vector (no horizontal reductions):
//   AVX-512 VNNI: per group, 4 x 64-byte loads -> 8 vpdpbusd (u8 weights x s8 activations
//     broadcast), then 2 FMAs per row of x. Up to 4 rows of x share each decoded chunk.
//   AVX2 (also the avx512 level without VNNI): the same on 8-row halves with vpmaddubsw
//     (int16 sums of 16 products stay below 2^15: 16 * 15 * 127 = 30,480) and one vpmaddwd
//     per group into int32.
//   otherwise: scalar loops (same integers, same float arithmetic per group).
//   AMX (the amx level, from kAmxMinRows<ND> rows of x: 32 for W4A8, 16 for two digits): one
//     tdpbsud per group, digit and 16 rows of x (block_amx, int4_a8_amx.h), the last M % 16 rows on
//     VNNI; the same floats, bit for bit.
// Parallel over blocks of 16 weight rows; each block's packed weights (K/32 * 256 bytes)
// stay in L1 while every tile of x rows passes over them, and the weights 16 groups ahead
// are prefetched (kPrefetchGroups), and 64 KiB ahead into L2 (plugins/csrc/prefetch.h).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <torch/library.h>

#include "../../csrc/parallel.h"
#include "../../csrc/prefetch.h"
#include "int8_gemm.h"   // KILN_INT8_GEMM_AMX, amx_ready, TileConfig

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

// The tile path's rows beyond whole tiles, and its float order, are the VNNI tiles'.
#if KILN_INT8_GEMM_AMX && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KILN_W4A8_AMX 1
#else
#define KILN_W4A8_AMX 0
#endif

#if KILN_W4A8_AMX
#include <immintrin.h>
#define KILN_W4A8_PATH "w4a8: avx512-vnni vpdpbusd, from 32 rows amx tiles (int4 rows16 from 16)"
#define KILN_W4A8_VNNI 1
#define KILN_W4A8_AVX2 0
#elif defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KILN_W4A8_PATH "w4a8: avx512-vnni vpdpbusd"
#define KILN_W4A8_VNNI 1
#define KILN_W4A8_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KILN_W4A8_PATH "w4a8: avx2 vpmaddubsw"
#define KILN_W4A8_VNNI 0
#define KILN_W4A8_AVX2 1
#else
#define KILN_W4A8_PATH "w4a8: scalar"
#define KILN_W4A8_VNNI 0
#define KILN_W4A8_AVX2 0
#endif

// The library's code path (KILN_W4A8_PATH) is embedded once, by linear_int4_a8.cpp.

namespace kiln_int4_a8 {

constexpr int64_t kRows = 16;     // weight rows per interleaved block
constexpr int64_t kGroup = 32;    // weights (and activations) per scale
constexpr int64_t kChunk = 256;   // packed bytes per (block, group)
// rows of x per tile, by digits per activation (accumulators: MR * ND * 2 registers; AVX2's
// 2 rows of three digits spilled a few of them, and still beat 1 row: 4 rows of x 0.76 ->
// 1.09x the float decoder on SmolLM2's w13, measured with three digits)
template <int ND>
constexpr int kMR = KILN_W4A8_VNNI ? (ND == 1 ? 4 : 2) : 2;
// Software prefetch, in groups ahead of the one being multiplied (16 = 4 KiB; past a block's
// end it fetches the next block's start, which the same task takes next). Paired in the
// plans' decode steps (2 threads, Zen 4, 8-10 rounds): VNNI 0.86x (throughput, W4A8) and
// 0.82x (int4 weight-only) at batch 1, 0.96x and 0.99x at 32 (8 or 32 groups ahead gained
// less); AVX2 plans 0.91x and 0.90x at batch 1, 0.95x and 0.98x at 32.
constexpr int64_t kPrefetchGroups = 16;

// Per group of 32 along K: q = round_half_even(x / s), s = max|x| / 127 (1 for all zeros);
// c = s * sum(q). Same arithmetic as quantize_activation_groups in ops.py. With ND > 1 the
// residuals of x / s take more digits, q1 = round((x / s - q0) * 128), q2 likewise
// (exact in float: each residual is at most half an integer), s carries the 128^-(ND-1)
// the digits are combined with (kDigitUnit), and c is the group's float sum of x. q: ND
// rows of K digits.
// At one row of x this runs on one thread before the GEMV's fork, so it is vectorized: the
// scalar loop (a division and up to three roundings per value) took about 8% of the int4
// plan's batch-1 step (perf, 120 calls a step) while the other thread waited.
//
// The unit of the combined lanes, in units of the group's scale: 128^-(ND-1).
template <int ND>
constexpr float kDigitUnit = ND == 1 ? 1.f : ND == 2 ? 1.f / 128.f : 1.f / 16384.f;

template <int ND>
inline void quantize_group_scalar(const float* xg, int64_t K, int8_t* q, float& s, float& c) {
  float amax = 0.f;
  for (int64_t k = 0; k < kGroup; ++k) amax = std::max(amax, std::fabs(xg[k]));
  const float sc = amax > 0.f ? amax / 127.f : 1.f;
  int32_t sum = 0;
  float fsum = 0.f;
  for (int64_t k = 0; k < kGroup; ++k) {
    const float t = xg[k] / sc;
    const float v = std::min(127.f, std::max(-127.f, std::nearbyint(t)));
    q[k] = static_cast<int8_t>(v);
    sum += static_cast<int32_t>(v);
    if (ND > 1) {
      const float e1 = (t - v) * 128.f;
      const float v1 = std::nearbyint(e1);
      q[K + k] = static_cast<int8_t>(v1);
      if (ND == 3) q[2 * K + k] = static_cast<int8_t>(std::nearbyint((e1 - v1) * 128.f));
      fsum += xg[k];
    }
  }
  s = sc * kDigitUnit<ND>;
  c = ND > 1 ? fsum : sc * float(sum);
}

#if defined(__AVX512F__)
// 16 integral floats in -127..127 as 16 int8 at p.
inline void store_i8(int8_t* p, __m512 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
}
inline __m512 round_even(__m512 v) {
  return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

template <int ND>
inline void quantize_group(const float* xg, int64_t K, int8_t* q, float& s, float& c) {
  const __m512 x[2] = {_mm512_loadu_ps(xg), _mm512_loadu_ps(xg + 16)};
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x[0]), _mm512_abs_ps(x[1])));
  const float sc = amax > 0.f ? amax / 127.f : 1.f;
  const __m512 vs = _mm512_set1_ps(sc), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  const __m512 k128 = _mm512_set1_ps(128.f);
  __m512 vsum = _mm512_setzero_ps();   // sum of the q: integers under 2^12, exact in float
  for (int h = 0; h < 2; ++h) {
    const __m512 t = _mm512_div_ps(x[h], vs);   // a division, as the reference divides
    const __m512 v = _mm512_min_ps(_mm512_max_ps(round_even(t), lo), hi);  // NaN -> -127
    store_i8(q + 16 * h, v);
    vsum = _mm512_add_ps(vsum, v);
    if (ND > 1) {
      const __m512 e1 = _mm512_mul_ps(_mm512_sub_ps(t, v), k128);
      const __m512 v1 = round_even(e1);
      store_i8(q + K + 16 * h, v1);
      if (ND == 3)
        store_i8(q + 2 * K + 16 * h, round_even(_mm512_mul_ps(_mm512_sub_ps(e1, v1), k128)));
    }
  }
  s = sc * kDigitUnit<ND>;
  c = ND > 1 ? _mm512_reduce_add_ps(_mm512_add_ps(x[0], x[1]))
              : sc * _mm512_reduce_add_ps(vsum);
}
#elif defined(__AVX2__)
inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
inline float hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)));
}
// 8 integral floats in -127..127 as 8 int8 at p.
inline void store_i8(int8_t* p, __m256 v) {
  const __m256i i32 = _mm256_cvtps_epi32(v);
  const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(i16, i16));
}
inline __m256 round_even(__m256 v) {
  return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

template <int ND>
inline void quantize_group(const float* xg, int64_t K, int8_t* q, float& s, float& c) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 x[4], vmax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(xg + 8 * i);
    vmax = _mm256_max_ps(_mm256_and_ps(x[i], absmask), vmax);
  }
  const float amax = hmax8(vmax);
  const float sc = amax > 0.f ? amax / 127.f : 1.f;
  const __m256 vs = _mm256_set1_ps(sc), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const __m256 k128 = _mm256_set1_ps(128.f);
  __m256 vsum = _mm256_setzero_ps(), xsum = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    const __m256 t = _mm256_div_ps(x[i], vs);
    const __m256 v = _mm256_min_ps(_mm256_max_ps(round_even(t), lo), hi);
    store_i8(q + 8 * i, v);
    vsum = _mm256_add_ps(vsum, v);
    if (ND > 1) {
      const __m256 e1 = _mm256_mul_ps(_mm256_sub_ps(t, v), k128);
      const __m256 v1 = round_even(e1);
      store_i8(q + K + 8 * i, v1);
      if (ND == 3)
        store_i8(q + 2 * K + 8 * i, round_even(_mm256_mul_ps(_mm256_sub_ps(e1, v1), k128)));
      xsum = _mm256_add_ps(xsum, x[i]);
    }
  }
  s = sc * kDigitUnit<ND>;
  c = ND > 1 ? hsum8(xsum) : sc * hsum8(vsum);
}
#else
template <int ND>
inline void quantize_group(const float* xg, int64_t K, int8_t* q, float& s, float& c) {
  quantize_group_scalar<ND>(xg, K, q, s, c);
}
#endif

template <int ND>
void quantize_groups(const float* x, int64_t K, int8_t* q, float* s, float* c) {
  for (int64_t g = 0; g < K / kGroup; ++g)
    quantize_group<ND>(x + g * kGroup, K, q + g * kGroup, s[g], c[g]);
}

struct Args {
  const int8_t* xq;     // [M, ND, K] digits
  const float* sx;      // [M, G]
  const float* cx;      // [M, G]
  const uint8_t* qw;    // [N/16, G, 256]
  const uint16_t* d;    // [N/16, G, 16] float16 bits
  const uint16_t* mn;   // [N/16, G, 16] float16 bits
  const float* bias;    // [N] or null
  float* y;             // [M, N]
  int64_t K, G, N;
};

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The int32 lanes of one group: the digits' sums combined (I0 alone with one digit).
template <int ND, class V, class Add, class Shl>
inline V combine_digits(const V* acc, Add add, Shl shl) {
  V v = acc[0];
  for (int l = 1; l < ND; ++l) v = add(shl(v), acc[l]);
  return v;
}

#if KILN_W4A8_VNNI
template <int MR, int ND>
void block_tile(const Args& a, int64_t rb, int64_t m0) {
  __m512 fd[MR], fm[MR];
  for (int r = 0; r < MR; ++r) fd[r] = fm[r] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const uint8_t* wb = a.qw + rb * a.G * kChunk;
  const uint16_t* db = a.d + rb * a.G * kRows;
  const uint16_t* mb = a.mn + rb * a.G * kRows;
  for (int64_t g = 0; g < a.G; ++g) {
    __m512i lo_acc[MR][ND], hi_acc[MR][ND];
    for (int r = 0; r < MR; ++r)
      for (int l = 0; l < ND; ++l) lo_acc[r][l] = hi_acc[r][l] = _mm512_setzero_si512();
    const char* pf = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(wb) +
                                                   (g + kPrefetchGroups) * kChunk);
    for (int c = 0; c < 4; ++c) _mm_prefetch(pf + 64 * c, _MM_HINT_T0);
    for (int c = 0; c < 4; ++c) kiln::prefetch_far(wb + g * kChunk + 64 * c);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(wb + g * kChunk + 64 * c);
      const __m512i lo = _mm512_and_si512(v, mask);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
      for (int r = 0; r < MR; ++r)
        for (int l = 0; l < ND; ++l) {
          const int8_t* xr = a.xq + ((m0 + r) * ND + l) * a.K + g * kGroup + 8 * c;
          lo_acc[r][l] = _mm512_dpbusd_epi32(lo_acc[r][l], lo, _mm512_set1_epi32(load4(xr)));
          hi_acc[r][l] = _mm512_dpbusd_epi32(hi_acc[r][l], hi, _mm512_set1_epi32(load4(xr + 4)));
        }
    }
    const __m512 d = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(db + g * kRows)));
    const __m512 mn = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mb + g * kRows)));
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (m0 + r) * a.G + g;
      __m512i sums[ND];
      for (int l = 0; l < ND; ++l) sums[l] = _mm512_add_epi32(lo_acc[r][l], hi_acc[r][l]);
      const __m512 acc = _mm512_cvtepi32_ps(combine_digits<ND>(
          sums, [](__m512i x, __m512i y) { return _mm512_add_epi32(x, y); },
          [](__m512i x) { return _mm512_slli_epi32(x, 7); }));
      fd[r] = _mm512_fmadd_ps(acc, _mm512_mul_ps(d, _mm512_set1_ps(a.sx[i])), fd[r]);
      fm[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.cx[i]), fm[r]);
    }
  }
  const __m512 b = a.bias ? _mm512_loadu_ps(a.bias + rb * kRows) : _mm512_setzero_ps();
  for (int r = 0; r < MR; ++r)
    _mm512_storeu_ps(a.y + (m0 + r) * a.N + rb * kRows,
                     _mm512_add_ps(_mm512_add_ps(fd[r], fm[r]), b));
}
#elif KILN_W4A8_AVX2
template <int MR, int ND>
void block_tile(const Args& a, int64_t rb, int64_t m0) {
  // Two halves of 8 rows (h): bytes 32h..32h+31 of each 64-byte chunk.
  __m256 f[MR][2];
  for (int r = 0; r < MR; ++r) f[r][0] = f[r][1] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i ones16 = _mm256_set1_epi16(1);
  const uint8_t* wb = a.qw + rb * a.G * kChunk;
  const uint16_t* db = a.d + rb * a.G * kRows;
  const uint16_t* mb = a.mn + rb * a.G * kRows;
  for (int64_t g = 0; g < a.G; ++g) {
    __m256i s16[MR][ND][2];
    for (int r = 0; r < MR; ++r)
      for (int l = 0; l < ND; ++l) s16[r][l][0] = s16[r][l][1] = _mm256_setzero_si256();
    const char* pf = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(wb) +
                                                   (g + kPrefetchGroups) * kChunk);
    for (int c = 0; c < 4; ++c) _mm_prefetch(pf + 64 * c, _MM_HINT_T0);
    for (int c = 0; c < 4; ++c) kiln::prefetch_far(wb + g * kChunk + 64 * c);
    for (int c = 0; c < 4; ++c) {
      __m256i x0[MR][ND], x1[MR][ND];
      for (int r = 0; r < MR; ++r)
        for (int l = 0; l < ND; ++l) {
          const int8_t* xr = a.xq + ((m0 + r) * ND + l) * a.K + g * kGroup + 8 * c;
          x0[r][l] = _mm256_set1_epi32(load4(xr));
          x1[r][l] = _mm256_set1_epi32(load4(xr + 4));
        }
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(wb + g * kChunk + 64 * c + 32 * h));
        const __m256i lo = _mm256_and_si256(v, mask);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        for (int r = 0; r < MR; ++r)
          for (int l = 0; l < ND; ++l)
            s16[r][l][h] = _mm256_add_epi16(
                s16[r][l][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0[r][l]),
                                               _mm256_maddubs_epi16(hi, x1[r][l])));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(db + g * kRows + 8 * h)));
      const __m256 mn = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(mb + g * kRows + 8 * h)));
      for (int r = 0; r < MR; ++r) {
        const int64_t i = (m0 + r) * a.G + g;
        __m256i sums[ND];
        for (int l = 0; l < ND; ++l) sums[l] = _mm256_madd_epi16(s16[r][l][h], ones16);
        const __m256 acc = _mm256_cvtepi32_ps(combine_digits<ND>(
            sums, [](__m256i x, __m256i y) { return _mm256_add_epi32(x, y); },
            [](__m256i x) { return _mm256_slli_epi32(x, 7); }));
        f[r][h] = _mm256_fmadd_ps(acc, _mm256_mul_ps(d, _mm256_set1_ps(a.sx[i])), f[r][h]);
        f[r][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.cx[i]), f[r][h]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) {
      const int64_t n0 = rb * kRows + 8 * h;
      const __m256 b = a.bias ? _mm256_loadu_ps(a.bias + n0) : _mm256_setzero_ps();
      _mm256_storeu_ps(a.y + (m0 + r) * a.N + n0, _mm256_add_ps(f[r][h], b));
    }
}
#else
template <int MR, int ND>
void block_tile(const Args& a, int64_t rb, int64_t m0) {
  for (int r = 0; r < MR; ++r) {
    const int64_t m = m0 + r;
    for (int64_t j = 0; j < kRows; ++j) {
      float fd = 0.f, fm = 0.f;
      for (int64_t g = 0; g < a.G; ++g) {
        const uint8_t* w = a.qw + (rb * a.G + g) * kChunk;
        int32_t sums[ND];
        for (int l = 0; l < ND; ++l) {
          const int8_t* xg = a.xq + (m * ND + l) * a.K + g * kGroup;
          int32_t acc = 0;
          for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = w[64 * c + 4 * j + i];
              acc += int32_t(byte & 0x0F) * xg[8 * c + i] + int32_t(byte >> 4) * xg[8 * c + 4 + i];
            }
          sums[l] = acc;
        }
        const int32_t acc = combine_digits<ND>(
            sums, [](int32_t x, int32_t y) { return x + y; }, [](int32_t x) { return x << 7; });
        const int64_t s = (rb * a.G + g) * kRows + j;
        const float d = c10::detail::fp16_ieee_to_fp32_value(a.d[s]);
        const float mn = c10::detail::fp16_ieee_to_fp32_value(a.mn[s]);
        fd += float(acc) * (d * a.sx[m * a.G + g]);
        fm += mn * a.cx[m * a.G + g];
      }
      const int64_t n = rb * kRows + j;
      a.y[m * a.N + n] = fd + fm + (a.bias ? a.bias[n] : 0.f);
    }
  }
}
#endif

}  // namespace kiln_int4_a8

#include "int4_a8_amx.h"  // block_amx: the amx level's tiles

namespace kiln_int4_a8 {

template <int ND>
at::Tensor run(const char* op, const at::Tensor& x_in, const at::Tensor& qweight,
               const at::Tensor& scales, const at::Tensor& mins,
               const c10::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2, op, ": x must be [M, K], got ", x_in.sizes());
  TORCH_CHECK(qweight.dim() == 3 && qweight.scalar_type() == at::kByte && qweight.is_contiguous()
                  && qweight.size(2) == kChunk,
              op, ": qweight must be contiguous uint8 [N/16, K/32, 256], got ", qweight.sizes());
  const int64_t M = x_in.size(0), K = x_in.size(1), G = qweight.size(1);
  const int64_t N = qweight.size(0) * kRows;
  TORCH_CHECK(G * kGroup == K, op, ": x has K=", K, " but the weight has K=", G * kGroup);
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == qweight.size(0) && t->size(1) == G && t->size(2) == kRows,
                op, ": scales and mins must be contiguous float16 [N/16, K/32, 16] = [",
                qweight.size(0), ", ", G, ", 16], got ", t->sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x_in.scalar_type());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->numel() == N, op, ": bias has ", bias_in->numel(), " elements, expected ", N);
    bias = bias_in->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    // every element is written below: no zeroing (a memset of M * K bytes a call)
    std::unique_ptr<int8_t[]> xq(new int8_t[M * ND * K]);
    std::unique_ptr<float[]> sx(new float[M * G]), cx(new float[M * G]);
    const float* xp = x.data_ptr<float>();
    at::parallel_for(0, M, std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1)),
                     [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        quantize_groups<ND>(xp + m * K, K, xq.get() + m * ND * K, sx.get() + m * G,
                            cx.get() + m * G);
    });
    const Args a{xq.get(), sx.get(), cx.get(), qweight.data_ptr<uint8_t>(),
                 reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                 reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()),
                 bias.defined() ? bias.data_ptr<float>() : nullptr, out.data_ptr<float>(), K, G, N};
    constexpr int MR = kMR<ND>;
    auto rows_from = [&](int64_t rb, int64_t from) {   // rows from..M of a block, 1-4 at a time
      for (int64_t m0 = from; m0 < M; m0 += MR) {
        switch (std::min<int64_t>(MR, M - m0)) {   // cases above MR never run: <1, ND>
          case 4: block_tile<(MR >= 4 ? 4 : 1), ND>(a, rb, m0); break;
          case 3: block_tile<(MR >= 3 ? 3 : 1), ND>(a, rb, m0); break;
          case 2: block_tile<(MR >= 2 ? 2 : 1), ND>(a, rb, m0); break;
          default: block_tile<1, ND>(a, rb, m0); break;
        }
      }
    };
#if KILN_W4A8_AMX
    if constexpr (ND <= 2) {
      if (M >= kAmxMinRows<ND> && kiln_int8::amx_ready()) {
        // whole tiles of 16 rows on AMX, the last M % 16 rows on block_tile (the same results)
        const int64_t whole = M / 16 * 16;
        const int64_t block_bytes = kRows * (K / 2 + 4 * G);
        const int64_t chunk = kiln::chunk_items(N / kRows, block_bytes, 16 << 10);
        kiln::parallel_chunks(N / kRows, chunk, [&](int64_t b0, int64_t b1) {
          std::vector<uint8_t> scratch(amx_scratch_bytes(G));
          _tile_loadconfig(&w4a8_tile_config());
          for (int64_t rb = b0; rb < b1; ++rb) {
            block_amx<ND>(a, rb, whole, scratch.data());
            rows_from(rb, whole);
          }
          _tile_release();
        });
        return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
      }
    }
#endif
    // chunks of ~16 KiB of packed weights at one row of x (fewer blocks at many rows), at
    // least 4 a thread: a preempted thread's chunks go to the others (plugins/csrc/parallel.h)
    const int64_t block_bytes = kRows * (K / 2 + 4 * G) * ((M + MR - 1) / MR);
    const int64_t chunk = kiln::chunk_items(N / kRows, block_bytes, 16 << 10);
    kiln::parallel_chunks(N / kRows, chunk, [&](int64_t b0, int64_t b1) {
      for (int64_t rb = b0; rb < b1; ++rb) rows_from(rb, 0);
    });
  }
  return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
}

}  // namespace kiln_int4_a8
