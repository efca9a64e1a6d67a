// CPU kernel of `kiln::paged_attention` (schema and semantics: plugins/paged_kv/ops.py).
//
// Two parallel passes over the packed batch:
//   1. write this step's K/V rows into their slots of the pools (in place);
//   2. attention, one work item per (sequence, query tile, kv head, context partition):
//
//        rows of a work item = the tile's query tokens x the G = H/KVH heads of one kv head
//        for each K/V block of the partition (read through block_tables, never gathered):
//            S[r][c]    =  (scale * Q[r]) . K[c]   (K read once per tile; for many rows it is
//                          first transposed to Kt[D][bs] to vectorize over the keys c)
//            online softmax (running max m, sum l) and O[r] += p[r][c] * V[c]  (float32)
//
//      A decode item (one query token: its G rows see the same keys) goes by chunks of 256
//      keys instead: every score of the chunk, one softmax step a row, then P V (decode_item).
//
// A layer's window (> 0) starts each query tile at the first block one of its rows can see:
// blocks wholly before it are never read; inside a block a row's keys are [clo, nvalid). A
// soft-cap (> 0) maps a block's scores through c * tanh(s / c) before the online softmax.
//
// Long contexts with few work items (decode at small batch) are split into partitions of
// whole blocks (flash-decoding); partial (O, m, l) go to one workspace and a third pass
// merges them. Nothing is allocated per sequence or per token.
//
// Pools of int8 or float8_e4m3fn hold quantized rows (plugins/paged_kv/kv_format.py): per
// token and kv head, D one-byte codes then a float32 scale. Pass 1 quantizes (same rounding as
// the reference, so both write the same bytes); pass 2 dequantizes a block's rows into the
// float scratch rows it already uses for bf16 pools.
//
// Rows are addressed through the pools' strides (block, token, kv head): the runtime's pools
// keep each kv head's rows of a block together (kv_format.new_pools), so a work item reads
// one run of bytes a block; contiguous [blocks, tokens, heads, row] pools work the same.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include "../../csrc/hsum4.h"
#include "../../csrc/parallel.h"
#include "../../csrc/transpose16.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

// The code path these flags selected (read back by plugins/cpp_build.kernel_path): the
// at::vec width, which is also the width pool rows are converted at (load_vec).
#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define KILN_PA_VEC "at::vec 512-bit"
#elif defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#define KILN_PA_VEC "at::vec 256-bit"
#else
#define KILN_PA_VEC "scalar at::vec"
#endif
extern "C" __attribute__((used, visibility("default")))
const char kiln_paged_attention_kernel_path[] = "KILN_KERNEL_PATH:" KILN_PA_VEC;

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Rows of a work item from which transposing each K block pays off.
constexpr int64_t kTransposeRows = 8;

// An int32 or int64 index tensor read as int64 (the metadata may come in either dtype).
struct Index {
  const void* p;
  bool is64;
  int64_t s0, s1;
  explicit Index(const at::Tensor& t)
      : p(t.data_ptr()), is64(t.scalar_type() == at::kLong), s0(t.stride(0)),
        s1(t.dim() > 1 ? t.stride(1) : 0) {}
  int64_t operator()(int64_t i, int64_t j = 0) const {
    const int64_t o = i * s0 + j * s1;
    return is64 ? static_cast<const int64_t*>(p)[o] : static_cast<const int32_t*>(p)[o];
  }
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n, float mul = 1.f) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * mul;
}

using fp8 = c10::Float8_e4m3fn;
constexpr int64_t kScaleBytes = 4;
template <typename T>
constexpr bool kQuantized = std::is_same_v<T, int8_t> || std::is_same_v<T, fp8>;
template <typename T>
constexpr float kQmax = std::is_same_v<T, int8_t> ? 127.f : 448.f;

inline float row_scale(const void* codes, int64_t D) {
  float s;
  std::memcpy(&s, static_cast<const char*>(codes) + D, sizeof(float));
  return s;
}

// kVec values of a pool row as floats (quantized: the codes, not yet times the row's scale).
template <typename cache_t>
inline Vec load_vec(const cache_t* p) {
  float tmp[kVec];
  for (int64_t i = 0; i < kVec; ++i) tmp[i] = static_cast<float>(p[i]);
  return Vec::loadu(tmp);
}
template <>
inline Vec load_vec<float>(const float* p) { return Vec::loadu(p); }
// bf16: the 16 bits become the high half of a float32. E4M3 (bias 7): sign, exponent and
// mantissa moved into float32's fields, times 2^120 (exact, subnormals included; codes never
// hold NaN: writes saturate).
#if defined(CPU_CAPABILITY_AVX512)
template <>
inline Vec load_vec<int8_t>(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
template <>
inline Vec load_vec<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <>
inline Vec load_vec<fp8>(const fp8* p) {  // E4M3 fields moved into float32's, times 2^120
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24),
                                       _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7F)), 20));
  return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(1.329227995784916e36f));
}
#elif defined(CPU_CAPABILITY_AVX2)
template <>
inline Vec load_vec<int8_t>(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <>
inline Vec load_vec<c10::BFloat16>(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <>
inline Vec load_vec<fp8>(const fp8* p) {
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24),
                                       _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7F)), 20));
  return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(1.329227995784916e36f));
}
#endif

template <typename cache_t>
inline float pool_row_scale(const cache_t* row, int64_t D) {
  if constexpr (kQuantized<cache_t>) return row_scale(row, D);
  else return 1.f;
}

// out[0:4] = the four vectors' sums.
inline void sum4(const Vec& s0, const Vec& s1, const Vec& s2, const Vec& s3, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm_storeu_ps(out, kiln::hsum4_ps(s0, s1, s2, s3));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
  auto add = [](Vec& x, Vec& y) { return x + y; };
  Vec a = s0, b = s1, c = s2, d = s3;
  out[0] = at::vec::vec_reduce_all<float>(add, a);
  out[1] = at::vec::vec_reduce_all<float>(add, b);
  out[2] = at::vec::vec_reduce_all<float>(add, c);
  out[3] = at::vec::vec_reduce_all<float>(add, d);
#endif
}

// One pool row (D values; quantized: D codes + scale) as D floats.
template <typename cache_t>
inline void load_row(const cache_t* src, float* dst, int64_t D) {
  const float s = pool_row_scale(src, D);
  int64_t d = 0;
  for (; d + kVec <= D; d += kVec) (load_vec(src + d) * Vec(s)).store(dst + d);
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]) * s;
}

