// CPU kernels of kiln::moe_experts and kiln::moe_experts_quant (schemas and references:
// plugins/moe/ops.py).
//
//   x [T, H] float32 | bfloat16; topk_ids [T, k] int64; topk_weights [T, k] float32
//   moe_experts:       w13 [E, 2I, H], w2 [E, H, I]: float32 | bfloat16 (both the same)
//   moe_experts_quant: int8 | fp8 codes [E, N, K] with scales [E, N], or int4 [E, N, K/2]
//                      with scales and zeros [E, N, K/G] (plugins/quant/formats.py)
//   moe_experts_a8:    int8 (W8A8) or int4 at group 32 (W4A8) experts, activations quantized
//                      to int8 at run time, integer dot products
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

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
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

// out[t] = w . a[t] over n values for NT tokens at once, each weight vector loaded once for
// all of them. Each token's sum has one fixed order whatever NT is (four Vec accumulators
// over consecutive Vec steps, added (0 + 1) + (2 + 3), the remaining Vec steps into the
// first before that, then the tail): a token's result does not depend on its neighbours,
// and the four chains keep the FMA units busy instead of waiting on one.
template <int NT>
inline void dots(const float* w, const float* const* a, int64_t n, float* out) {
  constexpr int64_t L = Vec::size();
  Vec acc[NT][4];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = Vec(0.0f);
  int64_t i = 0;
  for (; i + 4 * L <= n; i += 4 * L)
    for (int j = 0; j < 4; ++j) {
      const Vec wv = Vec::loadu(w + i + j * L);
      for (int t = 0; t < NT; ++t)
        acc[t][j] = at::vec::fmadd(wv, Vec::loadu(a[t] + i + j * L), acc[t][j]);
    }
  for (; i + L <= n; i += L) {
    const Vec wv = Vec::loadu(w + i);
    for (int t = 0; t < NT; ++t) acc[t][0] = at::vec::fmadd(wv, Vec::loadu(a[t] + i), acc[t][0]);
  }
  for (int t = 0; t < NT; ++t) {
    const Vec sum = (acc[t][0] + acc[t][1]) + (acc[t][2] + acc[t][3]);
    float s = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, sum);
    for (int64_t k = i; k < n; ++k) s += w[k] * a[t][k];
    out[t] = s;
  }
}

// Row decoders: row(r, buf) -> the K float32 weights of row r of one expert's matrix (a
// pointer into the weights, or `buf` filled), exactly the values formats.dequantize_* gives.
struct F32Rows {
  static constexpr bool kA8 = false;
  const float* w;
  int64_t K;
  const float* row(int64_t r, float*) const { return w + r * K; }
};
struct Bf16Rows {
  static constexpr bool kA8 = false;
  const at::BFloat16* w;
  int64_t K;
  const float* row(int64_t r, float* buf) const {
    for (int64_t i = 0; i < K; ++i) buf[i] = float(w[r * K + i]);
    return buf;
  }
};
template <typename Q>   // int8 or float8_e4m3fn codes, one scale per row
struct ScaledRows {
  static constexpr bool kA8 = false;
  const Q* w;
  const float* scales;
  int64_t K;
  const float* row(int64_t r, float* buf) const {
    const float s = scales[r];
    for (int64_t i = 0; i < K; ++i) buf[i] = float(w[r * K + i]) * s;
    return buf;
  }
};
struct Int4Rows {        // formats.py int4: blocks of 32 as 16 bytes (low nibbles: the first 16)
  static constexpr bool kA8 = false;
  const uint8_t* w;
  const float* scales;
  const float* zeros;
  int64_t K, G;
  const float* row(int64_t r, float* buf) const {
    const uint8_t* q = w + r * (K / 2);
    const float* s = scales + r * (K / G);
    const float* z = zeros + r * (K / G);
    for (int64_t b = 0; b < K / 32; ++b)
      for (int j = 0; j < 16; ++j) {
        const int64_t k0 = 32 * b + j, k1 = k0 + 16;
        const uint8_t byte = q[16 * b + j];
        buf[k0] = (float(byte & 0x0F) - z[k0 / G]) * s[k0 / G];
        buf[k1] = (float(byte >> 4) - z[k1 / G]) * s[k1 / G];
      }
    return buf;
  }
};

