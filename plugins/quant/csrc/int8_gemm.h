// The int8 GEMM behind the batched paths of kiln::linear_int8_a8 (W8A8, linear_int8_a8.cpp) and
// kiln::linear_int8 (x's digits, linear_weight_only.cpp):
//
//   acc[m, n] = sum_k a[m, k] * w[n, k]      a: [M, K] int8, w: [N, K] int8 (row-major),
//                                            acc: [M, N] int32 (exact: K * 128 * 128 < 2^31)
//
// At the `amx` ISA level (the plan's code is compiled with -mamx-int8) on AMX tiles; at the
// VNNI levels below it on vpdpbusd in the same plan (vnni_rows16); for shapes neither takes
// (K not a multiple of 64, N under 16 or 32), ATen's _int_mm (oneDNN's s8 GEMM). Same
// integers every way. oneDNN re-lays the weight out on every call (it has no packed copy to
// keep in an AOTInductor plan): SmolLM2's tied lm_head (49152 x 576) took 1.6 ms at 4 rows of
// x and 2.0 ms at 32 on an AMX Xeon, against 0.57 ms at 3 rows in the VNNI GEMV; its w13 at 32
// rows 256 us on a Zen 4 pair, against 161 on vpdpbusd here.
//
// The tiles run the weight as the A operand, so it needs no re-layout at all: a tile is 16
// weight rows x 64 k, loaded straight from w with stride K. x is the B operand, laid out once
// per call in VNNI order (per 16 rows of x and 64 k: 16 rows of (16 x-rows x 4 k) bytes; rows
// of x past M are zeros). Each task takes 32 weight rows (2 A tiles) against 32 rows of x at a
// time (2 B tiles, in L1 after the first task), accumulating 4 C tiles of 16 x 16 int32 over
// K; each C tile (weight rows x x-rows) is stored transposed into acc (or through the caller's
// store: W8A8 scales it into its float output there). Weights are read from
// memory once per call whatever M is.
#pragma once

#include <ATen/ATen.h>

#include "../../csrc/parallel.h"
#include "../../csrc/transpose16.h"
#include "int8_dot.h"   // dot_scalar

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KILN_INT8_GEMM_AMX 1
#else
#define KILN_INT8_GEMM_AMX 0
#endif

namespace kiln_int8 {

#if KILN_INT8_GEMM_AMX

// Linux hands a process the AMX tile state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA); without it the first tile instruction faults. Asked once; where
// the kernel refuses, the GEMM stays on _int_mm.
inline bool amx_ready() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-3: C (16 weight rows x 16 x-rows, int32), tmm4-5: A (16 weight rows x 64 k),
// tmm6-7: B (16 x 4k-groups x (16 x-rows x 4 k)): every tile 16 rows of 64 bytes.
inline const TileConfig& tile_config() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    return c;
  }();
  return cfg;
}

#endif  // KILN_INT8_GEMM_AMX

#if KILN_INT8_GEMM_AMX || KILN_INT8_DOT_VNNI

// x [M, K] int8 -> B tiles: for each block of 16 rows of x and each 64 k, 1 KiB whose row p
// holds, for x-rows j = 0..15, the 4 bytes x[16 b + j, 64 c + 4 p .. + 3] (zeros past M).
// In bytes, so a bf16 x (K = 2 x its elements) and an fp32 x (4 x) pack the same way: 2 k or
// one k a dword. With `offset`, x's bytes are stored as unsigned, x + 128 (the VNNI GEMM's u8
// operand). Each tile is one 16 x 16 transpose of dwords (the block's 16 rows of 64 bytes,
// rows past M loaded as zeros), so the buffer is not zeroed first. Blocks of rows go in
// parallel (packing a decode batch's x on the calling thread alone measured level in fp32 and
// 0.83x-0.94x in W8A8).
struct BTiles {
  std::unique_ptr<int8_t[]> bytes;
  const int8_t* data() const { return bytes.get(); }
};