// D values of a K/V row into a pool row (quantized: codes + scale = max|x| / qmax).
template <typename scalar_t, typename cache_t>
inline void store_row(const scalar_t* src, cache_t* dst, int64_t D) {
  if constexpr (!kQuantized<cache_t>) {
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<cache_t>(static_cast<float>(src[d]));
  } else {
    constexpr float qmax = kQmax<cache_t>;
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::abs(static_cast<float>(src[d])));
    const float inv = amax > 0.f ? qmax / amax : 0.f;
    for (int64_t d = 0; d < D; ++d) {
      const float y = std::min(std::max(static_cast<float>(src[d]) * inv, -qmax), qmax);
      if constexpr (std::is_same_v<cache_t, int8_t>)
        dst[d] = static_cast<int8_t>(std::nearbyint(y));
      else
        dst[d] = fp8(y);
    }
    const float scale = amax / qmax;
    std::memcpy(reinterpret_cast<char*>(dst) + D, &scale, sizeof(float));
  }
}

// y += a * x over n floats.
inline void axpy(float* y, const float* x, float a, int64_t n) {
  const Vec va(a);
  int64_t d = 0;
  for (; d + kVec <= n; d += kVec) at::vec::fmadd(va, Vec::loadu(x + d), Vec::loadu(y + d)).store(y + d);
  for (; d < n; ++d) y[d] += a * x[d];
}

// s[0:ldk] = q . kt[:, 0:ldk] for NR rows at once (kt is [D][ldk], ldk % kVec == 0),
// two column vectors per pass: 2*NR independent FMA chains.
template <int NR>
inline void scores_rows(const float* q, int64_t D, const float* kt, int64_t ldk, float* s) {
  int64_t c = 0;
  for (; c + 2 * kVec <= ldk; c += 2 * kVec) {
    Vec a[NR], b[NR];
    for (int i = 0; i < NR; ++i) a[i] = b[i] = Vec(0.f);
    for (int64_t d = 0; d < D; ++d) {
      const Vec k0 = Vec::loadu(kt + d * ldk + c), k1 = Vec::loadu(kt + d * ldk + c + kVec);
      for (int i = 0; i < NR; ++i) {
        const Vec qd(q[i * D + d]);
        a[i] = at::vec::fmadd(qd, k0, a[i]);
        b[i] = at::vec::fmadd(qd, k1, b[i]);
      }
    }
    for (int i = 0; i < NR; ++i) {
      a[i].store(s + i * ldk + c);
      b[i].store(s + i * ldk + c + kVec);
    }
  }
  for (; c < ldk; c += kVec) {
    Vec a[NR];
    for (int i = 0; i < NR; ++i) a[i] = Vec(0.f);
    for (int64_t d = 0; d < D; ++d) {
      const Vec k0 = Vec::loadu(kt + d * ldk + c);
      for (int i = 0; i < NR; ++i) a[i] = at::vec::fmadd(Vec(q[i * D + d]), k0, a[i]);
    }
    for (int i = 0; i < NR; ++i) a[i].store(s + i * ldk + c);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc0(0.f), acc1(0.f);
  int64_t d = 0;
  for (; d + 2 * kVec <= n; d += 2 * kVec) {
    acc0 = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc0);
    acc1 = at::vec::fmadd(Vec::loadu(a + d + kVec), Vec::loadu(b + d + kVec), acc1);
  }
  for (; d + kVec <= n; d += kVec) acc0 = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc0);
  float r = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc0 + acc1);
  for (; d < n; ++d) r += a[d] * b[d];
  return r;
}

// out[0:4] = a . b0..b3: four keys against one query row, one horizontal reduction.
inline void dot4(const float* a, const float* b0, const float* b1, const float* b2,
                 const float* b3, int64_t n, float* out) {
  Vec s0(0.f), s1(0.f), s2(0.f), s3(0.f);
  int64_t d = 0;
  for (; d + kVec <= n; d += kVec) {
    const Vec x = Vec::loadu(a + d);
    s0 = at::vec::fmadd(x, Vec::loadu(b0 + d), s0);
    s1 = at::vec::fmadd(x, Vec::loadu(b1 + d), s1);
    s2 = at::vec::fmadd(x, Vec::loadu(b2 + d), s2);
    s3 = at::vec::fmadd(x, Vec::loadu(b3 + d), s3);
  }
  sum4(s0, s1, s2, s3, out);
  for (; d < n; ++d) {
    out[0] += a[d] * b0[d];
    out[1] += a[d] * b1[d];
    out[2] += a[d] * b2[d];
    out[3] += a[d] * b3[d];
  }
}

// o = o * corr + sum_c p[c] * v[c] over n rows of v; D in register blocks of 4 vectors.
inline void pv_row(float* o, float corr, const float* p, int64_t n, const float* v,
                   int64_t vstride, int64_t D) {
  const Vec vc(corr);
  int64_t d = 0;
  for (; d + 4 * kVec <= D; d += 4 * kVec) {
    Vec a0 = Vec::loadu(o + d) * vc, a1 = Vec::loadu(o + d + kVec) * vc;
    Vec a2 = Vec::loadu(o + d + 2 * kVec) * vc, a3 = Vec::loadu(o + d + 3 * kVec) * vc;
    for (int64_t c = 0; c < n; ++c) {
      const Vec pc(p[c]);
      const float* vr = v + c * vstride + d;
      a0 = at::vec::fmadd(pc, Vec::loadu(vr), a0);
      a1 = at::vec::fmadd(pc, Vec::loadu(vr + kVec), a1);
      a2 = at::vec::fmadd(pc, Vec::loadu(vr + 2 * kVec), a2);
      a3 = at::vec::fmadd(pc, Vec::loadu(vr + 3 * kVec), a3);
    }
    a0.store(o + d);
    a1.store(o + d + kVec);
    a2.store(o + d + 2 * kVec);
    a3.store(o + d + 3 * kVec);
  }
  for (; d + kVec <= D; d += kVec) {
    Vec a = Vec::loadu(o + d) * vc;
    for (int64_t c = 0; c < n; ++c) a = at::vec::fmadd(Vec(p[c]), Vec::loadu(v + c * vstride + d), a);
    a.store(o + d);
  }
  for (; d < D; ++d) {
    float a = o[d] * corr;
    for (int64_t c = 0; c < n; ++c) a += p[c] * v[c * vstride + d];
    o[d] = a;
  }
}

// One unit of attention work: rows [nq tokens x G heads] of one kv head, keys [lo, hi).
struct Group {
  int64_t b;          // sequence
  int64_t t0;         // first token of the tile along T
  int64_t nq;         // tokens in the tile
  int64_t pos0;       // position of the tile's first token
  int64_t k0;         // first key of partition 0 (block-aligned; > 0 only with a window)
  int64_t kh;         // kv head
  int64_t nparts;     // context partitions (1: write the output directly)
  int64_t ws_off;     // offset of this group's partials in the workspace (nparts > 1)
};
struct Item {
  int64_t group;
  int64_t part;
};

struct Work {
  std::vector<Group> groups;
  std::vector<Item> items;  // (group, partition), what parallel_for hands out
  int64_t ws_size = 0;      // floats of partial results (groups split into partitions)
};

