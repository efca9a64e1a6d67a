// The horizontal sums of four AVX-512 vectors as one 128-bit vector [s0, s1, s2, s3], by a
// transpose-and-add tree (about a third of the instructions of four separate reductions):
// interleave-and-add to [s0, s1, s2, s3] partial sums in each 128-bit lane, then add the
// lanes. Shared by the float dot-product tiles (bf16), the int8 dot tiles and the attention
// kernel's four-key scores; one order of float additions for all of them.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace kiln {

inline __m128 hsum4_ps(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1));
  const __m512 u = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  const __m256 v = _mm256_add_ps(_mm512_castps512_ps256(u),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
}

inline __m128i hsum4_epi32(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
  const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
  const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
  const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
  const __m256i v = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

}  // namespace kiln

#endif
