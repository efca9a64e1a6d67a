// CPU kernel of kiln::lora_apply (schema and reference: plugins/lora/ops.py).
//
//   y [T, N], x [T, K]: float32 | bfloat16; slots [T] int64 | int32 (-1: no adapter)
//   lora_a [S, R, K], lora_b [S, N, R]: float32 | bfloat16 (both the same); scales [S]: float32
//   out[t] = y[t] + scales[s] * lora_b[s] @ (lora_a[s] @ x[t]),  s = slots[t] >= 0
//
// The tokens are grouped by slot (counting sort, tokens in order); each active slot is one
// item of a single parallel region: shrink (each row of its A read once and dotted with every
// token of the slot: h [n, R]), then expand (its B read once; with R a multiple of the vector
// width, a block of outputs per token folded and reduced together, one store a block). Each
// dot is the same fixed-order at::vec sum whatever the group's size, so a token's output never
// depends on the other tokens.
#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "../../csrc/parallel.h"

#include <algorithm>
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif
#include <cstdint>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#define KILN_LORA_VEC "lora: at::vec 512-bit"
#elif defined(CPU_CAPABILITY_AVX2)
#define KILN_LORA_VEC "lora: at::vec 256-bit"
#else
#define KILN_LORA_VEC "lora: scalar at::vec"
#endif
extern "C" __attribute__((used, visibility("default")))
const char kiln_lora_kernel_path[] = "KILN_KERNEL_PATH:" KILN_LORA_VEC;

namespace {

using Vec = at::vec::Vectorized<float>;
using bf16 = at::BFloat16;

// One Vec of weights from float32 or bfloat16 storage (a bfloat16 is the top half of the
// float32 it widens to: the 16-bit values zero-extended and shifted up, exact).
inline Vec wload(const float* p) { return Vec::loadu(p); }
inline Vec wload(const bf16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
#else
  float f[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) f[i] = static_cast<float>(p[i]);
  return Vec::loadu(f);
#endif
}

// w . a over n values: two Vec accumulators over alternate Vec steps, summed, then the tail.
// One order for every call, so the result depends on w and a alone.
template <typename W>
inline float dot(const W* w, const float* a, int64_t n) {
  constexpr int64_t L = Vec::size();
  Vec acc0(0.0f), acc1(0.0f);
  int64_t i = 0;
  for (; i + 2 * L <= n; i += 2 * L) {
    acc0 = at::vec::fmadd(wload(w + i), Vec::loadu(a + i), acc0);
    acc1 = at::vec::fmadd(wload(w + i + L), Vec::loadu(a + i + L), acc1);
  }
  if (i + L <= n) {
    acc0 = at::vec::fmadd(wload(w + i), Vec::loadu(a + i), acc0);
    i += L;
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, acc0 + acc1);
  for (; i < n; ++i) s += static_cast<float>(w[i]) * a[i];
  return s;
}

// dot(w, a[k], n) for kTok vectors a[k] at once: w read once, each a[k] summed in exactly
// dot()'s order (two accumulators over alternate Vec steps, then the tail), so the result is
// dot()'s, bit for bit, whichever tokens share the call.
constexpr int kTok = 4;
template <typename W>
inline void dots(const W* w, const float* const* a, int64_t n, float* out) {
  constexpr int64_t L = Vec::size();
  Vec acc0[kTok], acc1[kTok];
  for (int k = 0; k < kTok; ++k) acc0[k] = acc1[k] = Vec(0.0f);
  int64_t i = 0;
  for (; i + 2 * L <= n; i += 2 * L) {
    const Vec w0 = wload(w + i), w1 = wload(w + i + L);
    for (int k = 0; k < kTok; ++k) {
      acc0[k] = at::vec::fmadd(w0, Vec::loadu(a[k] + i), acc0[k]);
      acc1[k] = at::vec::fmadd(w1, Vec::loadu(a[k] + i + L), acc1[k]);
    }
  }
  if (i + L <= n) {
    const Vec w0 = wload(w + i);
    for (int k = 0; k < kTok; ++k) acc0[k] = at::vec::fmadd(w0, Vec::loadu(a[k] + i), acc0[k]);
    i += L;
  }
  for (int k = 0; k < kTok; ++k) {
    float s = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; },
                                             acc0[k] + acc1[k]);
    for (int64_t j = i; j < n; ++j) s += static_cast<float>(w[j]) * a[k][j];
    out[k] = s;
  }
}