struct Problem {
  int64_t T, H, KVH, G, D, bs, ldk, max_rows, part_len;
  int64_t q_s0, q_s1;
  int64_t row;                   // elements of one token's row of one kv head (D; +4 quantized)
  int64_t cache_blk, cache_tok, cache_head;  // strides of the pools: block, token, kv head
  float scale;
  int64_t window;                // keys a row sees, itself included; 0: all before it
  float softcap;                 // scores -> softcap * tanh(scores / softcap); 0: off
};

// Per-thread scratch of a work item (floats): Q tile, O tile, running max and sum, scores,
// K^T, and the current block's K and V rows converted from bf16.
// The floats live in a per-thread buffer that only grows (no allocation per work item).
struct Scratch {
  float *qf, *of, *m, *l, *s, *kt, *kf, *vf;
  explicit Scratch(const Problem& P) {
    const int64_t R = P.max_rows, D = P.D;
    thread_local std::vector<float> buf;
    const size_t need = 2 * R * D + 2 * R + R * P.ldk + D * P.ldk + 2 * P.bs * D;
    if (buf.size() < need) buf.resize(need);
    qf = buf.data();
    of = qf + R * D;
    m = of + R * D;
    l = m + R;
    s = l + R;
    kt = s + R * P.ldk;
    kf = kt + D * P.ldk;
    vf = kf + P.bs * D;
  }
};

// kt[d][c] = k[c][d] for 16 keys (zero past ncols) x D (a multiple of 16) in 16 x 16 register
// transposes; false where it does not apply (not AVX-512, or ldk != 16).
inline bool transpose16(const float* k, int64_t ld, int64_t ncols, int64_t D, int64_t ldk,
                        float* kt) {
#if defined(CPU_CAPABILITY_AVX512)
  if (ldk != 16 || D % 16 != 0) return false;
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    __m512i r[16];
    for (int c = 0; c < 16; ++c)
      r[c] = c < ncols ? _mm512_loadu_si512(k + c * ld + d0) : _mm512_setzero_si512();
    kiln::transpose16x16(r);
    for (int d = 0; d < 16; ++d) _mm512_storeu_si512(kt + (d0 + d) * 16, r[d]);
  }
  return true;
#else
  (void)k; (void)ld; (void)ncols; (void)D; (void)ldk; (void)kt;
  return false;
#endif
}

// s[r][0:ncols] = Q[r] . K[c] for rows r0..R of a tile (K as float rows, stride kvstride).
inline void block_scores(const Problem& P, int64_t r0, int64_t R, int64_t ncols,
                         const float* krows, int64_t kvstride, Scratch& w) {
  const int64_t D = P.D, ldk = P.ldk;
  if (R - r0 >= kTransposeRows) {
    // Many rows: transpose K once to [D][ldk] (zero past ncols), vectorize over keys.
    if (!transpose16(krows, kvstride, ncols, D, ldk, w.kt)) {
      for (int64_t c = 0; c < ncols; ++c)
        for (int64_t d = 0; d < D; ++d) w.kt[d * ldk + c] = krows[c * kvstride + d];
      for (int64_t c = ncols; c < ldk; ++c)
        for (int64_t d = 0; d < D; ++d) w.kt[d * ldk + c] = 0.f;
    }
    int64_t r = r0;
    for (; r + 4 <= R; r += 4) scores_rows<4>(w.qf + r * D, D, w.kt, ldk, w.s + r * ldk);
    for (; r < R; ++r) scores_rows<1>(w.qf + r * D, D, w.kt, ldk, w.s + r * ldk);
    return;
  }
  // Few rows (decode): dot products straight from the block, four keys at a time.
  int64_t c = 0;
  for (; c + 4 <= ncols; c += 4) {
    const float* k0 = krows + c * kvstride;
    for (int64_t r = r0; r < R; ++r)
      dot4(w.qf + r * D, k0, k0 + kvstride, k0 + 2 * kvstride, k0 + 3 * kvstride, D,
           w.s + r * ldk + c);
  }
  for (; c < ncols; ++c)
    for (int64_t r = r0; r < R; ++r)
      w.s[r * ldk + c] = dot(w.qf + r * D, krows + c * kvstride, D);
}

// s[0:n] = cap * tanh(s / cap) (s has room for whole vectors up to P.ldk).
inline void softcap_row(float* s, int64_t n, float cap) {
  const Vec vc(cap), vinv(1.f / cap);
  for (int64_t c = 0; c < n; c += kVec) ((Vec::loadu(s + c) * vinv).tanh() * vc).store(s + c);
}

// The keys [clo, nvalid) of a block starting at key `start` that the row of token position
// p sees (causal, and the window when there is one).
inline void row_keys(const Problem& P, int64_t p, int64_t start, int64_t ncols, int64_t& clo,
                     int64_t& nvalid) {
  nvalid = std::min(ncols, p - start + 1);
  clo = P.window > 0 ? std::max<int64_t>(0, p - P.window + 1 - start) : 0;
}

// softmax_step's exps and sums once the new running max mx (>= m) is known.
inline float softmax_to(float mx, float* sr, int64_t n, float& m, float& l, const float* mul) {
  const float corr = std::exp(m - mx);  // 0 on the first block this row sees (m = -inf)
  const Vec vmx(mx);
  Vec vsum(0.f);
  int64_t c = 0;
  for (; c + kVec <= n; c += kVec) {
    const Vec e = (Vec::loadu(sr + c) - vmx).exp_u20();
    vsum = vsum + e;
    (mul ? e * Vec::loadu(mul + c) : e).store(sr + c);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vsum);
  for (; c < n; ++c) {
    const float e = std::exp(sr[c] - mx);
    sum += e;
    sr[c] = mul ? e * mul[c] : e;
  }
  m = mx;
  l = l * corr + sum;
  return corr;
}

// Online softmax step of one row over n scores sr: rescale (m, l) to the new running max and
// overwrite sr[c] with exp(s - max), times mul[c] when given (the sum adds the plain exps);
// returns the factor the row's earlier output is to be rescaled by.
inline float softmax_step(float* sr, int64_t n, float& m, float& l, const float* mul = nullptr) {
  float mx = m;
  for (int64_t c = 0; c < n; ++c) mx = std::max(mx, sr[c]);
  return softmax_to(mx, sr, n, m, l, mul);
}

// Online softmax step of one row (softmax_step), then o += p . V.
inline void softmax_pv(float* sr, int64_t n, float& m, float& l, float* o, const float* vrows,
                       int64_t vstride, int64_t D) {
  const float corr = softmax_step(sr, n, m, l);
  pv_row(o, corr, sr, n, vrows, vstride, D);
}

