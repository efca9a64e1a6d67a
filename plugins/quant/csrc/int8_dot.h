// Integer dot products of int8 weight rows with rows of int8-quantized x, shared by
// kiln::linear_int8_a8 (linear_int8_a8.cpp: x quantized once, W8A8) and the decode paths of the
// weight-only kiln::linear_int8 / int4 (linear_weight_only.cpp: x held as three int8 digits of
// fixed point per row, quantize_digits below, within 2.4e-7 of max|x| of x).
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
// from memory once per call whatever the number of rows of x.
#pragma once

#include <ATen/Parallel.h>

#include "../../csrc/hsum4.h"
#include "../../csrc/parallel.h"
#include "../../csrc/prefetch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KILN_INT8_DOT_VNNI 1
#define KILN_INT8_DOT_AVX2 0
#elif defined(__AVX2__)
#include <immintrin.h>
#define KILN_INT8_DOT_VNNI 0
#define KILN_INT8_DOT_AVX2 1
#else
#define KILN_INT8_DOT_VNNI 0
#define KILN_INT8_DOT_AVX2 0
#endif

namespace kiln_int8 {

constexpr int64_t kNB = 4;   // weight rows per tile
constexpr int64_t kMB = 4;   // rows of x per tile
// How far ahead of its loads a tile asks for weights (software prefetch): the 4-row tiles
// read 4 interleaved streams the hardware prefetchers follow late. Measured on a Zen 4 pair
// (bench/linear_kernels.py, 30 w13-sized matrices, one row of x, W8A8): 29 GB/s without,
// 46-64 GB/s from 4 to 16 KiB ahead, less again at 32 KiB.
constexpr int64_t kPrefetch = 12288;   // (and kiln::prefetch_far: plugins/csrc/prefetch.h)

// x as rows of int8 codes with one scale each, and what the tile kernels read besides.
struct QuantX {
  int64_t rows = 0, K = 0;
  std::vector<int8_t> q;     // [rows, K]
  std::vector<float> s;      // [rows]
  std::vector<uint8_t> u;    // [rows, K] |q| (AVX2 only)
  std::vector<int32_t> sum;  // [rows] sum of q[r, :K - K % 64] (VNNI only)

  QuantX(int64_t rows_, int64_t K_) : rows(rows_), K(K_), q(rows_ * K_), s(rows_) {}

  // The tile kernels' extra inputs; call once q is filled.
  void finish() {
    if (KILN_INT8_DOT_AVX2) {
      u.resize(q.size());
      for (size_t i = 0; i < q.size(); ++i) u[i] = uint8_t(std::abs(int(q[i])));
    }
    if (KILN_INT8_DOT_VNNI) {
      sum.assign(rows, 0);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < K - K % 64; ++k) sum[r] += q[r * K + k];
    }
  }
};

constexpr int kDigitBits = 7;   // each digit after the first: 7 bits, -64..64

// Where element k of a row is stored: in place, or (permute64, for the int4 decoder) each
// 64-element step in the order [0..15, 32..47, 16..31, 48..63].
inline int64_t digit_pos(int64_t k, bool permute64) {
  if (!permute64) return k;
  const int64_t i = k % 64, j = i >> 4;
  return k - i + (i & 15) + (((j & 1) << 1 | j >> 1) << 4);
}

// The digits of one row a = x / sx (r: scratch of K floats); digit j goes to out + j * stride.
// Vectorized: this runs on every call of a decode step's linears.
inline void digits_of(const float* a, float* r, int64_t K, int D, int8_t* out, int64_t stride,
                      bool permute64) {
  for (int j = 0; j < D; ++j) {
    const float lim = j == 0 ? 127.f : 64.f;
    const float* src = j == 0 ? a : r;
    int8_t* o = out + j * stride;
    int64_t k = 0;
#if defined(__AVX512F__)
    for (; k + 16 <= K; k += 16) {
      const __m512 v = _mm512_loadu_ps(src + k);
      __m512 c = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c = _mm512_min_ps(_mm512_set1_ps(lim), _mm512_max_ps(_mm512_set1_ps(-lim), c));
      _mm512_storeu_ps(r + k, _mm512_mul_ps(_mm512_sub_ps(v, c), _mm512_set1_ps(128.f)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + digit_pos(k, permute64)),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(c)));
    }
#elif defined(__AVX2__)
    for (; k + 8 <= K; k += 8) {
      const __m256 v = _mm256_loadu_ps(src + k);
      __m256 c = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c = _mm256_min_ps(_mm256_set1_ps(lim), _mm256_max_ps(_mm256_set1_ps(-lim), c));
      _mm256_storeu_ps(r + k, _mm256_mul_ps(_mm256_sub_ps(v, c), _mm256_set1_ps(128.f)));
      const __m256i i32 = _mm256_cvtps_epi32(c);
      const __m128i i16 =
          _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
      const __m128i i8 = _mm_packs_epi16(i16, i16);
      // 8 elements at a multiple of 8 never straddle a 16-element run of digit_pos
      _mm_storel_epi64(reinterpret_cast<__m128i*>(o + digit_pos(k, permute64)), i8);
    }
#endif
    for (; k < K; ++k) {
      const float c = std::min(lim, std::max(-lim, std::nearbyint(src[k])));
      r[k] = (src[k] - c) * 128.f;
      o[digit_pos(k, permute64)] = static_cast<int8_t>(c);
    }
  }
}