// Activations quantized at run time (W8A8, W4A8): int8 codes [n, K] and a float scale per
// group of G along K (G = K: per row), symmetric on max|x| / 127, rounded half to even
// (plugins/quant/ops.py quantize_activations / quantize_activation_groups).
struct QuantActs {
  std::vector<int8_t> codes;
  std::vector<float> scales;   // [n, K / G]
  int64_t K, G;
};

QuantActs quantize_acts(const float* in, int64_t n, int64_t K, int64_t G) {
  QuantActs a{std::vector<int8_t>(n * K), std::vector<float>(n * (K / G)), K, G};
  for (int64_t q = 0; q < n * (K / G); ++q) {
    const float* x = in + q * G;
    float amax = 0.0f;
    for (int64_t i = 0; i < G; ++i) amax = std::max(amax, std::fabs(x[i]));
    float sc = amax / 127.0f;
    if (!(sc > 0.0f)) sc = 1.0f;
    a.scales[q] = sc;
    for (int64_t i = 0; i < G; ++i)
      a.codes[q * G + i] =
          static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(x[i] / sc))));
  }
  return a;
}

// W8A8: int8 weight rows (one scale each) times per-row int8 activations, exact int32 sums.
struct Int8A8Rows {
  static constexpr bool kA8 = true;
  const int8_t* w;
  const float* scales;
  int64_t K;
  int64_t act_group() const { return K; }
  float dot_a8(int64_t r, const QuantActs& a, int64_t g) const {
    const int8_t* wr = w + r * K;
    const int8_t* c = a.codes.data() + g * K;
    int32_t acc = 0;
    for (int64_t i = 0; i < K; ++i) acc += int32_t(c[i]) * int32_t(wr[i]);
    return float(acc) * (a.scales[g] * scales[r]);
  }
};

// W4A8: formats.py int4 rows at group 32 times int8 activations per group of 32:
// per group, sx * s * (sum(codes * q) - zero * sum(codes)), summed over the groups in order.
struct Int4A8Rows {
  static constexpr bool kA8 = true;
  const uint8_t* w;
  const float* scales;
  const float* zeros;
  int64_t K;
  int64_t act_group() const { return 32; }
  float dot_a8(int64_t r, const QuantActs& a, int64_t g) const {
    const uint8_t* q = w + r * (K / 2);
    const int8_t* c = a.codes.data() + g * K;
    const int64_t nb = K / 32;
    float y = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      int32_t acc = 0, sum = 0;
      for (int j = 0; j < 16; ++j) {
        const int32_t lo = c[32 * b + j], hi = c[32 * b + 16 + j];
        acc += lo * int32_t(q[16 * b + j] & 0x0F) + hi * int32_t(q[16 * b + j] >> 4);
        sum += lo + hi;
      }
      const int64_t sg = r * nb + b;
      y += (a.scales[g * nb + b] * scales[sg]) * (float(acc) - zeros[sg] * float(sum));
    }
    return y;
  }
};

// out[g, r] = w[r] . in[g] for the n rows of `in` (each K long) and the `rows` rows of one
// expert's matrix (rows r0.. of the decoder); each weight row decoded once for all of them
// (W8A8 / W4A8 rows: `in` quantized once, then integer dot products).
template <typename Rows>
void rows_times_group(const Rows& w, int64_t r0, int64_t rows, int64_t K, const float* in,
                      int64_t n, float* out) {
  if constexpr (Rows::kA8) {
    const QuantActs a = quantize_acts(in, n, K, w.act_group());
    kiln::parallel_chunks(rows, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r)
        for (int64_t g = 0; g < n; ++g) out[g * rows + r] = w.dot_a8(r0 + r, a, g);
    });
  } else {
    kiln::parallel_chunks(rows, 16, [&](int64_t lo, int64_t hi) {
      std::vector<float> buf(K);
      for (int64_t r = lo; r < hi; ++r) {
        const float* wr = w.row(r0 + r, buf.data());
        int64_t g = 0;
        float o[2];
        for (; g + 2 <= n; g += 2) {            // two tokens per pass over the row
          const float* a2[2] = {in + g * K, in + (g + 1) * K};
          dots<2>(wr, a2, K, o);
          out[g * rows + r] = o[0];
          out[(g + 1) * rows + r] = o[1];
        }
        if (g < n) {
          const float* a1[1] = {in + g * K};
          dots<1>(wr, a1, K, o);
          out[g * rows + r] = o[0];
        }
      }
    });
  }
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