// ---- Decode blocks: few rows, keys and values read from the pool as they are used ---------
//
// A decode step's work item has G rows (the query heads of one kv head) and no reuse of a
// block's rows beyond them: converting each K/V row into float scratch and reading it back
// cost more than the dot products. Here each K row is converted in registers once and
// multiplied into every row's sums (the dot of four keys at a time reduced with one fold), a
// quantized row's scale applied to its scores; each V row is converted once and added into
// every row's output held in registers, its scale folded into the row's probabilities.


// Scores of the keys c0 .. c0 + 3 of a block's n (its rows at stride `stride`) for NR query
// rows q (float, D apart): s[r * ld + i] = q[r] . K[c0 + i] times the row's scale. Each key's
// row is converted once for all NR rows (the dot products of four keys reduced together);
// keys past n repeat the last one (their scores are not used). Inlined into its loops: a call
// per four keys cost the decode paths 3%.
template <int NR, int NV, typename cache_t>
[[gnu::always_inline]] inline void scores4(const float* q, int64_t D, const cache_t* kb, int64_t stride, int64_t c0,
                    int64_t n, float* s, int64_t ld) {
  Vec acc[NR][4];
  float kscale[4];
  for (int i = 0; i < 4; ++i) {
    const cache_t* kr = kb + std::min(c0 + i, n - 1) * stride;
    kscale[i] = pool_row_scale(kr, D);
    Vec kv[NV];
    for (int j = 0; j < NV; ++j) kv[j] = load_vec(kr + j * kVec);
    for (int r = 0; r < NR; ++r) {
      const float* qr = q + r * D;
      Vec a = Vec::loadu(qr) * kv[0];
      for (int j = 1; j < NV; ++j) a = at::vec::fmadd(Vec::loadu(qr + j * kVec), kv[j], a);
      acc[r][i] = a;
    }
  }
  for (int r = 0; r < NR; ++r) {
    float out[4];
    sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], out);
    for (int i = 0; i < 4; ++i) s[r * ld + i] = out[i] * kscale[i];
  }
}

