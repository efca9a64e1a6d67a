// kiln::linear_fp32 at a decode batch's rows of x (kDotMinM..kDotMaxM): out = x W^T on the
// weight as the plan holds it ([N, K] row-major: no packed copy, the tied lm_head reads the
// embedding's own buffer).
//
// x is copied transposed in blocks of 8 rows (xt [Mp / 8, K, 8], Mp = M rounded up to 8,
// zero-padded), so a vector holds one k of 8 rows of x; a tile keeps NR weight rows x MB
// vectors of rows in registers (2 x 6 or 1 x 12 accumulators) and per k broadcasts each
// weight w[n, k] against the MB vectors: no horizontal sums, MB + NR loads per MB * NR FMAs.
// A thread takes kDotGroup weight rows (27 KiB at K = 576: they stay in L1) through every
// tile of xt (from L2), so each weight is read from memory once a call.
//
// Each output is one FMA chain over k = 0 .. K-1 in order, then + bias: the same bits
// whichever tile or number of rows (from kDotMinM) the row is computed in -- a row's output
// does not depend on the batch.
//
// Where it runs (f32_dot_runs): AVX2 builds, faster than MKL's sgemm on the AMD EPYC AVX2 host
// (bench/linear_fp32_dot.py, docs/PERFORMANCE.md); and AVX-512 builds on CPUs other than
// Intel's, where MKL takes its AVX2 code and threads small M poorly: a decode step's linears
// (30 SmolLM2 layers, 2 threads, AMD Zen 4) 2.73x / 1.76x / 1.40x faster than MKL at 8 / 32 /
// 64 rows (bench/kernel_levels.py). On an Intel Xeon with AVX-512 (AMX; quiet, 2 threads, 32
// rows) MKL took 0.69-0.87 of its time, with 512-bit vectors in 2 x 12 tiles as with these,
// so there AVX-512 builds keep BLAS (linear_float.cpp), as do builds without AVX2.
//
// Off Intel CPUs a prefill's rows (more than f32_dot_max_rows) go through it too, in near-equal
// chunks of at most that many rows: MKL's AVX2 code runs at half the FMA rate of a 512-bit
// datapath (AMD Zen 5: 30 SmolLM2 layers, 2 threads, 256 / 470 / 512 rows 1.69x / 1.56x /
// 1.67x faster than MKL; level on Zen 4; AVX2 builds 1.10x), and every row of a batch then
// gets the bits it would get in a decode step.
#pragma once

#include <cmath>
#include <cstring>
#include <vector>

#include "dequant_gemv.h"

#if KILN_QUANT_AVX2
#include <cpuid.h>
#endif