// contrib[t * k + j] = expert topk_ids[t, j]'s output for token t (unweighted).
template <typename Rows13, typename Rows2>
void run_experts(const float* x, const Groups& groups, const Rows13& w13, const Rows2& w2,
                 int64_t E, int64_t H, int64_t I, int64_t k, float* contrib) {
  std::vector<float> xs, h, a, y;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t b = groups.start[e], n = groups.start[e + 1] - b;
    if (n == 0) continue;
    xs.resize(n * H);
    for (int64_t g = 0; g < n; ++g)
      std::copy_n(x + (groups.pairs[b + g] / k) * H, H, xs.data() + g * H);
    h.resize(n * 2 * I);
    rows_times_group(w13, e * 2 * I, 2 * I, H, xs.data(), n, h.data());      // [n, 2I]
    a.resize(n * I);
    for (int64_t g = 0; g < n; ++g)
      for (int64_t i = 0; i < I; ++i) {
        const float gate = h[g * 2 * I + i], up = h[g * 2 * I + I + i];
        a[g * I + i] = gate / (1.0f + std::exp(-gate)) * up;                 // silu(gate) * up
      }
    y.resize(n * H);
    rows_times_group(w2, e * H, H, I, a.data(), n, y.data());                // [n, H]
    for (int64_t g = 0; g < n; ++g)
      std::copy_n(y.data() + g * H, H, contrib + groups.pairs[b + g] * H);
  }
}

// The routed tokens of one step: x as float32, the pairs grouped by expert.
struct Routed {
  at::Tensor x, weights;
  Groups groups;
  int64_t T, H, k;
};

Routed prepare(const char* op, const at::Tensor& x, const at::Tensor& topk_ids,
               const at::Tensor& topk_weights, int64_t E) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be [T, H]");
  const int64_t T = x.size(0);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T &&
                  topk_weights.sizes() == topk_ids.sizes(), op,
              ": topk_ids and topk_weights must both be [T, k]");
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const int64_t k = topk_ids.size(1);
  return Routed{x.to(at::kFloat).contiguous(), topk_weights.to(at::kFloat).contiguous(),
                group_by_expert(ids.data_ptr<int64_t>(), T * k, E), T, x.size(1), k};
}

// out[t] = sum_j weights[t, j] * contrib[t, j], in j order; in x's dtype.
at::Tensor combine(const Routed& r, const at::Tensor& contrib, at::ScalarType dtype) {
  at::Tensor out = at::empty({r.T, r.H}, r.x.options());
  const float* c = contrib.data_ptr<float>();
  const float* wt = r.weights.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t k = r.k, H = r.H;
  for (int64_t t = 0; t < r.T; ++t)
    for (int64_t d = 0; d < H; ++d) {
      float s = c[(t * k) * H + d] * wt[t * k];
      for (int64_t j = 1; j < k; ++j) s += c[(t * k + j) * H + d] * wt[t * k + j];
      o[t * H + d] = s;
    }
  return out.to(dtype);
}

template <typename Rows13, typename Rows2>
at::Tensor experts_pass(const Routed& r, const Rows13& w13, const Rows2& w2, int64_t E,
                        int64_t I, at::ScalarType dtype) {
  at::Tensor contrib = at::empty({r.T, r.k, r.H}, r.x.options());          // [T, k, H]
  run_experts(r.x.data_ptr<float>(), r.groups, w13, w2, E, r.H, I, r.k,
              contrib.data_ptr<float>());
  return combine(r, contrib, dtype);
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_ids,
                       const at::Tensor& topk_weights, const at::Tensor& w13,
                       const at::Tensor& w2) {
  const char* op = "kiln::moe_experts";
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3, op,
              ": x [T, H], w13 [E, 2I, H], w2 [E, H, I] expected");
  const int64_t H = x.size(1), E = w13.size(0), I = w13.size(1) / 2;
  TORCH_CHECK(w13.size(2) == H && w2.size(0) == E && w2.size(1) == H && w2.size(2) == I, op,
              ": w13 ", w13.sizes(), " and w2 ", w2.sizes(), " do not fit x ", x.sizes());
  TORCH_CHECK(w13.scalar_type() == w2.scalar_type() &&
                  (w13.scalar_type() == at::kFloat || w13.scalar_type() == at::kBFloat16),
              op, ": expert weights must both be float32 or both bfloat16");
  const Routed r = prepare(op, x, topk_ids, topk_weights, E);
  const at::Tensor a13 = w13.contiguous(), a2 = w2.contiguous();
  if (w13.scalar_type() == at::kFloat)
    return experts_pass(r, F32Rows{a13.data_ptr<float>(), H}, F32Rows{a2.data_ptr<float>(), I},
                        E, I, x.scalar_type());
  return experts_pass(r, Bf16Rows{a13.data_ptr<at::BFloat16>(), H},
                      Bf16Rows{a2.data_ptr<at::BFloat16>(), I}, E, I, x.scalar_type());
}