// Rows r0..r0+NR of a work item against one block's ncols keys (NV = D / kVec). Row r0+i
// sees the keys [clo[i], nvalid[i]) (at least one). Updates the rows' (m, l, O) like
// softmax_pv.
template <int NR, int NV, typename cache_t>
void decode_block(const Problem& P, int64_t r0, int64_t ncols, const int64_t* clo,
                  const int64_t* nvalid, const cache_t* kb, const cache_t* vb, Scratch& w) {
  const int64_t D = P.D, ldk = P.ldk, stride = P.cache_tok;
  float* s = w.s + r0 * ldk;
  float* vscale = w.kf;                   // the block's V row scales (scratch of K rows)
  for (int64_t c0 = 0; c0 < ncols; c0 += 4)
    scores4<NR, NV>(w.qf + r0 * D, D, kb, stride, c0, ncols, s + c0, ldk);
  if (P.softcap > 0.f)
    for (int r = 0; r < NR; ++r) softcap_row(s + r * ldk, ncols, P.softcap);
  // online softmax per row; probabilities times the V row's scale, 0 outside the row's keys
  int64_t nmax = 0, cmin = ncols;
  float corr[NR];
  for (int64_t c = 0; c < ncols; ++c) vscale[c] = pool_row_scale(vb + c * stride, D);
  for (int r = 0; r < NR; ++r) {
    float* sr = s + r * ldk;
    const int64_t n = nvalid[r], c0 = clo[r];
    nmax = std::max(nmax, n);
    cmin = std::min(cmin, c0);
    corr[r] = softmax_step(sr + c0, n - c0, w.m[r0 + r], w.l[r0 + r], vscale + c0);
    for (int64_t c = 0; c < c0; ++c) sr[c] = 0.f;
    for (int64_t c = n; c < ncols; ++c) sr[c] = 0.f;
  }
  // O = O * corr + sum_c p[c] * V[c]: each V row converted once for all NR rows
  Vec o[NR][NV];
  for (int r = 0; r < NR; ++r) {
    const Vec vc(corr[r]);
    for (int j = 0; j < NV; ++j) o[r][j] = Vec::loadu(w.of + (r0 + r) * D + j * kVec) * vc;
  }
  for (int64_t c = cmin; c < nmax; ++c) {
    const cache_t* vr = vb + c * stride;
    Vec vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load_vec(vr + j * kVec);
    for (int r = 0; r < NR; ++r) {
      const Vec pc(s[r * ldk + c]);
      for (int j = 0; j < NV; ++j) o[r][j] = at::vec::fmadd(pc, vv[j], o[r][j]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NV; ++j) o[r][j].store(w.of + (r0 + r) * D + j * kVec);
}

// The decode kernels' dispatch to their compile-time shapes: f(nv_tag) with NV = nv, one of
// NVs (false: none is), and f(nr_tag) with NR = nr in 1..4.
template <int... NVs, class F>
inline bool with_nv(int64_t nv, F&& f) {
  return ((nv == NVs && (f(std::integral_constant<int, NVs>{}), true)) || ...);
}

template <class F>
inline void with_rows(int64_t nr, F&& f) {
  switch (nr) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// decode_block for nr rows (1..4) and D = NV * kVec (NV 2, 4 or 8); false: not covered.
template <typename cache_t>
bool try_decode_block(const Problem& P, int64_t r0, int64_t nr, int64_t ncols,
                      const int64_t* clo, const int64_t* nvalid, const cache_t* kb,
                      const cache_t* vb, Scratch& w) {
  if (nr < 1 || nr > 4 || P.D % kVec != 0) return false;
  return with_nv<2, 4, 8>(P.D / kVec, [&](auto nv_tag) {
    with_rows(nr, [&](auto nr_tag) {
      decode_block<decltype(nr_tag)::value, decltype(nv_tag)::value>(P, r0, ncols, clo, nvalid,
                                                                     kb, vb, w);
    });
  });
}

template <typename cache_t>
inline void prefetch_rows(const cache_t* p, int64_t rows, int64_t stride, int64_t D) {
  for (int64_t c = 0; c < rows; ++c)
    for (int64_t d = 0; d < D; d += 64 / sizeof(cache_t)) __builtin_prefetch(p + c * stride + d);
}

// ---- Decode items: one query token (nq = 1), its G rows seeing the same keys ------------
//
// The block path above runs the online softmax once per 16-key block: a scalar running max,
// a rescale of O and the sums, zero fills, per block and row -- half a decode item's time on
// SmolLM2's 3 rows x 64 dims. A decode item's rows share one key range, so here the keys go
// in chunks of up to kChunkKeys: every score of a chunk first (each K row converted once for
// all rows, its scale applied, the V rows' scales kept), then one softmax step per row over the
// whole chunk (vectorized max, exp, sum), then O += P V over the chunk with O in registers.
// The next block's rows are prefetched a few at a time while a block is scored, and the
// block's V rows with them, for the P V pass.
constexpr int64_t kChunkKeys = 256;

struct ChunkScratch {  // per thread: a chunk's scores (4 rows) and its V rows' scales
  float *s, *vs;
  static constexpr int64_t kLd = kChunkKeys + 64;  // room for whole vectors past n
  ChunkScratch() {
    thread_local std::vector<float> buf(4 * kLd + kLd);
    s = buf.data();
    vs = s + 4 * kLd;
  }
};

// Scores of the keys [k0, k0 + n) (n <= kChunkKeys) for NR rows into s[r * kLd + j]; the V
// rows' scales into vs[j] (quantized pools).
template <int NR, int NV, typename cache_t>
void chunk_scores(const Problem& P, const Group& g, int64_t k0, int64_t n, int64_t hi,
                  const cache_t* kc, const cache_t* vc, const Index& bt, const float* q,
                  ChunkScratch& cs) {
  const int64_t D = P.D, bs = P.bs, stride = P.cache_tok, ld = ChunkScratch::kLd;
  for (int64_t pos = k0; pos < k0 + n;) {
    const int64_t blk = pos / bs, in0 = pos % bs;
    const int64_t cnt = std::min(bs - in0, k0 + n - pos);  // keys of this block in the chunk
    const int64_t base = bt(g.b, blk) * P.cache_blk + g.kh * P.cache_head;
    const cache_t* kb = kc + base + in0 * stride;
    const cache_t* vb = vc + base + in0 * stride;
    const cache_t* kn = nullptr;
    if ((blk + 1) * bs < hi)
      kn = kc + bt(g.b, blk + 1) * P.cache_blk + g.kh * P.cache_head;
    const int64_t j0 = pos - k0;
    for (int64_t c0 = 0; c0 < cnt; c0 += 4) {
      if (kn) prefetch_rows(kn + (in0 + c0) * stride, 4, stride, P.row);
      prefetch_rows(vb + c0 * stride, std::min<int64_t>(4, cnt - c0), stride, P.row);
      scores4<NR, NV>(q, D, kb, stride, c0, cnt, cs.s + j0 + c0, ld);
    }
    if constexpr (kQuantized<cache_t>)
      for (int64_t c = 0; c < cnt; ++c) cs.vs[j0 + c] = row_scale(vb + c * stride, D);
    pos += cnt;
  }
}

// softmax_step over a chunk's n scores, its max found a vector at a time (a block's 16 keys
// were quicker with the scalar chain, hundreds of keys are not).
inline float chunk_softmax(float* sr, int64_t n, const float* mul, float& m, float& l) {
  Vec vmax(kNegInf);
  int64_t j = 0;
  for (; j + kVec <= n; j += kVec) vmax = at::vec::maximum(vmax, Vec::loadu(sr + j));
  float mx = std::max(m, at::vec::vec_reduce_all<float>(
                             [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax));
  for (; j < n; ++j) mx = std::max(mx, sr[j]);
  return softmax_to(mx, sr, n, m, l, mul);
}

// O[r] = O[r] * corr[r] + sum_j p[r][j] V[k0 + j] over the chunk, O in registers in tiles of
// NT vectors of D (NR * NT <= 16).
template <int NR, int NV, int NT, typename cache_t>
void chunk_pv(const Problem& P, const Group& g, int64_t k0, int64_t n, const cache_t* vc,
              const Index& bt, const float* corr, const ChunkScratch& cs, float* of) {
  const int64_t D = P.D, bs = P.bs, stride = P.cache_tok, ld = ChunkScratch::kLd;
  for (int t = 0; t < NV; t += NT) {
    Vec o[NR][NT];
    for (int r = 0; r < NR; ++r)
      for (int v = 0; v < NT; ++v) o[r][v] = Vec::loadu(of + r * D + (t + v) * kVec) * Vec(corr[r]);
    for (int64_t pos = k0; pos < k0 + n;) {
      const int64_t blk = pos / bs, in0 = pos % bs;
      const int64_t cnt = std::min(bs - in0, k0 + n - pos);
      const cache_t* vb = vc + bt(g.b, blk) * P.cache_blk + g.kh * P.cache_head + in0 * stride;
      const float* p = cs.s + (pos - k0);
      for (int64_t c = 0; c < cnt; ++c) {
        const cache_t* vr = vb + c * stride + t * kVec;
        Vec vv[NT];
        for (int v = 0; v < NT; ++v) vv[v] = load_vec(vr + v * kVec);
        for (int r = 0; r < NR; ++r) {
          const Vec pc(p[r * ld + c]);
          for (int v = 0; v < NT; ++v) o[r][v] = at::vec::fmadd(pc, vv[v], o[r][v]);
        }
      }
      pos += cnt;
    }
    for (int r = 0; r < NR; ++r)
      for (int v = 0; v < NT; ++v) o[r][v].store(of + r * D + (t + v) * kVec);
  }
}

// The widest tile of O (vectors of D) that NR rows keep in 16 registers and that divides NV.
constexpr int pv_tile(int NR, int NV) {
  for (int t = NV; t > 1; --t)
    if (NV % t == 0 && NR * t <= 16) return t;
  return 1;
}

// Rows [r0, r0 + NR) of a decode item over its keys [lo, hi) (the row's window applied), into
// w.of / w.m / w.l.
template <int NR, int NV, typename cache_t>
void decode_item(const Problem& P, const Group& g, int64_t r0, int64_t lo, int64_t hi,
                 const cache_t* kc, const cache_t* vc, const Index& bt, Scratch& w) {
  const int64_t first = P.window > 0 ? std::max(lo, g.pos0 - P.window + 1) : lo;
  float *m = w.m + r0, *l = w.l + r0;
  ChunkScratch cs;
  for (int64_t k0 = first; k0 < hi; k0 += kChunkKeys) {
    const int64_t n = std::min(kChunkKeys, hi - k0);
    chunk_scores<NR, NV>(P, g, k0, n, hi, kc, vc, bt, w.qf + r0 * P.D, cs);
    float corr[NR];
    for (int r = 0; r < NR; ++r) {
      float* sr = cs.s + r * ChunkScratch::kLd;
      if (P.softcap > 0.f) softcap_row(sr, n, P.softcap);
      corr[r] = chunk_softmax(sr, n, kQuantized<cache_t> ? cs.vs : nullptr, m[r], l[r]);
    }
    chunk_pv<NR, NV, pv_tile(NR, NV)>(P, g, k0, n, vc, bt, corr, cs, w.of + r0 * P.D);
  }
}

// decode_item over a decode item's G rows, four at a time (two with D of 16 vectors, whose K
// row takes 16 registers; a G of 8 reads its keys again, from cache), for D = NV * kVec with
// NV in 2, 3, 4, 6, 8, 16; false: not covered.
template <typename cache_t>
bool try_decode_item(const Problem& P, const Group& g, int64_t lo, int64_t hi,
                     const cache_t* kc, const cache_t* vc, const Index& bt, Scratch& w) {
  if (g.nq != 1 || P.D % kVec != 0) return false;
  return with_nv<2, 3, 4, 6, 8, 16>(P.D / kVec, [&](auto nv_tag) {
    constexpr int NV = decltype(nv_tag)::value;
    constexpr int64_t kRows = NV >= 16 ? 2 : 4;
    for (int64_t r0 = 0; r0 < P.G; r0 += kRows)
      with_rows(std::min<int64_t>(kRows, P.G - r0), [&](auto nr_tag) {
        decode_item<decltype(nr_tag)::value, NV>(P, g, r0, lo, hi, kc, vc, bt, w);
      });
  });
}

template <typename scalar_t, typename cache_t>
void attend_item(const Problem& P, const Group& g, int64_t part, const scalar_t* q,
                 const cache_t* kc, const cache_t* vc, const Index& bt, scalar_t* out,
                 float* ws, Scratch& w) {
  const int64_t D = P.D, G = P.G, bs = P.bs, R = g.nq * G;
  const int64_t lo = g.k0 + part * P.part_len;
  const int64_t hi = std::min(g.pos0 + g.nq, lo + P.part_len);  // keys [lo, hi)

  for (int64_t j = 0; j < g.nq; ++j)
    for (int64_t gg = 0; gg < G; ++gg)
      to_float(q + (g.t0 + j) * P.q_s0 + (g.kh * G + gg) * P.q_s1, w.qf + (j * G + gg) * D, D,
               P.scale);
  std::fill(w.of, w.of + R * D, 0.f);
  std::fill(w.m, w.m + R, kNegInf);
  std::fill(w.l, w.l + R, 0.f);

  const bool done = try_decode_item(P, g, lo, hi, kc, vc, bt, w);
  for (int64_t blk = lo / bs; !done && blk * bs < hi; ++blk) {
    const int64_t start = blk * bs, ncols = std::min(bs, hi - start);
    const cache_t* kb = kc + bt(g.b, blk) * P.cache_blk + g.kh * P.cache_head;
    const cache_t* vb = vc + bt(g.b, blk) * P.cache_blk + g.kh * P.cache_head;
    if ((blk + 1) * bs < hi) {  // blocks are scattered: prefetch the next one's rows
      const int64_t nxt = bt(g.b, blk + 1) * P.cache_blk + g.kh * P.cache_head;
      prefetch_rows(kc + nxt, bs, P.cache_tok, P.row);
      prefetch_rows(vc + nxt, bs, P.cache_tok, P.row);
    }
    // Rows of token j see positions <= pos0 + j: the first rows may see none of this block;
    // with a window, positions > pos0 + j - window: the last rows may see none of it.
    const int64_t r0 = std::max<int64_t>(0, start - g.pos0) * G;
    const int64_t r1 = P.window > 0
        ? std::min(R, std::max<int64_t>(0, start + ncols + P.window - 1 - g.pos0) * G) : R;
    if (r1 <= r0) continue;
    int64_t clo[4], nvalid[4];
    for (int64_t r = r0; r < std::min(r1, r0 + 4); ++r)
      row_keys(P, g.pos0 + r / G, start, ncols, clo[r - r0], nvalid[r - r0]);
    if (try_decode_block(P, r0, r1 - r0, ncols, clo, nvalid, kb, vb, w)) continue;
    // Keys and values as float rows [c][D] (the pool itself when it is float32).
    const float *krows = w.kf, *vrows = w.vf;
    int64_t kvstride = D;
    if constexpr (std::is_same_v<cache_t, float>) {
      krows = kb;
      vrows = vb;
      kvstride = P.cache_tok;
    } else {
      for (int64_t c = 0; c < ncols; ++c) {
        load_row(kb + c * P.cache_tok, w.kf + c * D, D);
        load_row(vb + c * P.cache_tok, w.vf + c * D, D);
      }
    }
    block_scores(P, r0, r1, ncols, krows, kvstride, w);
    for (int64_t r = r0; r < r1; ++r) {
      int64_t c0, n;
      row_keys(P, g.pos0 + r / G, start, ncols, c0, n);
      float* sr = w.s + r * P.ldk;
      if (P.softcap > 0.f) softcap_row(sr, ncols, P.softcap);
      softmax_pv(sr + c0, n - c0, w.m[r], w.l[r], w.of + r * D, vrows + c0 * kvstride,
                 kvstride, D);
    }
  }

  if (g.nparts == 1) {
    for (int64_t r = 0; r < R; ++r) {
      const float inv = 1.f / w.l[r];
      scalar_t* dst = out + ((g.t0 + r / G) * P.H + g.kh * G + r % G) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(w.of[r * D + d] * inv);
    }
  } else {  // partial: [O (R*D) | m (R) | l (R)] per partition
    float* dst = ws + g.ws_off + part * R * (D + 2);
    std::copy(w.of, w.of + R * D, dst);
    std::copy(w.m, w.m + R, dst + R * D);
    std::copy(w.l, w.l + R, dst + R * D + R);
  }
}

template <typename scalar_t>
void merge_group(const Problem& P, const Group& g, const float* ws, scalar_t* out, float* acc) {
  const int64_t D = P.D, G = P.G, R = g.nq * G, stride = R * (D + 2);
  const float* base = ws + g.ws_off;
  for (int64_t r = 0; r < R; ++r) {
    float M = kNegInf;
    for (int64_t p = 0; p < g.nparts; ++p) M = std::max(M, base[p * stride + R * D + r]);
    float L = 0.f;
    std::fill(acc, acc + D, 0.f);
    for (int64_t p = 0; p < g.nparts; ++p) {
      const float mp = base[p * stride + R * D + r];
      if (mp == kNegInf) continue;  // no key of this partition is visible to row r
      const float w = std::exp(mp - M);
      L += w * base[p * stride + R * D + R + r];
      axpy(acc, base + p * stride + r * D, w, D);
    }
    const float inv = 1.f / L;
    scalar_t* dst = out + ((g.t0 + r / G) * P.H + g.kh * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[d] * inv);
  }
}

template <typename scalar_t, typename cache_t>
void write_kv(const Problem& P, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
              at::Tensor& v_cache, const Index& slots) {
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  cache_t* kc = k_cache.data_ptr<cache_t>();
  cache_t* vc = v_cache.data_ptr<cache_t>();
  const int64_t KVH = P.KVH, D = P.D;
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  at::parallel_for(0, P.T * KVH, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / KVH, h = i % KVH;
      const int64_t dst = slots(t) / P.bs * P.cache_blk + slots(t) % P.bs * P.cache_tok +
                          h * P.cache_head;
      store_row(kp + t * ks0 + h * ks1, kc + dst, D);
      store_row(vp + t * vs0 + h * vs1, vc + dst, D);
    }
  });
}

template <typename scalar_t, typename cache_t>
void run(const Problem& P, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         at::Tensor& k_cache, at::Tensor& v_cache, const Index& slots, const Index& bt,
         const Work& work, at::Tensor& out) {
  const std::vector<Group>& groups = work.groups;
  const std::vector<Item>& items = work.items;
  const int64_t ws_size = work.ws_size;
  write_kv<scalar_t, cache_t>(P, k, v, k_cache, v_cache, slots);

  at::Tensor ws_t = at::empty({std::max<int64_t>(ws_size, 1)}, q.options().dtype(at::kFloat));
  float* ws = ws_t.data_ptr<float>();
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kc = k_cache.data_ptr<cache_t>();
  const cache_t* vc = v_cache.data_ptr<cache_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t D = P.D;

  // one item at a time: items differ in length, and a preempted thread's items go to the
  // others (plugins/csrc/parallel.h)
  kiln::parallel_chunks(static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch w(P);
    for (int64_t i = begin; i < end; ++i)
      attend_item<scalar_t, cache_t>(P, groups[items[i].group], items[i].part, qp, kc, vc, bt,
                                     op, ws, w);
  });

  if (ws_size > 0) {   // merging is D floats per partition: a few groups run inline
    at::parallel_for(0, static_cast<int64_t>(groups.size()), 8, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(D);
      for (int64_t i = begin; i < end; ++i)
        if (groups[i].nparts > 1) merge_group<scalar_t>(P, groups[i], ws, op, acc.data());
    });
  }
}