inline BTiles pack_b(const int8_t* x, int64_t M, int64_t K, bool offset = false) {
  const __m512i flip = _mm512_set1_epi32(offset ? static_cast<int>(0x80808080u) : 0);
  const int64_t mblocks = (M + 15) / 16, kchunks = K / 64;
  BTiles b{std::unique_ptr<int8_t[]>(new int8_t[mblocks * kchunks * 1024])};
  const int64_t chunk = kiln::chunk_items(mblocks, 16 * K, 256 << 10);
  kiln::parallel_chunks(mblocks, chunk, [&](int64_t b0, int64_t b1) {
    for (int64_t mb = b0; mb < b1; ++mb) {
      const int64_t rows = std::min<int64_t>(16, M - mb * 16);
      for (int64_t c = 0; c < kchunks; ++c) {
        __m512i r[16];
        for (int64_t j = 0; j < 16; ++j)
          r[j] = j < rows ? _mm512_xor_si512(
                                _mm512_loadu_si512(x + (mb * 16 + j) * K + c * 64), flip)
                          : _mm512_setzero_si512();
        kiln::transpose16x16(r);
        int8_t* tile = b.bytes.get() + (mb * kchunks + c) * 1024;
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(tile + p * 64, r[p]);
      }
    }
  });
  return b;
}

// Column j < cols_m of one C tile (stored to buf: C[i][j] at buf[16 i + j]) as one vector of
// its 16 rows, handed to emit(j, column): a 16 x 16 transpose of int32 in registers.
template <class Emit>
inline void transpose_tile(const int32_t* buf, int64_t cols_m, Emit&& emit) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(buf + i * 16);
  kiln::transpose16x16(r);
  for (int64_t j = 0; j < cols_m; ++j) emit(j, r[j]);
}

// acc[m0 + j, n0 + i] = C[i][j] for the first cols_m columns of one C tile: the tiles' store
// where the caller takes the int32 sums (or bf16's float32 bits) as they are.
struct StoreAcc {
  int32_t* acc;
  int64_t N;
  void operator()(const int32_t* buf, int64_t n0, int64_t m0, int64_t cols_m) const {
    transpose_tile(buf, cols_m, [&](int64_t j, __m512i col) {
      _mm512_storeu_si512(acc + (m0 + j) * N + n0, col);
    });
  }
};

#endif

#if KILN_INT8_DOT_VNNI && !KILN_INT8_GEMM_AMX

// The VNNI GEMM: the AMX tiles' plan on vpdpbusd. A task is 16 weight rows; their C (16
// weight rows x 16 x-rows, int32) is 16 registers, register i row n0 + i with one x-row a
// lane, so it stores as the C tile does and goes through the same stores. Per 4 k: one
// 64-byte load of x's B tile row (x + 128 as u8: vpdpbusd multiplies u8 by s8) and 16
// vpdpbusd, each with 4 bytes of a weight row broadcast from memory (s8, straight from w:
// no re-layout). The 128 * sum_k w[n, k] the offset adds is taken off per weight row. The
// 16 rows (16 K bytes, contiguous) stay in L1 while every 16-row block of x passes over
// them; the next task's rows are prefetched during the first pass.
// The same loops run fp32 (kF32: gemm_f32_dot.h): K counts bytes, a dword holds one k, one
// FMA into float32 lanes (no offset: the operands are signed); and bf16 (kBf16, AVX-512 BF16:
// linear_float.cpp): a dword holds two k, one vdpbf16ps into float32 lanes.
//
// C of 16 weight rows (wt: 16 K bytes) and one 16-row block of x's B tiles (bt) into buf
// (C[i][j] at buf[16 i + j]; float32 bits for fp32), without the int8 offset's correction.
// kHalf: only the block's first 8 x-rows, on 256-bit registers (half the instructions; the
// rest of buf is left as is). With `next`, the 16 K bytes there are prefetched into L1 on the
// way.
enum class Dp { kInt8, kF32, kBf16 };