// The checked arguments both packed-experts ops share: codes contiguous, scales float32.
struct PackedArgs {
  Routed r;
  at::Tensor q13, q2, s13, s2;
  int64_t H, E, I;
};

PackedArgs packed_args(const char* op, const at::Tensor& x, const at::Tensor& topk_ids,
                       const at::Tensor& topk_weights, const at::Tensor& w13,
                       const at::Tensor& s13, const at::Tensor& w2, const at::Tensor& s2) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3 && w13.scalar_type() ==
                  w2.scalar_type(), op, ": x [T, H], w13 [E, 2I, ...], w2 [E, H, ...] of one dtype");
  const int64_t H = x.size(1), E = w13.size(0), I = w13.size(1) / 2;
  TORCH_CHECK(w2.size(0) == E && w2.size(1) == H, op, ": w13 ", w13.sizes(), " and w2 ",
              w2.sizes(), " do not fit x ", x.sizes());
  return PackedArgs{prepare(op, x, topk_ids, topk_weights, E), w13.contiguous(),
                    w2.contiguous(), s13.to(at::kFloat).contiguous(),
                    s2.to(at::kFloat).contiguous(), H, E, I};
}

at::Tensor moe_experts_quant(const at::Tensor& x, const at::Tensor& topk_ids,
                             const at::Tensor& topk_weights, const at::Tensor& w13,
                             const at::Tensor& s13, const std::optional<at::Tensor>& z13,
                             const at::Tensor& w2, const at::Tensor& s2,
                             const std::optional<at::Tensor>& z2, int64_t group_size) {
  const char* op = "kiln::moe_experts_quant";
  const PackedArgs p = packed_args(op, x, topk_ids, topk_weights, w13, s13, w2, s2);
  const Routed& r = p.r;
  const at::Tensor &q13 = p.q13, &q2 = p.q2, &f13 = p.s13, &f2 = p.s2;
  const int64_t H = p.H, E = p.E, I = p.I;
  const auto dtype = x.scalar_type();
  switch (w13.scalar_type()) {
    case at::kChar:
      TORCH_CHECK(w13.size(2) == H && w2.size(2) == I, op, ": int8 experts [E, N, K] expected");
      return experts_pass(r, ScaledRows<int8_t>{q13.data_ptr<int8_t>(), f13.data_ptr<float>(), H},
                          ScaledRows<int8_t>{q2.data_ptr<int8_t>(), f2.data_ptr<float>(), I}, E,
                          I, dtype);
    case at::kFloat8_e4m3fn: {
      using F8 = c10::Float8_e4m3fn;
      TORCH_CHECK(w13.size(2) == H && w2.size(2) == I, op, ": fp8 experts [E, N, K] expected");
      return experts_pass(r, ScaledRows<F8>{q13.data_ptr<F8>(), f13.data_ptr<float>(), H},
                          ScaledRows<F8>{q2.data_ptr<F8>(), f2.data_ptr<float>(), I}, E, I, dtype);
    }
    case at::kByte: {
      TORCH_CHECK(z13.has_value() && z2.has_value() && group_size > 0 && H % 32 == 0 &&
                      I % 32 == 0 && H % group_size == 0 && I % group_size == 0 &&
                      w13.size(2) == H / 2 && w2.size(2) == I / 2,
                  op, ": int4 experts need zeros, a group_size dividing H and I (multiples of 32)");
      const at::Tensor zz13 = z13->to(at::kFloat).contiguous();
      const at::Tensor zz2 = z2->to(at::kFloat).contiguous();
      return experts_pass(
          r, Int4Rows{q13.data_ptr<uint8_t>(), f13.data_ptr<float>(), zz13.data_ptr<float>(), H,
                      group_size},
          Int4Rows{q2.data_ptr<uint8_t>(), f2.data_ptr<float>(), zz2.data_ptr<float>(), I,
                   group_size},
          E, I, dtype);
    }
    default:
      TORCH_CHECK(false, op, ": experts of dtype ", w13.scalar_type(),
                  "; int8, float8_e4m3fn or uint8 (int4) expected");
  }
}