void check_index(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), "paged_attention: ", name, " must be a CPU tensor, got ",
              t.device());
  TORCH_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, "paged_attention: ",
              name, " must be int32 or int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, "paged_attention: ", name, " must have ", dim,
              " dims, got shape ", t.sizes());
}

// Metadata values: host loops over B and T, no allocation.
void check_metadata(const Index& qsl, const Index& cl, const Index& bt, const Index& slots,
                    int64_t B, int64_t T, int64_t MB, int64_t NB, int64_t bs) {
  TORCH_CHECK(qsl(0) == 0 && qsl(B) == T, "paged_attention: query_start_loc must run from 0 to T=",
              T, ", got ", qsl(0), "..", qsl(B));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nq = qsl(b + 1) - qsl(b), ctx = cl(b);
    TORCH_CHECK(nq >= 0, "paged_attention: query_start_loc must be non-decreasing (sequence ", b,
                ")");
    TORCH_CHECK(ctx >= nq, "paged_attention: context_lens[", b, "]=", ctx,
                " is less than the sequence's ", nq, " tokens this step");
    TORCH_CHECK(ctx <= MB * bs, "paged_attention: context_lens[", b, "]=", ctx,
                " exceeds block_tables capacity ", MB, " blocks x ", bs);
    if (nq == 0) continue;
    for (int64_t i = 0; i < ceil_div(ctx, bs); ++i) {
      const int64_t id = bt(b, i);
      TORCH_CHECK(id >= 0 && id < NB, "paged_attention: block_tables[", b, ", ", i, "]=", id,
                  " is outside the pool of ", NB, " blocks");
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    const int64_t sl = slots(t);
    TORCH_CHECK(sl >= 0 && sl < NB * bs, "paged_attention: slot_mapping[", t, "]=", sl,
                " is outside the pool of ", NB * bs, " slots");
  }
}