// x [M, K] as D int8 digits per row (rows m * D + j of the result):
//   x ~ sx * (c0 + c1 / 128 + ... + c_{D-1} / 128^(D-1)),  s[m * D + j] = sx / 128^j,
// c0 = round_half_even(x / sx) in -127..127 with sx = max|x| / 127 (1 for an all-zero row),
// and each next digit the rounded remainder times 128 (-64..64). D = 1 is W8A8's per-row
// quantization, the same arithmetic as quantize_activations in ops.py; D = 3 is at most
// max|x| / (2 * 127 * 128^2) = 2.4e-7 max|x| from x. Rows in parallel (from 4096 elements).
inline QuantX quantize_digits(const float* x, int64_t M, int64_t K, int D, bool permute64 = false) {
  QuantX qx(M * D, K);
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1)),
                   [&](int64_t m0, int64_t m1) {
    std::vector<float> a(K), r(K);
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * K;
      float amax = 0.f;
      int64_t k = 0;
#if defined(__AVX512F__)
      __m512 vmax = _mm512_setzero_ps();
      for (; k + 16 <= K; k += 16)
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xr + k)));
      amax = _mm512_reduce_max_ps(vmax);
#endif
      for (; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
      const float sc = amax > 0.f ? amax / 127.f : 1.f;
      for (k = 0; k < K; ++k) a[k] = xr[k] / sc;   // a division, as the reference divides
      digits_of(a.data(), r.data(), K, D, qx.q.data() + m * D * K, K, permute64);
      float unit = sc;
      for (int j = 0; j < D; ++j, unit /= float(1 << kDigitBits)) qx.s[m * D + j] = unit;
    }
  });
  return qx;
}

inline int32_t dot_scalar(const int8_t* a, const int8_t* b, int64_t k0, int64_t K) {
  int32_t s = 0;
  for (int64_t k = k0; k < K; ++k) s += int32_t(a[k]) * int32_t(b[k]);
  return s;
}

#if KILN_INT8_DOT_VNNI
// The weights go in as the unsigned operand, offset by 128 (w ^ 0x80 = w + 128 in u8), and
// x as the signed one: sum_k (w + 128) x = sum_k w x + 128 sum_k x, so one sum of x per row
// of x (QuantX::sum) removes the offset. (Offsetting x instead needs the weight rows' sums,
// one more vpdpbusd per weight vector on every call: measured 0.83 ms for SmolLM2's lm_head.)
template <int MR>
inline void tile_vnni(const QuantX& x, const int8_t* wq, int64_t last, int64_t m0,
                      int64_t n0, int32_t acc[kMB][kNB]) {
  const int64_t K = x.K, K64 = K - K % 64;
  __m512i a[MR][kNB];
  for (int j = 0; j < kNB; ++j)
    for (int r = 0; r < MR; ++r) a[r][j] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t k = 0; k < K64; k += 64) {
    __m512i w[kNB];
    for (int j = 0; j < kNB; ++j) {
      const int64_t at = (n0 + j) * K + k;
      _mm_prefetch(reinterpret_cast<const char*>(wq + std::min(at + kPrefetch, last)), _MM_HINT_T0);
      kiln::prefetch_far(wq + at);
      w[j] = _mm512_xor_si512(_mm512_loadu_si512(wq + at), flip);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512i xv = _mm512_loadu_si512(x.q.data() + (m0 + r) * K + k);
      for (int j = 0; j < kNB; ++j) a[r][j] = _mm512_dpbusd_epi32(a[r][j], w[j], xv);
    }
  }
  // (every loop over the accumulators unrolled, so they stay in registers: with one loop
  // left rolled GCC kept the array in memory and stored all of it on every step of k)
  alignas(16) int32_t s[MR][4];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
    _mm_store_si128(reinterpret_cast<__m128i*>(s[r]),
                    kiln::hsum4_epi32(a[r][0], a[r][1], a[r][2], a[r][3]));
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < kNB; ++j)
      acc[r][j] = s[r][j] - 128 * x.sum[m0 + r] +
                  dot_scalar(x.q.data() + (m0 + r) * K, wq + (n0 + j) * K, K64, K);
}
#endif