namespace kiln_gemv {

constexpr int64_t kDotMinM = kTileMinM;
constexpr int64_t kDotMaxM = 64;

#if KILN_QUANT_AVX2
#define KILN_F32_DOT 1
// CPUID leaf 0's vendor string and leaf 1's family (base plus extended).
struct CpuId {
  char vendor[13] = {};
  unsigned family = 0;
};
inline const CpuId& cpu_id() {
  static const CpuId id = [] {
    CpuId r;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return r;
    std::memcpy(r.vendor, &b, 4);
    std::memcpy(r.vendor + 4, &d, 4);
    std::memcpy(r.vendor + 8, &c, 4);
    if (__get_cpuid(1, &a, &b, &c, &d)) {
      r.family = (a >> 8) & 0xf;
      if (r.family == 0xf) r.family += (a >> 20) & 0xff;
    }
    return r;
  }();
  return id;
}
// Whether this CPU is Intel's: MKL's own kernels are there.
inline bool cpu_is_intel() { return std::strcmp(cpu_id().vendor, "GenuineIntel") == 0; }
// AMD from Zen 5 (family 0x1A) on executes 512-bit vector ops at full width; Zen 4 (0x19)
// splits each in two 256-bit halves.
inline bool cpu_amd_full_width_512() {
  return std::strcmp(cpu_id().vendor, "AuthenticAMD") == 0 && cpu_id().family >= 0x1a;
}

inline bool f32_dot_runs() {
#if defined(__AVX512F__)
  return !cpu_is_intel();
#else
  return true;
#endif
}

// The most rows of x it takes: kDotMaxM; 128 in AVX-512 builds (off Intel), where it also
// beats MKL at a short prefill's rows (AMD Zen 4, 30 SmolLM2 layers, 2 threads: 96 rows
// 126-131 against 150-174 ms, 128 rows 170-177 against 188-203, level at 256).
inline int64_t f32_dot_max_rows() {
#if defined(__AVX512F__)
  return 2 * kDotMaxM;
#else
  return kDotMaxM;
#endif
}
// Whether more rows than that go through it in chunks (see above) rather than to BLAS.
inline bool f32_dot_chunks() { return !cpu_is_intel(); }
constexpr int64_t kDotGroup = 12;   // weight rows a thread takes at a time
using dvec = __m256;                // 16 registers: tiles of 2 x 6 or 1 x 12 accumulators
constexpr int kDotL = 8;
constexpr int kDotMB = 2;
inline dvec dload(const float* p) { return _mm256_loadu_ps(p); }
inline dvec dset1(float v) { return _mm256_set1_ps(v); }
inline dvec dzero() { return _mm256_setzero_ps(); }
inline dvec dfma(dvec a, dvec b, dvec c) { return _mm256_fmadd_ps(a, b, c); }
inline void dstore(float* p, dvec v) { _mm256_storeu_ps(p, v); }

// Rows [m0, m0 + MB * kDotL) of xt against weight rows n .. n + NR: out rows m0..
// (those < M). With `prefetch`, the group of weight rows after this one is asked into L2.
template <int MB, int NR>
inline void dot_tile(const float* xt, int64_t m0, int64_t M, const float* w,
                     int64_t K, int64_t n, const float* bias, float* out, int64_t N,
                     bool prefetch) {
  dvec acc[NR][MB];
  for (int i = 0; i < NR; ++i)
    for (int b = 0; b < MB; ++b) acc[i][b] = dzero();
  const float* wn = w + n * K;
  const float* xp = xt + m0 * K;   // block m0 / L, then the next MB - 1
  for (int64_t k = 0; k < K; ++k) {
    if (prefetch && k % 16 == 0)
      for (int i = 0; i < NR; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(wn + (kDotGroup + i) * K + k), _MM_HINT_T1);
    dvec xv[MB];
    for (int b = 0; b < MB; ++b) xv[b] = dload(xp + (b * K + k) * kDotL);
    for (int i = 0; i < NR; ++i) {
      const dvec wb = dset1(wn[i * K + k]);
      for (int b = 0; b < MB; ++b) acc[i][b] = dfma(wb, xv[b], acc[i][b]);
    }
  }
  float col[MB * kDotL];
  const int64_t rows = std::min<int64_t>(MB * kDotL, M - m0);
  for (int i = 0; i < NR; ++i) {
    for (int b = 0; b < MB; ++b) dstore(col + b * kDotL, acc[i][b]);
    const float bn = bias ? bias[n + i] : 0.0f;
    for (int64_t r = 0; r < rows; ++r) out[(m0 + r) * N + n + i] = col[r] + bn;
  }
}

// Every row of x against weight rows n .. n + R (R = kDotGroup, or 1 for the last N % group).
template <int R>
inline void dot_rows(const float* xt, int64_t Mp, int64_t M, const float* w, int64_t K,
                     int64_t n, const float* bias, float* out, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += kDotMB * kDotL) {
    const bool first = m0 == 0;
    if (Mp - m0 >= kDotMB * kDotL) {
      constexpr int NR = R == 1 ? 1 : R / 2;   // two 2 x 6 tiles: 12 of the 16 registers
      for (int i = 0; i < R; i += NR)
        dot_tile<kDotMB, NR>(xt, m0, M, w, K, n + i, bias, out, N, first);
    } else {
      dot_tile<1, R>(xt, m0, M, w, K, n, bias, out, N, first);
    }
  }
}

