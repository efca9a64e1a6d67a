// A 16 x 16 transpose of 32-bit elements in AVX-512 registers, shared by the int8 GEMM tiles'
// stores (int32 sums, rows of C to columns) and the paged-attention prefill tiles (a block's
// float K rows to K^T).
//
// Three rounds of shuffles, no memory: 32-bit interleaves of row pairs, 64-bit interleaves of
// those (4 rows x 4 columns per 128-bit lane), then two rounds of 128-bit lane shuffles that
// gather each column's four lanes.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace kiln {

// r[i] = row i on entry; r[j] = column j (the 16 elements of r[0..15] at position j) on exit.
inline void transpose16x16(__m512i r[16]) {
  __m512i b[16], c[16];
  for (int k = 0; k < 8; ++k) {
    b[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    b[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {   // c[4k + q], lane L: rows 4k..4k+3 of column 4L + q
    c[4 * k + 0] = _mm512_unpacklo_epi64(b[4 * k], b[4 * k + 2]);
    c[4 * k + 1] = _mm512_unpackhi_epi64(b[4 * k], b[4 * k + 2]);
    c[4 * k + 2] = _mm512_unpacklo_epi64(b[4 * k + 1], b[4 * k + 3]);
    c[4 * k + 3] = _mm512_unpackhi_epi64(b[4 * k + 1], b[4 * k + 3]);
  }
  for (int q = 0; q < 4; ++q) {   // column 4L + q: lane L of c[q], c[4 + q], c[8 + q], c[12 + q]
    const __m512i d0 = _mm512_shuffle_i32x4(c[q], c[4 + q], 0x44);
    const __m512i d1 = _mm512_shuffle_i32x4(c[q], c[4 + q], 0xEE);
    const __m512i d2 = _mm512_shuffle_i32x4(c[8 + q], c[12 + q], 0x44);
    const __m512i d3 = _mm512_shuffle_i32x4(c[8 + q], c[12 + q], 0xEE);
    r[q] = _mm512_shuffle_i32x4(d0, d2, 0x88);
    r[4 + q] = _mm512_shuffle_i32x4(d0, d2, 0xDD);
    r[8 + q] = _mm512_shuffle_i32x4(d1, d3, 0x88);
    r[12 + q] = _mm512_shuffle_i32x4(d1, d3, 0xDD);
  }
}

}  // namespace kiln

#endif
