// CPU kernel of kiln::moe_experts (schema and reference: plugins/moe/ops.py).
//
//   x [T, H] float32 | bfloat16; topk_ids [T, k] int64; topk_weights [T, k] float32
//   w13 [E, 2I, H], w2 [E, H, I]: float32 | bfloat16 (both the same)
//
// The (token, j) pairs are grouped by expert (counting sort, tokens in order). For each
// selected expert, one pass over its weights: each weight row is loaded once and dotted with
// every token of the group while it is in cache (rows split across threads). Each dot product
// is the same fixed-order at::vec sum whatever the group's size, and a token's k contributions
// are summed in j order, so a token's output never depends on the other tokens of the step.
#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "../../csrc/parallel.h"

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#define KILN_MOE_VEC "moe: at::vec 512-bit"
#elif defined(CPU_CAPABILITY_AVX2)
#define KILN_MOE_VEC "moe: at::vec 256-bit"
#else
#define KILN_MOE_VEC "moe: scalar at::vec"
#endif
extern "C" __attribute__((used, visibility("default")))
const char kiln_moe_kernel_path[] = "KILN_KERNEL_PATH:" KILN_MOE_VEC;

namespace {

using Vec = at::vec::Vectorized<float>;

// w . a over n values: one Vec accumulator in a fixed order, then the tail.
template <typename W>
inline float dot(const W* w, const float* a, int64_t n) {
  Vec acc(0.0f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    Vec wv;
    if constexpr (std::is_same_v<W, float>) {
      wv = Vec::loadu(w + i);
    } else {
      float tmp[Vec::size()];
      for (int j = 0; j < Vec::size(); ++j) tmp[j] = float(w[i + j]);
      wv = Vec::loadu(tmp);
    }
    acc = at::vec::fmadd(wv, Vec::loadu(a + i), acc);
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, acc);
  for (; i < n; ++i) s += float(w[i]) * a[i];
  return s;
}

// out[g, r] = w[r] . in[g] for the n rows of `in` (each `k` long) and the `rows` rows of w;
// each weight row read once for all of them.
template <typename W>
void rows_times_group(const W* w, int64_t rows, int64_t k, const float* in, int64_t n,
                      float* out) {
  kiln::parallel_chunks(rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < n; ++g) out[g * rows + r] = dot(w + r * k, in + g * k, k);
  });
}

struct Groups {              // the (token, j) pairs of each expert, flattened t * k + j
  std::vector<int64_t> start;  // [E + 1]
  std::vector<int64_t> pairs;  // [T * k], grouped by expert, in (t, j) order within one
};

Groups group_by_expert(const int64_t* ids, int64_t pairs, int64_t E) {
  Groups g{std::vector<int64_t>(E + 1, 0), std::vector<int64_t>(pairs)};
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < E, "kiln::moe_experts: topk_ids holds expert ", ids[p],
                ", outside 0..", E - 1);
    ++g.start[ids[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) g.start[e + 1] += g.start[e];
  std::vector<int64_t> fill(g.start.begin(), g.start.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) g.pairs[fill[ids[p]]++] = p;
  return g;
}

template <typename W>
void run_experts(const float* x, const Groups& groups, const W* w13, const W* w2, int64_t E,
                 int64_t H, int64_t I, int64_t k, float* contrib) {
  std::vector<float> xs, h, a, y;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t b = groups.start[e], n = groups.start[e + 1] - b;
    if (n == 0) continue;
    xs.resize(n * H);
    for (int64_t g = 0; g < n; ++g)
      std::copy_n(x + (groups.pairs[b + g] / k) * H, H, xs.data() + g * H);
    h.resize(n * 2 * I);
    rows_times_group(w13 + e * 2 * I * H, 2 * I, H, xs.data(), n, h.data());   // [n, 2I]
    a.resize(n * I);
    for (int64_t g = 0; g < n; ++g)
      for (int64_t i = 0; i < I; ++i) {
        const float gate = h[g * 2 * I + i], up = h[g * 2 * I + I + i];
        a[g * I + i] = gate / (1.0f + std::exp(-gate)) * up;                 // silu(gate) * up
      }
    y.resize(n * H);
    rows_times_group(w2 + e * H * I, H, I, a.data(), n, y.data());           // [n, H]
    for (int64_t g = 0; g < n; ++g)
      std::copy_n(y.data() + g * H, H, contrib + groups.pairs[b + g] * H);
  }
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_ids,
                       const at::Tensor& topk_weights, const at::Tensor& w13,
                       const at::Tensor& w2) {
  const char* op = "kiln::moe_experts";
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3, op,
              ": x [T, H], w13 [E, 2I, H], w2 [E, H, I] expected");
  const int64_t T = x.size(0), H = x.size(1), E = w13.size(0), I = w13.size(1) / 2;
  TORCH_CHECK(w13.size(2) == H && w2.size(0) == E && w2.size(1) == H && w2.size(2) == I, op,
              ": w13 ", w13.sizes(), " and w2 ", w2.sizes(), " do not fit x ", x.sizes());
  TORCH_CHECK(w13.scalar_type() == w2.scalar_type() &&
                  (w13.scalar_type() == at::kFloat || w13.scalar_type() == at::kBFloat16),
              op, ": expert weights must both be float32 or both bfloat16");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T &&
                  topk_weights.sizes() == topk_ids.sizes(), op,
              ": topk_ids and topk_weights must both be [T, k]");
  const int64_t k = topk_ids.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor wts = topk_weights.to(at::kFloat).contiguous();
  const at::Tensor a13 = w13.contiguous(), a2 = w2.contiguous();
  at::Tensor contrib = at::empty({T, k, H}, xf.options());                  // [T, k, H]
  const Groups groups = group_by_expert(ids.data_ptr<int64_t>(), T * k, E);
  if (w13.scalar_type() == at::kFloat)
    run_experts(xf.data_ptr<float>(), groups, a13.data_ptr<float>(), a2.data_ptr<float>(), E, H,
                I, k, contrib.data_ptr<float>());
  else
    run_experts(xf.data_ptr<float>(), groups, a13.data_ptr<at::BFloat16>(),
                a2.data_ptr<at::BFloat16>(), E, H, I, k, contrib.data_ptr<float>());
  at::Tensor out = at::empty({T, H}, xf.options());
  const float* c = contrib.data_ptr<float>();
  const float* wt = wts.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)                                             // in j order
    for (int64_t d = 0; d < H; ++d) {
      float s = c[(t * k) * H + d] * wt[t * k];
      for (int64_t j = 1; j < k; ++j) s += c[(t * k + j) * H + d] * wt[t * k + j];
      o[t * H + d] = s;
    }
  return out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("moe_experts", &moe_experts); }

// ---- AOTInductor C shim (plugins/csrc/aoti_shim.h) --------------------------------------------
#include "../../csrc/aoti_shim.h"

KILN_AOTI_SHIM aoti_torch_cpu_moe_experts(AtenTensorHandle x, AtenTensorHandle ids,
                                          AtenTensorHandle weights, AtenTensorHandle w13,
                                          AtenTensorHandle w2, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    using kiln_shim::T;
    static const auto op = kiln_shim::op<at::Tensor(T, T, T, T, T)>("kiln::moe_experts");
    *ret0 = kiln_shim::result(op.call(kiln_shim::tensor(x), kiln_shim::tensor(ids),
                                      kiln_shim::tensor(weights), kiln_shim::tensor(w13),
                                      kiln_shim::tensor(w2)));
  });
}