// h[t, j] = A[j] . x[t] for the slot's tokens: each row of A is read once for kTok of them.
template <typename W>
inline void shrink(const W* A, int64_t R, int64_t K, const float* x, const int64_t* tokens,
                   int64_t n_tok, float* h) {
  int64_t p = 0;
  for (; p + kTok <= n_tok; p += kTok) {
    const float* xs[kTok];
    for (int k = 0; k < kTok; ++k) xs[k] = x + tokens[p + k] * K;
    float d[kTok];
    for (int64_t j = 0; j < R; ++j) {
      dots(A + j * K, xs, K, d);
      for (int k = 0; k < kTok; ++k) h[tokens[p + k] * R + j] = d[k];
    }
  }
  for (int64_t j = 0; j < R; ++j)
    for (int64_t q = p; q < n_tok; ++q) h[tokens[q] * R + j] = dot(A + j * K, x + tokens[q] * K, K);
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kBlock = Vec::size();
// The 8 lane sums of 8 __m256 as one __m256 (lane k: v[k]'s sum), by one hadd tree.
inline __m256 sums8(const __m256* v) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
// The 8 (16) lane sums of v[0..kBlock) as one Vec, each by the same add tree (512 bits: each
// Vec's halves added, then the 256-bit tree over 8 at a time).
inline Vec lane_sums(const Vec* v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m256 half[kBlock];
  for (int64_t k = 0; k < kBlock; ++k) {
    const __m512 w = v[k];
    half[k] = _mm256_add_ps(_mm512_castps512_ps256(w), _mm512_extractf32x8_ps(w, 1));
  }
  return _mm512_insertf32x8(_mm512_castps256_ps512(sums8(half)), sums8(half + 8), 1);
#else
  __m256 w[kBlock];
  for (int64_t k = 0; k < kBlock; ++k) w[k] = v[k];
  return sums8(w);
#endif
}
#else
constexpr int64_t kBlock = 0;
#endif

// out[t, n] = y[t, n] + scale * B[n] . h[t] for the slot's tokens. With R a multiple of the
// vector width, kBlock outputs at a time: each B row folded into one Vec per token, the kBlock
// Vecs reduced together (one store instead of kBlock horizontal sums). Every (t, n) is computed
// by the same sequence whatever the other tokens.
template <typename W>
inline void expand(const W* B, int64_t R, int64_t N, float scale, const float* h,
                   const int64_t* tokens, int64_t n_tok, const float* y, float* out) {
  constexpr int64_t L = Vec::size();
  int64_t n0 = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if (R % L == 0) {
    const Vec vs(scale);
    for (; n0 + kBlock <= N; n0 += kBlock) {
      const W* Bn = B + n0 * R;
      // The next block's rows of B (kBlock * R floats) asked for while this block's are summed:
      // a step reads each adapter's B once, from memory, and the first token of a block
      // otherwise waits on its loads (10% of SmolLM2's 32-token LoRA time)
      if (n0 + 2 * kBlock <= N)
        for (int64_t c = 0; c < kBlock * R; c += 64 / sizeof(W))
          _mm_prefetch(reinterpret_cast<const char*>(Bn + kBlock * R + c), _MM_HINT_T0);
      for (int64_t p = 0; p < n_tok; ++p) {
        const float* ht = h + tokens[p] * R;
        Vec acc[kBlock];
        for (int64_t k = 0; k < kBlock; ++k) {
          Vec a = wload(Bn + k * R) * Vec::loadu(ht);
          for (int64_t j = L; j < R; j += L)
            a = at::vec::fmadd(wload(Bn + k * R + j), Vec::loadu(ht + j), a);
          acc[k] = a;
        }
        const int64_t o = tokens[p] * N + n0;
        at::vec::fmadd(lane_sums(acc), vs, Vec::loadu(y + o)).store(out + o);
      }
    }
  }
#endif
  for (int64_t p = 0; p < n_tok; ++p) {
    const float* ht = h + tokens[p] * R;
    const float* yt = y + tokens[p] * N;
    float* ot = out + tokens[p] * N;
    for (int64_t n = n0; n < N; ++n) ot[n] = yt[n] + scale * dot(B + n * R, ht, R);
  }
}

// The tokens of each slot, in token order: tokens[start[s] .. start[s + 1]).
struct Groups {
  std::vector<int64_t> start, tokens, active;   // active: the slots with tokens
  std::vector<int64_t> plain;                    // the tokens without an adapter
};

template <typename I>
Groups group_by_slot(const I* slots, int64_t T, int64_t S) {
  Groups g{std::vector<int64_t>(S + 1, 0), {}, {}, {}};
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t];
    TORCH_CHECK(s >= -1 && s < S, "kiln::lora_apply: slot ", s, " of token ", t,
                " is neither -1 nor in [0, ", S, ")");
    if (s >= 0)
      ++g.start[s + 1];
    else
      g.plain.push_back(t);
  }
  for (int64_t s = 0; s < S; ++s) {
    if (g.start[s + 1]) g.active.push_back(s);
    g.start[s + 1] += g.start[s];
  }
  g.tokens.resize(g.start[S]);
  std::vector<int64_t> next(g.start.begin(), g.start.end() - 1);
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0) g.tokens[next[slots[t]]++] = t;
  return g;
}