#if KILN_INT8_DOT_AVX2
inline int32_t hsum256(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

template <int MR>
inline void tile_avx2(const QuantX& x, const int8_t* wq, int64_t last, int64_t m0,
                      int64_t n0, int32_t acc[kMB][kNB]) {
  // 16 ymm registers: rows of x two at a time (8 accumulators + 4 weights + x, |x|, tmp).
  const int64_t K = x.K, K32 = K - K % 32;
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int r0 = 0; r0 < MR; r0 += 2) {
    const int rr = std::min(2, MR - r0);
    __m256i a[2][kNB];
    for (int r = 0; r < 2; ++r)
      for (int j = 0; j < kNB; ++j) a[r][j] = _mm256_setzero_si256();
    for (int64_t k = 0; k < K32; k += 32) {
      __m256i w[kNB];
      for (int j = 0; j < kNB; ++j) {
        const int64_t at = (n0 + j) * K + k;
        if (k % 64 == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(wq + std::min(at + kPrefetch, last)),
                       _MM_HINT_T0);
          kiln::prefetch_far(wq + at);
        }
        w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + at));
      }
      for (int r = 0; r < rr; ++r) {
        const int64_t row = (m0 + r0 + r) * K + k;
        const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + row));
        const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.u.data() + row));
        for (int j = 0; j < kNB; ++j) {
          const __m256i p = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(w[j], xs));
          a[r][j] = _mm256_add_epi32(a[r][j], _mm256_madd_epi16(p, ones16));
        }
      }
    }
    for (int r = 0; r < rr; ++r)
      for (int j = 0; j < kNB; ++j)
        acc[r0 + r][j] = hsum256(a[r][j]) + dot_scalar(x.q.data() + (m0 + r0 + r) * K,
                                                       wq + (n0 + j) * K, K32, K);
  }
}
#endif

template <int MR>
inline void tile(const QuantX& x, const int8_t* wq, int64_t last, int64_t m0, int64_t n0,
                 int32_t acc[kMB][kNB]) {
#if KILN_INT8_DOT_VNNI
  tile_vnni<MR>(x, wq, last, m0, n0, acc);
#elif KILN_INT8_DOT_AVX2
  tile_avx2<MR>(x, wq, last, m0, n0, acc);
#else
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < kNB; ++j)
      acc[r][j] = dot_scalar(x.q.data() + (m0 + r) * x.K, wq + (n0 + j) * x.K, 0, x.K);
#endif
}

// acc[r * kNB + j] = sum_k x.q[r, k] * wq[n0 + j, k] for every row r of x and j < nr, for
// each block of weight rows n0 = 0, 4, 8, ... (nr = min(4, N - n0)); then epi(n0, nr, acc).
// Parallel over blocks of weight rows.
template <class Epi>
void dot_blocks(const QuantX& x, const int8_t* wq, int64_t N, Epi epi) {
  const int64_t K = x.K, R = x.rows;
  const int64_t nblocks = (N + kNB - 1) / kNB;
  const int64_t last = N * K - 1;   // prefetches stop at the weights' last byte
  // chunks of ~64 KiB of weights (at least 4 a thread): a preempted thread's chunks go to
  // the others (plugins/csrc/parallel.h)
  const int64_t chunk = kiln::chunk_items(nblocks, kNB * K * ((R + kMB - 1) / kMB), 64 << 10);
  kiln::parallel_chunks(nblocks, chunk, [&](int64_t b0, int64_t b1) {
    std::vector<int32_t> acc(R * kNB);
    int32_t t[kMB][kNB];
    for (int64_t nb = b0; nb < b1; ++nb) {
      const int64_t n0 = nb * kNB, nr = std::min(kNB, N - n0);
      if (nr < kNB) {   // last partial block of weight rows: scalar
        for (int64_t r = 0; r < R; ++r)
          for (int64_t j = 0; j < nr; ++j)
            acc[r * kNB + j] = dot_scalar(x.q.data() + r * K, wq + (n0 + j) * K, 0, K);
      } else {
        for (int64_t m0 = 0; m0 < R; m0 += kMB) {
          const int64_t mr = std::min(kMB, R - m0);
          switch (mr) {
            case 4: tile<4>(x, wq, last, m0, n0, t); break;
            case 3: tile<3>(x, wq, last, m0, n0, t); break;
            case 2: tile<2>(x, wq, last, m0, n0, t); break;
            default: tile<1>(x, wq, last, m0, n0, t); break;
          }
          for (int64_t r = 0; r < mr; ++r)
            for (int64_t j = 0; j < kNB; ++j) acc[(m0 + r) * kNB + j] = t[r][j];
        }
      }
      epi(n0, nr, acc.data());
    }
  });
}

}  // namespace kiln_int8