// out [M, N] = x [M, K] W^T (+ bias), w [N, K]; parallel over groups of kDotGroup weight rows.
inline void dot_gemm(const float* w, const float* x, int64_t M, int64_t K, int64_t N,
                     const float* bias, float* out) {
  const int64_t Mp = (M + kDotL - 1) / kDotL * kDotL;
  std::vector<float> xt(static_cast<size_t>(K * Mp), 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xt[((m / kDotL) * K + k) * kDotL + m % kDotL] = x[m * K + k];
  const int64_t groups = (N + kDotGroup - 1) / kDotGroup;
  const int64_t group_bytes = kDotGroup * K * static_cast<int64_t>(sizeof(float));
  kiln::parallel_chunks(groups, kiln::chunk_items(groups, group_bytes, 64 << 10),
                        [&](int64_t g0, int64_t g1) {
    for (int64_t n = g0 * kDotGroup; n < std::min(N, g1 * kDotGroup); n += kDotGroup) {
      if (n + kDotGroup <= N)
        dot_rows<kDotGroup>(xt.data(), Mp, M, w, K, n, bias, out, N);
      else
        for (int64_t i = n; i < N; ++i) dot_rows<1>(xt.data(), Mp, M, w, K, i, bias, out, N);
    }
  });
}

#if KILN_INT8_DOT_VNNI && !KILN_INT8_GEMM_AMX
// The same product with x laid out once per call as int8_gemm.h's B tiles (pack_b: per block
// of 16 rows of x, a vector of the 16 rows per k), each weight broadcast from its row into
// 512-bit FMAs. Up to 16 rows of x (one block) on int8_gemm.h's broadcast GEMM in fp32
// (vnni_row_blocks: 16 weight rows x the block); from 17 rows on two blocks at a time against
// 12 weight rows (bcast_tile<2, 12>: 24 accumulators, per k two vector loads of x and 12
// broadcasts for 24 FMAs, where one block takes a load for each FMA). Each output is the same
// FMA chain over k in order, then + bias, as dot_gemm's: the same bits at any batch. For K a
// multiple of 16 and N >= 16.
#define KILN_F32_BCAST 1
// Where it beat the register tiles (Zen 4, 2 threads, SmolLM2's shapes): from 16 rows of x on
// weights with K up to 1024 (w13 3072 x 576 at 16 / 32 / 128 rows 276-294 / 538-568 /
// 2119-2190 against 335-358 / 640-676 / 2534-2663 us); with K = 1536 a 16-row block of
// weights (96 KiB) does not stay in L1, and it ran level or slower. Where 512-bit FMAs run at
// full width (Zen 5) the tiles' 256-bit vectors are half the rate, and it takes any K: 30
// SmolLM2 layers at 16 / 32 / 128 rows 1.24x / 1.15x / 1.09x faster, Llama 3 8B-sized
// weights (K 2048 - 14336) level at 16-32 rows and 1.10x at 128; and from 9 rows (9 - 12
// rows 1.30x - 1.38x; at 8, a half block, level). The pair tiles (with pack_b's transposes)
// took those 30 layers at 31 / 64 / 118 rows 1.19x / 1.16x / 1.17x faster again (Zen 5).
inline bool f32_bcast_takes(int64_t M, int64_t N, int64_t K) {
  const bool full = cpu_amd_full_width_512();
  return M >= (full ? 9 : 16) && N >= 16 && K % 16 == 0 && (K <= 1024 || full);
}

constexpr int kBcastNR = 12;   // weight rows of a pair tile: 2 x 12 accumulators

// x's B tiles of MB 16-row blocks (bt: per block [K][16], the block's rows a vector per k)
// against weight rows n .. n + NR: per k one vector of x per block and one broadcast weight
// per row, NR * MB FMAs, each output one chain over k in order. Sums (+ bias) into out's rows
// m0 .. (those < M). With `next`, the next task's weight rows are prefetched on the way.
template <int MB, int NR>
inline void bcast_tile(const float* bt, int64_t K, int64_t m0, int64_t M, const float* w,
                       int64_t n, const float* next, const float* bias, float* out,
                       int64_t N) {
  __m512 acc[NR][MB];
#pragma GCC unroll 32
  for (int i = 0; i < NR; ++i)
    for (int b = 0; b < MB; ++b) acc[i][b] = _mm512_setzero_ps();
  const float* wn = w + n * K;
  for (int64_t k = 0; k < K; ++k) {
    if (next && k % 16 == 0)
#pragma GCC unroll 32
      for (int i = 0; i < NR; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(next + i * K + k), _MM_HINT_T0);
    __m512 xv[MB];
    for (int b = 0; b < MB; ++b) xv[b] = _mm512_loadu_ps(bt + (b * K + k) * 16);
#pragma GCC unroll 32
    for (int i = 0; i < NR; ++i) {
      const __m512 wb = _mm512_set1_ps(wn[i * K + k]);
      for (int b = 0; b < MB; ++b) acc[i][b] = _mm512_fmadd_ps(xv[b], wb, acc[i][b]);
    }
  }
#pragma GCC unroll 2
  for (int i0 = 0; i0 < NR; i0 += 16) {   // 16 weight rows at a time: one 16 x 16 transpose
    const int nr = NR - i0 < 16 ? NR - i0 : 16;
    const __mmask16 keep = static_cast<__mmask16>((1u << nr) - 1);
    const __m512 bn = bias ? _mm512_maskz_loadu_ps(keep, bias + n + i0) : _mm512_setzero_ps();
    for (int b = 0; b < MB; ++b) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < nr ? _mm512_castps_si512(acc[i0 + i][b]) : _mm512_setzero_si512();
      kiln::transpose16x16(r);
      const int64_t rows = std::min<int64_t>(16, M - m0 - 16 * b);
      for (int64_t j = 0; j < rows; ++j)
        _mm512_mask_storeu_ps(out + (m0 + 16 * b + j) * N + n + i0, keep,
                              _mm512_add_ps(_mm512_castsi512_ps(r[j]), bn));
    }
  }
}