at::Tensor moe_experts_a8(const at::Tensor& x, const at::Tensor& topk_ids,
                          const at::Tensor& topk_weights, const at::Tensor& w13,
                          const at::Tensor& s13, const std::optional<at::Tensor>& z13,
                          const at::Tensor& w2, const at::Tensor& s2,
                          const std::optional<at::Tensor>& z2, int64_t group_size) {
  const char* op = "kiln::moe_experts_a8";
  const PackedArgs p = packed_args(op, x, topk_ids, topk_weights, w13, s13, w2, s2);
  const Routed& r = p.r;
  const at::Tensor &q13 = p.q13, &q2 = p.q2, &f13 = p.s13, &f2 = p.s2;
  const int64_t H = p.H, E = p.E, I = p.I;
  if (w13.scalar_type() == at::kChar) {
    TORCH_CHECK(w13.size(2) == H && w2.size(2) == I, op, ": int8 experts [E, N, K] expected");
    return experts_pass(r, Int8A8Rows{q13.data_ptr<int8_t>(), f13.data_ptr<float>(), H},
                        Int8A8Rows{q2.data_ptr<int8_t>(), f2.data_ptr<float>(), I}, E, I,
                        x.scalar_type());
  }
  TORCH_CHECK(w13.scalar_type() == at::kByte && z13.has_value() && z2.has_value() &&
                  group_size == 32 && H % 32 == 0 && I % 32 == 0 && w13.size(2) == H / 2 &&
                  w2.size(2) == I / 2,
              op, ": int8 experts, or int4 experts with zeros at group_size 32 (W4A8)");
  const at::Tensor zz13 = z13->to(at::kFloat).contiguous(), zz2 = z2->to(at::kFloat).contiguous();
  return experts_pass(
      r, Int4A8Rows{q13.data_ptr<uint8_t>(), f13.data_ptr<float>(), zz13.data_ptr<float>(), H},
      Int4A8Rows{q2.data_ptr<uint8_t>(), f2.data_ptr<float>(), zz2.data_ptr<float>(), I}, E, I,
      x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("moe_experts", &moe_experts);
  m.impl("moe_experts_quant", &moe_experts_quant);
  m.impl("moe_experts_a8", &moe_experts_a8);
}

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

// The shim of a packed-experts op `kiln::NAME(x, topk_ids, topk_weights, w13, w13_scales,
// w13_zeros?, w2, w2_scales, w2_zeros?, int group_size)`.
#define KILN_MOE_PACKED_SHIM(NAME)                                                             \
  KILN_AOTI_SHIM aoti_torch_cpu_##NAME(                                                        \
      AtenTensorHandle x, AtenTensorHandle ids, AtenTensorHandle weights, AtenTensorHandle w13, \
      AtenTensorHandle s13, AtenTensorHandle* z13, AtenTensorHandle w2, AtenTensorHandle s2,   \
      AtenTensorHandle* z2, int64_t group_size, AtenTensorHandle* ret0) {                      \
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({                                               \
      using kiln_shim::Opt;                                                                    \
      using kiln_shim::T;                                                                      \
      static const auto op =                                                                   \
          kiln_shim::op<at::Tensor(T, T, T, T, T, Opt, T, T, Opt, int64_t)>("kiln::" #NAME);   \
      *ret0 = kiln_shim::result(op.call(                                                       \
          kiln_shim::tensor(x), kiln_shim::tensor(ids), kiln_shim::tensor(weights),            \
          kiln_shim::tensor(w13), kiln_shim::tensor(s13), kiln_shim::optional(z13),            \
          kiln_shim::tensor(w2), kiln_shim::tensor(s2), kiln_shim::optional(z2), group_size)); \
    });                                                                                        \
  }

KILN_MOE_PACKED_SHIM(moe_experts_quant)
KILN_MOE_PACKED_SHIM(moe_experts_a8)
