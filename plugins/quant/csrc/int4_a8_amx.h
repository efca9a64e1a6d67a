// The int4_a8 kernels' AMX tiles (the amx level): block_amx, its tile configuration and
// scratch. Included by int4_a8_blocks.h after the VNNI tiles, whose Args, constants and float
// order it shares (the format, the arithmetic and the paths: that file's header).
#pragma once

namespace kiln_int4_a8 {
#if KILN_W4A8_AMX
// W4A8 and int4_rows16 from kAmxMinRows<ND> rows of x on AMX tiles (the amx level). Unpacked,
// a (block, group)'s four chunks are a B tile as it is: chunk c's low nibbles are 16 weight
// rows x k = 8c..8c+3, its high nibbles k = 8c+4..8c+7 -- row 2c and 2c+1 of an 8-row tile
// (16 columns of 4 k, k in order), so each digit of x is the A operand straight from its
// [M, ND, K] codes (16 rows x the group's 32 bytes, stride ND * K) and one tdpbsud (s8 x, u8
// weights) a digit gives a group's I[m, n] for 16 rows of x and the block's 16 weight rows;
// the digits' sums combine in int32 lanes as block_tile's do. Each group's sums then take
// its scales in floats with block_tile's operations in block_tile's order (fd += I * (d *
// sx), fm += mn * cx, y = (fd + fm) + bias), so a row's result is bit for bit the one it
// gets in a tile of 1-4 rows: a W4A8 plan re-quantizes every layer's output, and a one-ulp
// difference there flips activation codes that compound over the layers (a first version
// summed both terms into one accumulator: the SmolLM2 throughput plan's logits moved by up
// to 1.9 and its golden prompt lost its answer). The caller gives it whole tiles of 16 rows
// (the rest go to block_tile).
// From 32 rows with one digit (one tile of 16 rows: no faster than block_tile), from 16 with
// two, where block_tile does twice the integer work.
template <int ND>
constexpr int64_t kAmxMinRows = ND == 1 ? 32 : 16;

// Two tile sets (even and odd groups): tmm0-1 / 4-5 C (16 x 16 int32, one a digit: one digit
// leaves tmm1 / 5 unused), tmm2 / 6 A (x: 16 rows x 32 k, the digits in turn), tmm3 / 7 B (the
// weights: 8 rows of 16 x 4 k).
inline const kiln_int8::TileConfig& w4a8_tile_config() {
  static const kiln_int8::TileConfig cfg = [] {
    kiln_int8::TileConfig c;
    const uint16_t colsb[8] = {64, 64, 32, 64, 64, 64, 32, 64};
    const uint8_t rows[8] = {16, 16, 16, 8, 16, 16, 16, 8};
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = colsb[t];
      c.rows[t] = rows[t];
    }
    return c;
  }();
  return cfg;
}

// One group's integer sums for 16 rows of x from m0, into tile TC (digit 0) and TC1 (digit
// 1, two digits only; the tiles run them while the core scales the group before), and the
// sums of those tiles times the group's scales into the rows' float accumulators fd. Macros:
// the tile intrinsics take literal tile numbers.
#define KILN_DIGIT_SUMS(TC, TA, TB, g, l)                                     \
  do {                                                                        \
    _tile_zero(TC);                                                           \
    _tile_loadd(TA, a.xq + (m0 * ND + (l)) * a.K + (g) * kGroup, ND * a.K);   \
    _tile_dpbsud(TC, TA, TB);                                                 \
  } while (0)
#define KILN_GROUP_SUMS(TC, TC1, TA, TB, g)                        \
  do {                                                             \
    _tile_loadd(TB, unpacked + (g) * 512, 64);                     \
    KILN_DIGIT_SUMS(TC, TA, TB, g, 0);                             \
    if constexpr (ND == 2) KILN_DIGIT_SUMS(TC1, TA, TB, g, 1);               \
  } while (0)
#define KILN_GROUP_SCALE(TC, TC1, g)                               \
  do {                                                             \
    _tile_stored(TC, sums, 64);                                    \
    if constexpr (ND == 2) _tile_stored(TC1, sums + 256, 64);                \
    group_scale<ND>(a, db, m0, (g), sums, fd);                     \
  } while (0)