// Weight rows n .. n + R against every block of x's B tiles: two blocks at a time as tiles of
// H rows, the last odd block alone in one tile of R rows.
template <int R, int H>
inline void bcast_rows(const float* bt, int64_t K, int64_t M, const float* w, int64_t n,
                       const float* next, const float* bias, float* out, int64_t N) {
  const int64_t blocks = (M + 15) / 16;
  for (int64_t b = 0; b < blocks; b += 2) {
    const float* nx = b == 0 ? next : nullptr;
    const float* xb = bt + b * K * 16;
    if (b + 1 < blocks) {
      for (int h = 0; h < R; h += H)
        bcast_tile<2, H>(xb, K, 16 * b, M, w, n + h, nx ? nx + h * K : nullptr, bias, out, N);
    } else {
      bcast_tile<1, R>(xb, K, 16 * b, M, w, n, nx, bias, out, N);
    }
  }
}

// Tasks of R weight rows over the engine's threads (each prefetching the next task's rows);
// the rows past them in tiles of H, then one at a time.
template <int R, int H>
inline void bcast_tasks(const float* bt, int64_t K, int64_t M, const float* w, int64_t N,
                        const float* bias, float* out) {
  const int64_t tasks = N / R;
  const int64_t chunk = kiln::chunk_items(tasks, 1, tasks, 8);
  kiln::parallel_chunks(tasks, chunk, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* next = t + 1 < tasks ? w + (t + 1) * R * K : nullptr;
      bcast_rows<R, H>(bt, K, M, w, t * R, next, bias, out, N);
    }
  });
  int64_t n = tasks * R;
  for (; n + H <= N; n += H) bcast_rows<H, H>(bt, K, M, w, n, nullptr, bias, out, N);
  for (; n < N; ++n) bcast_rows<1, 1>(bt, K, M, w, n, nullptr, bias, out, N);
}

inline void f32_bcast_gemm(const float* w, const float* x, int64_t M, int64_t K, int64_t N,
                           const float* bias, float* out) {
  const kiln_int8::BTiles b =
      kiln_int8::pack_b(reinterpret_cast<const int8_t*>(x), M, 4 * K);
  const float* bt = reinterpret_cast<const float*>(b.data());
  if (M > 16) {
    bcast_tasks<2 * kBcastNR, kBcastNR>(bt, K, M, w, N, bias, out);
    return;
  }
  kiln_int8::vnni_row_blocks<kiln_int8::Dp::kF32>(reinterpret_cast<const int8_t*>(w), 4 * K,
                                                  b.data(), M, N,
                                                  kiln_int8::StoreF32{out, N, bias});
  for (int64_t n = N / 16 * 16; n < N; ++n)
    bcast_rows<1, 1>(bt, K, M, w, n, nullptr, bias, out, N);
}
#else
#define KILN_F32_BCAST 0
#endif
#else
#define KILN_F32_DOT 0
#define KILN_F32_BCAST 0
#endif

}  // namespace kiln_gemv