template <bool kHalf, Dp kDp = Dp::kInt8>
inline void vnni_block(const int8_t* wt, int64_t K, const int8_t* bt, const int8_t* next,
                       int32_t* buf) {
  using V = std::conditional_t<kHalf, __m256i, __m512i>;
  V acc[16];
  for (int i = 0; i < 16; ++i) {
    if constexpr (kHalf) acc[i] = _mm256_setzero_si256();
    else acc[i] = _mm512_setzero_si512();
  }
  // Per 64 bytes of k: x's B tile rows in two halves of 8 registers, each against the 16
  // weight rows four at a time (one pointer stepping 4 K, the rows at + K, 2 K, 3 K from it:
  // sixteen row pointers would spill out of the general registers), 8 vpdpbusd (FMAs) into
  // each of the four rows' accumulators, their chains interleaved, the weights broadcast
  // from memory.
  for (int64_t c = 0; c < K / 64; ++c) {
    if (next)
      for (int i = 0; i < 16; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(next + c * 1024 + i * 64), _MM_HINT_T0);
    const int8_t* xc = bt + c * 1024;
    for (int h = 0; h < 2; ++h) {
      V xv[8];
      for (int q = 0; q < 8; ++q) {
        const int8_t* src = xc + (8 * h + q) * 64;
        if constexpr (kHalf) xv[q] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
        else xv[q] = _mm512_loadu_si512(src);
      }
      const int8_t* wr = wt + c * 64 + 32 * h;
#pragma GCC unroll 4
      for (int g = 0; g < 16; g += 4, wr += 4 * K) {
#pragma GCC unroll 8
        for (int q = 0; q < 8; ++q) {
#pragma GCC unroll 4
          for (int r = 0; r < 4; ++r) {
            int32_t wv;
            std::memcpy(&wv, wr + r * K + 4 * q, 4);
            V& a = acc[g + r];
            if constexpr (kDp == Dp::kBf16) {
#if defined(__AVX512BF16__)
              if constexpr (kHalf)
                a = _mm256_castps_si256(_mm256_dpbf16_ps(
                    _mm256_castsi256_ps(a), (__m256bh)xv[q], (__m256bh)_mm256_set1_epi32(wv)));
              else
                a = _mm512_castps_si512(_mm512_dpbf16_ps(
                    _mm512_castsi512_ps(a), (__m512bh)xv[q], (__m512bh)_mm512_set1_epi32(wv)));
#endif
            } else if constexpr (kDp == Dp::kF32) {
              float wf;   // as a float: the load folds into the FMA as a broadcast operand
              std::memcpy(&wf, wr + r * K + 4 * q, 4);
              if constexpr (kHalf)
                a = _mm256_castps_si256(_mm256_fmadd_ps(
                    _mm256_castsi256_ps(xv[q]), _mm256_set1_ps(wf), _mm256_castsi256_ps(a)));
              else
                a = _mm512_castps_si512(_mm512_fmadd_ps(
                    _mm512_castsi512_ps(xv[q]), _mm512_set1_ps(wf), _mm512_castsi512_ps(a)));
            } else if constexpr (kHalf) {
              a = _mm256_dpbusd_epi32(a, xv[q], _mm256_set1_epi32(wv));
            } else {
              a = _mm512_dpbusd_epi32(a, xv[q], _mm512_set1_epi32(wv));
            }
          }
        }
      }
    }
  }
  for (int i = 0; i < 16; ++i) {
    if constexpr (kHalf) _mm256_store_si256(reinterpret_cast<__m256i*>(buf + 16 * i), acc[i]);
    else _mm512_store_si512(buf + 16 * i, acc[i]);
  }
}

template <Dp kDp, class Store>
inline void vnni_rows16(const int8_t* w, int64_t n0, int64_t K, const int8_t* b, int64_t M,
                        const Store& store) {
  const int64_t kchunks = K / 64, mblocks = (M + 15) / 16;
  const int8_t* wt = w + n0 * K;
  alignas(64) int32_t buf[256] = {};   // (a half block leaves columns 8..15 unused)
  __m512i off[16];   // int8: 128 * sum_k w[n0 + i, k], what x's offset added
  if constexpr (kDp == Dp::kInt8) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (int i = 0; i < 16; ++i) {
      __m512i s = _mm512_setzero_si512();
      for (int64_t c = 0; c < kchunks; ++c)
        s = _mm512_dpbusd_epi32(s, ones, _mm512_loadu_si512(wt + i * K + c * 64));
      off[i] = _mm512_set1_epi32(128 * _mm512_reduce_add_epi32(s));
    }
  }
  for (int64_t mb = 0; mb < mblocks; ++mb) {
    const int64_t rows = std::min<int64_t>(16, M - mb * 16);
    const int8_t* next = mb == 0 ? wt + 16 * K : nullptr;
    if (rows <= 8) vnni_block<true, kDp>(wt, K, b + mb * kchunks * 1024, next, buf);
    else vnni_block<false, kDp>(wt, K, b + mb * kchunks * 1024, next, buf);
    if constexpr (kDp == Dp::kInt8)
      for (int i = 0; i < 16; ++i)
        _mm512_store_si512(buf + 16 * i,
                           _mm512_sub_epi32(_mm512_load_si512(buf + 16 * i), off[i]));
    store(buf, n0, mb * 16, rows);
  }
}

