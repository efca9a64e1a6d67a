// CPU kernel of kiln::lora_apply (schema and reference: plugins/lora/ops.py).
//
//   y [T, N], x [T, K]: float32 | bfloat16; slots [T] int64 | int32 (-1: no adapter)
//   lora_a [S, R, K], lora_b [S, N, R], scales [S]: float32
//   out[t] = y[t] + scales[s] * lora_b[s] @ (lora_a[s] @ x[t]),  s = slots[t] >= 0
//
// The tokens are grouped by slot (counting sort, tokens in order). Shrink: each row of an
// active slot's A is loaded once and dotted with every token of the slot (rows across
// threads), h [T, R]. Expand: each chunk of rows of the slot's B stays in cache while every
// token of the slot takes its outputs of those rows. Each dot is the same fixed-order at::vec
// sum whatever the group's size, so a token's output never depends on the other tokens.
#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "../../csrc/parallel.h"

#include <algorithm>
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

// w . a over n floats: two Vec accumulators over alternate Vec steps, summed, then the tail.
// One order for every call, so the result depends on w and a alone.
inline float dot(const float* w, const float* a, int64_t n) {
  constexpr int64_t L = Vec::size();
  Vec acc0(0.0f), acc1(0.0f);
  int64_t i = 0;
  for (; i + 2 * L <= n; i += 2 * L) {
    acc0 = at::vec::fmadd(Vec::loadu(w + i), Vec::loadu(a + i), acc0);
    acc1 = at::vec::fmadd(Vec::loadu(w + i + L), Vec::loadu(a + i + L), acc1);
  }
  if (i + L <= n) {
    acc0 = at::vec::fmadd(Vec::loadu(w + i), Vec::loadu(a + i), acc0);
    i += L;
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, acc0 + acc1);
  for (; i < n; ++i) s += w[i] * a[i];
  return s;
}

// The tokens of each slot, in token order: tokens[start[s] .. start[s + 1]).
struct Groups {
  std::vector<int64_t> start, tokens, active;   // active: the slots with tokens
};

template <typename I>
Groups group_by_slot(const I* slots, int64_t T, int64_t S) {
  Groups g{std::vector<int64_t>(S + 1, 0), {}, {}};
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t];
    TORCH_CHECK(s >= -1 && s < S, "kiln::lora_apply: slot ", s, " of token ", t,
                " is neither -1 nor in [0, ", S, ")");
    if (s >= 0) ++g.start[s + 1];
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
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat, op,
              ": float32 lora_a and lora_b");
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
  at::Tensor out = y.to(at::kFloat).contiguous();
  if (y.scalar_type() == at::kFloat) out = out.clone();     // never write into y
  if (g.active.empty() || R == 0) return out.to(y.scalar_type());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor A = lora_a.contiguous(), B = lora_b.contiguous();
  const at::Tensor sc = scales.to(at::kFloat).contiguous();
  const float *xp = xf.data_ptr<float>(), *ap = A.data_ptr<float>(), *bp = B.data_ptr<float>();
  const float* scp = sc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::vector<float> h(T * R, 0.0f);                 // h[t] = A[slot t] @ x[t]
  const int64_t nA = static_cast<int64_t>(g.active.size());
  // Shrink: item i = (active slot i / R, row i % R of its A), every token of the slot.
  kiln::parallel_chunks(nA * R, kiln::chunk_items(nA * R, K * 4, 1 << 16), [&](int64_t lo,
                                                                              int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t s = g.active[i / R], j = i % R;
      const float* row = ap + (s * R + j) * K;
      for (int64_t p = g.start[s]; p < g.start[s + 1]; ++p) {
        const int64_t t = g.tokens[p];
        h[t * R + j] = dot(row, xp + t * K, K);
      }
    }
  });
  // Expand: item = a chunk of output rows of one active slot's B.
  const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(N, (1 << 14) / std::max<int64_t>(1, R)));
  const int64_t per_slot = (N + rows - 1) / rows;
  kiln::parallel_chunks(nA * per_slot, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t s = g.active[i / per_slot];
      const int64_t n0 = (i % per_slot) * rows, n1 = std::min(N, n0 + rows);
      const float scale = scp[s];
      const float* bs = bp + s * N * R;
      for (int64_t p = g.start[s]; p < g.start[s + 1]; ++p) {
        const int64_t t = g.tokens[p];
        const float* ht = h.data() + t * R;
        float* ot = op + t * N;
        for (int64_t n = n0; n < n1; ++n) ot[n] += scale * dot(bs + n * R, ht, R);
      }
    }
  });
  return y.scalar_type() == at::kFloat ? out : out.to(y.scalar_type());
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