void check_args(const at::Tensor& y, const at::Tensor& x, const at::Tensor& slots,
                const at::Tensor& a, const at::Tensor& b, const at::Tensor& scales) {
  const char* op = "kiln::lora_apply";
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 3 && b.dim() == 3, op,
              ": y [T, N], x [T, K], lora_a [S, R, K], lora_b [S, N, R] expected");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t S = a.size(0), R = a.size(1);
  TORCH_CHECK(y.size(0) == T && slots.dim() == 1 && slots.size(0) == T, op,
              ": x, y and slots must have the same T rows");
  TORCH_CHECK(a.size(2) == K && b.size(0) == S && b.size(1) == N && b.size(2) == R, op,
              ": lora_a ", a.sizes(), " and lora_b ", b.sizes(), " do not fit x ", x.sizes(),
              " -> y ", y.sizes());
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == S, op, ": scales [S] expected");
  TORCH_CHECK(slots.scalar_type() == at::kLong || slots.scalar_type() == at::kInt, op,
              ": slots int64 or int32");
  TORCH_CHECK((a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16) &&
                  b.scalar_type() == a.scalar_type(),
              op, ": lora_a and lora_b both float32 or both bfloat16");
}

at::Tensor lora_apply(const at::Tensor& y, const at::Tensor& x, const at::Tensor& slots,
                      const at::Tensor& lora_a, const at::Tensor& lora_b,
                      const at::Tensor& scales) {
  check_args(y, x, slots, lora_a, lora_b, scales);
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t S = lora_a.size(0), R = lora_a.size(1);
  const at::Tensor sl = slots.contiguous();
  const Groups g = sl.scalar_type() == at::kLong
                       ? group_by_slot(sl.data_ptr<int64_t>(), T, S)
                       : group_by_slot(sl.data_ptr<int32_t>(), T, S);
  // The output is written once, here: y's row where a token has no adapter, y + delta by the
  // slot's pass where it has one (no copy of y first: a torch copy of a step's [T, N] opens a
  // parallel region of its own, which costs more than the rows it copies).
  const at::Tensor yf = y.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({T, N}, yf.options());
  const float* yp = yf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto result = [&] { return y.scalar_type() == at::kFloat ? out : out.to(y.scalar_type()); };
  if (g.active.empty() || R == 0) {
    std::copy(yp, yp + T * N, op);
    return result();
  }
  for (const int64_t t : g.plain) std::copy(yp + t * N, yp + (t + 1) * N, op + t * N);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor A = lora_a.contiguous(), B = lora_b.contiguous();
  const at::Tensor sc = scales.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const float* scp = sc.data_ptr<float>();
  std::vector<float> h(T * R, 0.0f);                 // h[t] = A[slot t] @ x[t]
  // One item per active slot: shrink then expand its tokens, so a call opens one parallel
  // region with no barrier between the passes; the slots are spread over the threads (an idle
  // thread takes the next slot). Reading the adapters bounds the op (32 decode tokens over 8
  // rank-16 adapters: each float of A and B serves 4 tokens), so a region on every thread, with
  // their share of the memory bandwidth, halves even a small model's decode call (SmolLM2's
  // 210 calls of a 32-token step: 24 ms on one thread, 13 ms on two).
  const int64_t nA = static_cast<int64_t>(g.active.size());
  const auto passes = [&](const auto* ap, const auto* bp) {
    kiln::parallel_chunks(nA, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t s = g.active[i];
        const int64_t* tk = g.tokens.data() + g.start[s];
        const int64_t n_tok = g.start[s + 1] - g.start[s];
        shrink(ap + s * R * K, R, K, xp, tk, n_tok, h.data());
        expand(bp + s * N * R, R, N, scp[s], h.data(), tk, n_tok, yp, op);
      }
    });
  };
  // bfloat16 adapters are half the bytes to read, which bounds the op; widened exactly
  if (A.scalar_type() == at::kBFloat16)
    passes(A.data_ptr<at::BFloat16>(), B.data_ptr<at::BFloat16>());
  else
    passes(A.data_ptr<float>(), B.data_ptr<float>());
  return result();
}

}  // namespace

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("lora_apply", &lora_apply); }

// ---- AOTInductor C shim (plugins/csrc/aoti_shim.h) --------------------------------------------
#include "../../csrc/aoti_shim.h"

KILN_AOTI_SHIM aoti_torch_cpu_lora_apply(AtenTensorHandle y, AtenTensorHandle x,
                                         AtenTensorHandle slots, AtenTensorHandle lora_a,
                                         AtenTensorHandle lora_b, AtenTensorHandle scales,
                                         AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    using kiln_shim::T;
    static const auto op = kiln_shim::op<at::Tensor(T, T, T, T, T, T)>("kiln::lora_apply");
    *ret0 = kiln_shim::result(op.call(kiln_shim::tensor(y), kiln_shim::tensor(x),
                                      kiln_shim::tensor(slots), kiln_shim::tensor(lora_a),
                                      kiln_shim::tensor(lora_b), kiln_shim::tensor(scales)));
  });
}