// The float32 sums of a block (fp32) into y [M, N], plus the bias where there is one.
struct StoreF32 {
  float* y;
  int64_t N;
  const float* b;
  void operator()(const int32_t* buf, int64_t n0, int64_t m0, int64_t cols_m) const {
    const __m512 bias = b ? _mm512_loadu_ps(b + n0) : _mm512_setzero_ps();
    transpose_tile(buf, cols_m, [&](int64_t j, __m512i col) {
      const __m512 v = _mm512_castsi512_ps(col);
      _mm512_storeu_ps(y + (m0 + j) * N + n0, b ? _mm512_add_ps(v, bias) : v);
    });
  }
};

// Every whole block of 16 weight rows (N / 16 of them) against x's B tiles (pack_b, with
// offset for int8), spread over the engine's threads.
template <Dp kDp = Dp::kInt8, class Store = StoreAcc>
inline void vnni_row_blocks(const int8_t* w, int64_t K, const int8_t* b, int64_t M, int64_t N,
                            const Store& store) {
  const int64_t blocks = N / 16;
  const int64_t chunk = kiln::chunk_items(blocks, 1, blocks, 8);
  kiln::parallel_chunks(blocks, chunk, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) vnni_rows16<kDp>(w, i * 16, K, b, M, store);
  });
}

#endif

#if KILN_INT8_GEMM_AMX

// One tile product C += A B: int8 (4 k a dword, int32 sums) or, with kBf16, bf16 (2 k a
// dword, float32 sums: bf16_gemm.h), whose tiles are laid out alike in bytes.
#if defined(__AMX_BF16__)
#define KILN_TILE_DP(c, a, b)                 \
  do {                                        \
    if constexpr (kBf16)                      \
      _tile_dpbf16ps(c, a, b);                \
    else                                      \
      _tile_dpbssd(c, a, b);                  \
  } while (0)
#else
#define KILN_TILE_DP(c, a, b) _tile_dpbssd(c, a, b)
#endif

// 32 weight rows [n0, n0 + 32) (both A tiles valid) against every block pair of x. K counts
// bytes of a row (int8: its elements; bf16: twice them); store takes each C tile.
template <bool kBf16 = false, class Store = StoreAcc>
inline void amx_rows32(const int8_t* w, int64_t n0, int64_t K, const int8_t* b, int64_t M,
                       const Store& store) {
  const int64_t kchunks = K / 64, mblocks = (M + 15) / 16;
  alignas(64) int32_t buf[4][256];
  for (int64_t mb = 0; mb < mblocks; mb += 2) {
    const bool two = mb + 1 < mblocks;
    const int8_t* b0 = b + mb * kchunks * 1024;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (two) {
      const int8_t* b1 = b0 + kchunks * 1024;
      for (int64_t c = 0; c < kchunks; ++c) {
        _tile_loadd(4, w + n0 * K + c * 64, K);
        _tile_loadd(5, w + (n0 + 16) * K + c * 64, K);
        _tile_loadd(6, b0 + c * 1024, 64);
        _tile_loadd(7, b1 + c * 1024, 64);
        KILN_TILE_DP(0, 4, 6);
        KILN_TILE_DP(1, 4, 7);
        KILN_TILE_DP(2, 5, 6);
        KILN_TILE_DP(3, 5, 7);
      }
    } else {   // the last 16 rows of x (or fewer): tiles 1 and 3 stay zero, unused
      for (int64_t c = 0; c < kchunks; ++c) {
        _tile_loadd(4, w + n0 * K + c * 64, K);
        _tile_loadd(5, w + (n0 + 16) * K + c * 64, K);
        _tile_loadd(6, b0 + c * 1024, 64);
        KILN_TILE_DP(0, 4, 6);
        KILN_TILE_DP(2, 5, 6);
      }
    }
    _tile_stored(0, buf[0], 64);
    _tile_stored(1, buf[1], 64);
    _tile_stored(2, buf[2], 64);
    _tile_stored(3, buf[3], 64);
    const int64_t m0 = mb * 16, cols0 = std::min<int64_t>(16, M - m0);
    store(buf[0], n0, m0, cols0);
    store(buf[2], n0 + 16, m0, cols0);
    if (two) {
      const int64_t cols1 = std::min<int64_t>(16, M - m0 - 16);
      store(buf[1], n0, m0 + 16, cols1);
      store(buf[3], n0 + 16, m0 + 16, cols1);
    }
  }
}