// sums: ND tiles of 16 rows x 16 int32, one a digit.
template <int ND>
inline void group_scale(const Args& a, const uint16_t* db, int64_t m0, int64_t g,
                        const int32_t* sums, __m512* fd) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(db + g * kRows)));
  for (int r = 0; r < 16; ++r) {
    __m512i digit[ND];
    for (int l = 0; l < ND; ++l) digit[l] = _mm512_load_si512(sums + 256 * l + 16 * r);
    const __m512 acc = _mm512_cvtepi32_ps(combine_digits<ND>(
        digit, [](__m512i x, __m512i y) { return _mm512_add_epi32(x, y); },
        [](__m512i x) { return _mm512_slli_epi32(x, 7); }));
    fd[r] = _mm512_fmadd_ps(acc, _mm512_mul_ps(d, _mm512_set1_ps(a.sx[(m0 + r) * a.G + g])), fd[r]);
  }
}

// Scratch of block_amx: the block's B tiles (512 bytes a group), then its minimums as floats.
inline int64_t amx_scratch_bytes(int64_t G) { return G * (512 + kRows * 4); }

// fm (the minimums' terms: the same fmas in the same order as block_tile's) runs after the
// groups, so the 16 rows' fd alone stay in registers through the tile loop. M: a multiple
// of 16.
template <int ND>
inline void block_amx(const Args& a, int64_t rb, int64_t M, uint8_t* unpacked) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const uint8_t* wb = a.qw + rb * a.G * kChunk;
  const uint16_t* db = a.d + rb * a.G * kRows;
  const uint16_t* mb = a.mn + rb * a.G * kRows;
  for (int64_t g = 0; g < a.G; ++g)     // the block's B tiles, 512 bytes a group
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(wb + g * kChunk + 64 * c);
      _mm512_storeu_si512(unpacked + g * 512 + 128 * c, _mm512_and_si512(v, mask));
      _mm512_storeu_si512(unpacked + g * 512 + 128 * c + 64,
                          _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
    }
  float* mnf = reinterpret_cast<float*>(unpacked + a.G * 512);
  for (int64_t g = 0; g < a.G; ++g)
    _mm512_storeu_ps(mnf + g * kRows, _mm512_cvtph_ps(_mm256_loadu_si256(
                                         reinterpret_cast<const __m256i*>(mb + g * kRows))));
  alignas(64) int32_t sums[256 * ND];
  const int64_t G = a.G;
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    __m512 fd[16];
    for (int r = 0; r < 16; ++r) fd[r] = _mm512_setzero_ps();
    KILN_GROUP_SUMS(0, 1, 2, 3, 0);
    for (int64_t g = 0; g < G; g += 2) {   // group g on tiles 0-3, g + 1 on 4-7
      if (g + 1 < G) KILN_GROUP_SUMS(4, 5, 6, 7, g + 1);
      KILN_GROUP_SCALE(0, 1, g);
      if (g + 2 < G) KILN_GROUP_SUMS(0, 1, 2, 3, g + 2);
      if (g + 1 < G) KILN_GROUP_SCALE(4, 5, g + 1);
    }
    float* y = a.y + m0 * a.N + rb * kRows;
    for (int r = 0; r < 16; ++r) _mm512_storeu_ps(y + r * a.N, fd[r]);   // fd, for now
    __m512 fm[16];
    for (int r = 0; r < 16; ++r) fm[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const __m512 mn = _mm512_loadu_ps(mnf + g * kRows);
      for (int r = 0; r < 16; ++r)
        fm[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.cx[(m0 + r) * G + g]), fm[r]);
    }
    const __m512 b = a.bias ? _mm512_loadu_ps(a.bias + rb * kRows) : _mm512_setzero_ps();
    for (int r = 0; r < 16; ++r)
      _mm512_storeu_ps(y + r * a.N,
                       _mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(y + r * a.N), fm[r]), b));
  }
}
#undef KILN_DIGIT_SUMS
#undef KILN_GROUP_SUMS
#undef KILN_GROUP_SCALE
#endif

}  // namespace kiln_int4_a8