// Query tiles and context partitions of every (sequence, kv head); sets P's tiling fields.
Work plan_work(Problem& P, const Index& qsl, const Index& cl, int64_t B) {
  const int64_t KVH = P.KVH, D = P.D, bs = P.bs;
  const int64_t tq = std::max<int64_t>(1, 32 / P.G);  // query tokens per tile
  P.max_rows = tq * P.G;
  // first key a tile of rows starting at position p reads: its window's first block
  auto first_key = [&](int64_t p) {
    return P.window > 0 ? std::max<int64_t>(0, p - P.window + 1) / bs * bs : 0;
  };
  int64_t base_groups = 0, max_ctx = 0;   // max_ctx: the longest span of keys a group reads
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nq = qsl(b + 1) - qsl(b);
    base_groups += ceil_div(nq, tq) * KVH;
    max_ctx = std::max(max_ctx, cl(b) - first_key(cl(b) - nq));
  }
  // Too few items to keep every thread busy: split contexts into whole-block partitions.
  const int64_t threads = at::get_num_threads();
  P.part_len = std::numeric_limits<int64_t>::max() / 2;
  if (base_groups > 0 && base_groups < 4 * threads) {
    // partitions per group: enough items for every thread, none shorter than 128 tokens,
    // of about equal length (129 tokens: one part, not 128 + 1; 301: 160 + 141)
    const int64_t want = ceil_div(8 * threads, base_groups);
    const int64_t parts = std::max<int64_t>(1, std::min(want, max_ctx / 128));
    P.part_len = ceil_div(ceil_div(max_ctx, parts), bs) * bs;
  }
  Work w;
  w.groups.reserve(base_groups);
  w.items.reserve(base_groups);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q0 = qsl(b), nq_all = qsl(b + 1) - q0, first = cl(b) - nq_all;
    for (int64_t j = 0; j < nq_all; j += tq) {
      const int64_t nq = std::min(tq, nq_all - j);
      const int64_t k0 = first_key(first + j);
      const int64_t nparts = ceil_div(first + j + nq - k0, P.part_len);
      for (int64_t kh = 0; kh < KVH; ++kh) {
        Group g{b, q0 + j, nq, first + j, k0, kh, nparts, 0};
        if (nparts > 1) {
          g.ws_off = w.ws_size;
          w.ws_size += nparts * nq * P.G * (D + 2);
        }
        for (int64_t p = 0; p < nparts; ++p)
          w.items.push_back({static_cast<int64_t>(w.groups.size()), p});
        w.groups.push_back(g);
      }
    }
  }
  return w;
}