// Every whole block of 32 weight rows (N / 32 of them) against x's B tiles, spread over the
// engine's threads, each with the tile configuration loaded for its chunks.
// Each C tile goes to store(buf, n0, m0, cols_m) (StoreAcc: into acc [M, N] as it is).
template <bool kBf16 = false, class Store = StoreAcc>
inline void amx_row_blocks(const int8_t* w, int64_t K, const int8_t* b, int64_t M,
                           int64_t N, const Store& store) {
  // at least 8 chunks a thread, down to one block where there are few (wo and w2 of SmolLM2:
  // 18 blocks, where chunks of 4 left one thread 10 blocks and the other 8); no byte bound
  const int64_t blocks = N / 32;
  const int64_t chunk = kiln::chunk_items(blocks, 1, blocks, 8);
  kiln::parallel_chunks(blocks, chunk, [&](int64_t i0, int64_t i1) {
    _tile_loadconfig(&tile_config());
    for (int64_t i = i0; i < i1; ++i) amx_rows32<kBf16>(w, i * 32, K, b, M, store);
    _tile_release();
  });
}

#endif  // KILN_INT8_GEMM_AMX

// The weight rows [n0, n1) past the tiles' whole blocks: scalar dot products (at most 31).
inline void scalar_rows(const int8_t* w, int64_t n0, int64_t n1, int64_t K, const int8_t* x,
                        int64_t M, int32_t* acc, int64_t N) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) acc[m * N + n] = dot_scalar(x + m * K, w + n * K, 0, K);
}

// Whether int8_gemm runs on AMX tiles for these shapes (else the VNNI GEMM or _int_mm).
inline bool int8_gemm_on_tiles(int64_t M, int64_t N, int64_t K) {
#if KILN_INT8_GEMM_AMX
  return M > 0 && N >= 32 && K >= 64 && K % 64 == 0 && amx_ready();
#else
  (void)M, (void)N, (void)K;
  return false;
#endif
}

// Whether int8_gemm runs on the VNNI GEMM for these shapes (VNNI levels without AMX; else
// _int_mm).
inline bool int8_gemm_on_vnni(int64_t M, int64_t N, int64_t K) {
#if KILN_INT8_DOT_VNNI && !KILN_INT8_GEMM_AMX
  return M > 0 && N >= 16 && K >= 64 && K % 64 == 0;
#else
  (void)M, (void)N, (void)K;
  return false;
#endif
}

#if KILN_INT8_GEMM_AMX || KILN_INT8_DOT_VNNI
// The whole blocks of weight rows through this level's GEMM, for shapes int8_gemm_on_tiles or
// int8_gemm_on_vnni takes: x laid out as its B tiles, each block of sums handed to store.
// Returns the first weight row past the blocks (the caller's scalar rows, at most 31).
template <class Store>
inline int64_t int8_blocks(const int8_t* w, int64_t K, const int8_t* x, int64_t M, int64_t N,
                           const Store& store) {
#if KILN_INT8_GEMM_AMX
  const BTiles b = pack_b(x, M, K);
  amx_row_blocks(w, K, b.data(), M, N, store);
  return N / 32 * 32;
#else
  const BTiles b = pack_b(x, M, K, /*offset=*/true);
  vnni_row_blocks(w, K, b.data(), M, N, store);
  return N / 16 * 16;
#endif
}
#endif

// -> acc [M, N] int32 (see the top of this file). oneDNN misreads the strides of a [N, 1] or
// [1, K] weight's transpose (garbage, no error): callers keep K and N >= 8 on that path.
inline at::Tensor int8_gemm(const int8_t* x, int64_t M, const int8_t* w, int64_t N, int64_t K) {
#if KILN_INT8_GEMM_AMX || KILN_INT8_DOT_VNNI
  if (int8_gemm_on_tiles(M, N, K) || int8_gemm_on_vnni(M, N, K)) {
    at::Tensor out = at::empty({M, N}, at::TensorOptions().dtype(at::kInt));
    int32_t* acc = out.data_ptr<int32_t>();
    const int64_t whole = int8_blocks(w, K, x, M, N, StoreAcc{acc, N});
    scalar_rows(w, whole, N, K, x, M, acc, N);
    return out;
  }
#endif
  return at::_int_mm(
      at::from_blob(const_cast<int8_t*>(x), {M, K}, at::kChar),
      at::from_blob(const_cast<int8_t*>(w), {N, K}, at::kChar).t());
}

}  // namespace kiln_int8