at::Tensor paged_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                               const at::Tensor& v_in, at::Tensor& k_cache, at::Tensor& v_cache,
                               const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, const at::Tensor& query_start_loc,
                               double scale, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0, "paged_attention: window must be >= 0 (0: the whole context), got ",
              window);
  TORCH_CHECK(softcap >= 0.0, "paged_attention: softcap must be >= 0 (0: off), got ", softcap);
  TORCH_CHECK(q_in.dim() == 3, "paged_attention: q must be [T, H, D], got shape ", q_in.sizes());
  TORCH_CHECK(k_in.dim() == 3 && v_in.dim() == 3,
              "paged_attention: k and v must be [T, KVH, D], got ", k_in.sizes(), " and ",
              v_in.sizes());
  TORCH_CHECK(k_cache.dim() == 4,
              "paged_attention: k_cache must be [num_blocks, block_size, KVH, D], got shape ",
              k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "paged_attention: v_cache shape ",
              v_cache.sizes(), " differs from k_cache shape ", k_cache.sizes());
  const int64_t T = q_in.size(0), H = q_in.size(1), D = q_in.size(2);
  const int64_t NB = k_cache.size(0), bs = k_cache.size(1), KVH = k_cache.size(2);
  const bool c_quant = k_cache.scalar_type() == at::kChar ||
                       k_cache.scalar_type() == at::kFloat8_e4m3fn;
  const int64_t row = c_quant ? D + kScaleBytes : D;
  TORCH_CHECK(k_cache.size(3) == row, "paged_attention: cache rows of ", k_cache.size(3),
              " elements do not fit q head_dim ", D,
              c_quant ? " (a quantized pool row is head_dim codes + 4 scale bytes)" : "");
  TORCH_CHECK(k_in.size(0) == T && k_in.size(1) == KVH && k_in.size(2) == D &&
                  v_in.sizes() == k_in.sizes(),
              "paged_attention: k and v must be [T=", T, ", KVH=", KVH, ", D=", D, "], got ",
              k_in.sizes(), " and ", v_in.sizes());
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "paged_attention: num heads H=", H,
              " must be a multiple of kv heads KVH=", KVH);
  TORCH_CHECK(bs > 0 && D > 0, "paged_attention: empty block size or head dim");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16,
              "paged_attention (CPU): q must be float32 or bfloat16, got ", q_in.scalar_type());
  TORCH_CHECK(k_in.scalar_type() == q_in.scalar_type() && v_in.scalar_type() == q_in.scalar_type(),
              "paged_attention: q, k, v must share a dtype, got ", q_in.scalar_type(), ", ",
              k_in.scalar_type(), ", ", v_in.scalar_type());
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK(ct == v_cache.scalar_type() && (ct == at::kFloat || ct == at::kBFloat16 ||
                                              ct == at::kChar || ct == at::kFloat8_e4m3fn),
              "paged_attention (CPU): k_cache and v_cache must both be float32, bfloat16, int8 "
              "or float8_e4m3fn, got ", k_cache.scalar_type(), " and ", v_cache.scalar_type());
  // Pools are [num_blocks, block_size, KVH, row] in any order of the first three dims
  // (kv_format.new_pools keeps each kv head's rows of a block together), rows dense.
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.strides() == v_cache.strides() &&
                  k_cache.is_non_overlapping_and_dense(),
              "paged_attention: k_cache and v_cache must be dense, non-overlapping, with rows "
              "of stride 1 and the same strides, got ", k_cache.strides(), " and ",
              v_cache.strides());
  TORCH_CHECK(k_in.device().is_cpu() && v_in.device().is_cpu() && k_cache.device().is_cpu() &&
                  v_cache.device().is_cpu(),
              "paged_attention (CPU): q, k, v and the caches must all be CPU tensors");
  check_index(slot_mapping, "slot_mapping", 1);
  check_index(block_tables, "block_tables", 2);
  check_index(context_lens, "context_lens", 1);
  check_index(query_start_loc, "query_start_loc", 1);
  const int64_t B = context_lens.size(0), MB = block_tables.size(1);
  TORCH_CHECK(slot_mapping.size(0) == T, "paged_attention: slot_mapping has ",
              slot_mapping.size(0), " entries for T=", T, " tokens");
  TORCH_CHECK(query_start_loc.size(0) == B + 1, "paged_attention: query_start_loc has ",
              query_start_loc.size(0), " entries, expected B+1=", B + 1,
              " (B = context_lens.size(0))");
  TORCH_CHECK(block_tables.size(0) == B, "paged_attention: block_tables has ",
              block_tables.size(0), " rows for B=", B, " sequences");
  // q/k/v may be strided views (a split of a fused qkv projection); rows must be dense.
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor k = k_in.stride(2) == 1 ? k_in : k_in.contiguous();
  const at::Tensor v = v_in.stride(2) == 1 ? v_in : v_in.contiguous();

  const Index qsl(query_start_loc), cl(context_lens), bt(block_tables), slots(slot_mapping);
  check_metadata(qsl, cl, bt, slots, B, T, MB, NB, bs);

  Problem P;
  P.T = T; P.H = H; P.KVH = KVH; P.G = H / KVH; P.D = D; P.bs = bs;
  P.ldk = ceil_div(bs, kVec) * kVec;
  P.q_s0 = q.stride(0); P.q_s1 = q.stride(1);
  P.row = row;
  P.cache_blk = k_cache.stride(0); P.cache_tok = k_cache.stride(1);
  P.cache_head = k_cache.stride(2);
  P.scale = static_cast<float>(scale);
  P.window = window;
  P.softcap = static_cast<float>(softcap);
  const Work work = plan_work(P, qsl, cl, B);

  at::Tensor out = at::empty({T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  using bf16 = c10::BFloat16;
  auto dispatch = [&](auto q_tag) {
    using scalar_t = decltype(q_tag);
    switch (ct) {
      case at::kFloat: run<scalar_t, float>(P, q, k, v, k_cache, v_cache, slots, bt, work, out); break;
      case at::kBFloat16: run<scalar_t, bf16>(P, q, k, v, k_cache, v_cache, slots, bt, work, out); break;
      case at::kChar: run<scalar_t, int8_t>(P, q, k, v, k_cache, v_cache, slots, bt, work, out); break;
      default: run<scalar_t, fp8>(P, q, k, v, k_cache, v_cache, slots, bt, work, out); break;
    }
  };
  if (q.scalar_type() == at::kBFloat16)
    dispatch(bf16{});
  else
    dispatch(float{});
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("paged_attention", paged_attention_cpu); }


// ---- AOTInductor C shim (plugins/csrc/aoti_shim.h) -------------------------------------------
#include "../../csrc/aoti_shim.h"

KILN_AOTI_SHIM aoti_torch_cpu_paged_attention(
    AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle k_cache,
    AtenTensorHandle v_cache, AtenTensorHandle slot_mapping, AtenTensorHandle block_tables,
    AtenTensorHandle context_lens, AtenTensorHandle query_start_loc, double scale,
    int64_t window, double softcap, AtenTensorHandle* ret0) {
  using kiln_shim::tensor;
  using T = kiln_shim::T;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    static const auto op =
        kiln_shim::op<at::Tensor(T, T, T, at::Tensor&, at::Tensor&, T, T, T, T, double, int64_t,
                                 double)>("kiln::paged_attention");
    *ret0 = kiln_shim::result(op.call(tensor(q), tensor(k), tensor(v), tensor(k_cache),
                                      tensor(v_cache), tensor(slot_mapping), tensor(block_tables),
                                      tensor(context_lens), tensor(query_start_loc), scale,
                                      window, softcap));
  });
}
