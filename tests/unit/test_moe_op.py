"""kiln::moe_experts (reference and compiled CPU kernel) against a naive per-token loop, its
batch invariance, and `route` (softmax, top-k, renormalized)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.plugins.moe import kernels, ops

pytestmark = pytest.mark.unit


def naive(x, ids, weights, w13, w2):
    """One token and one selected expert at a time, in float64."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            a = F.silu(h[:inter]) * h[inter:]
            out[t] += float(weights[t, j]) * (w2[e].double() @ a)
    return out


def case(T=32, E=8, k=2, H=40, inter=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids, weights = ops.route(torch.randn(T, E, generator=g), k, normalize=True)
    w13 = torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter ** 0.5
    return x, ids, weights, w13, w2


@pytest.fixture(scope="module")
def cpu_kernel():
    kernels.load()


@pytest.mark.parametrize("shape", [dict(), dict(T=5, E=16, k=4, H=35, inter=9), dict(T=1, k=1)])
def test_reference_matches_naive_loop(shape):
    args = case(**shape)
    ref = naive(*args)
    assert (ops.moe_experts_reference(*args).double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("shape", [dict(), dict(T=5, E=16, k=4, H=35, inter=9), dict(T=1, k=1)])
def test_cpu_kernel_matches_naive_loop(cpu_kernel, shape):
    args = case(**shape)
    out = torch.ops.kiln.moe_experts(*args)
    assert out.dtype == torch.float32
    assert (out.double() - naive(*args)).abs().max() < 1e-5


def test_cpu_kernel_bf16_weights(cpu_kernel):
    x, ids, weights, w13, w2 = case()
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    out = torch.ops.kiln.moe_experts(x, ids, weights, w13, w2)
    assert (out.double() - naive(x, ids, weights, w13.float(), w2.float())).abs().max() < 1e-5


def test_cpu_kernel_is_batch_invariant(cpu_kernel):
    """A token's output is bit for bit the one it gets alone, whatever shares the step."""
    x, ids, weights, w13, w2 = case(T=32)
    batch = torch.ops.kiln.moe_experts(x, ids, weights, w13, w2)
    for t in (0, 7, 31):
        alone = torch.ops.kiln.moe_experts(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], w13, w2)
        assert torch.equal(alone[0], batch[t]), t
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(1))
    shuffled = torch.ops.kiln.moe_experts(x[perm], ids[perm], weights[perm], w13, w2)
    assert torch.equal(shuffled, batch[perm])


def test_cpu_kernel_refuses_an_expert_out_of_range(cpu_kernel):
    x, ids, weights, w13, w2 = case(T=2)
    ids[1, 0] = 8
    with pytest.raises(RuntimeError, match="outside 0..7"):
        torch.ops.kiln.moe_experts(x, ids, weights, w13, w2)


def test_reference_refuses_mismatched_weights():
    x, ids, weights, w13, w2 = case(T=2)
    with pytest.raises(ValueError, match="do not fit"):
        ops.moe_experts_reference(x, ids, weights, w13, w2[:, :, :-1])


def test_route_softmax_topk_renormalized():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    ids, w = ops.route(logits, 2, normalize=True)
    assert ids.tolist() == [[1, 2], [2, 3]]
    p = torch.softmax(logits, -1)
    assert torch.allclose(w[0], p[0, [1, 2]] / p[0, [1, 2]].sum())
    assert torch.allclose(w.sum(-1), torch.ones(2))
    _, raw = ops.route(logits, 2, normalize=False)   # Qwen3-MoE without norm_topk_prob
    assert torch.allclose(raw[1], p[1, [2, 3]])


def _packed(w13, w2, scheme, group_size=None):
    """Stacked experts quantized per row (QuantExperts' layout), viewed [E, N, ...]."""
    from kiln.plugins.quant import formats

    e = w13.shape[0]
    out = []
    for w in (w13, w2):
        qw = formats.quantize(w.reshape(-1, w.shape[2]), scheme, group_size)
        view = lambda t: None if t is None else t.view(e, t.shape[0] // e, *t.shape[1:])  # noqa
        out.append((view(qw.qweight), view(qw.scales), view(qw.zeros),
                    formats.dequantize(qw).view(w.shape)))
    return out


@pytest.mark.parametrize("scheme,group", [("int8", None), ("fp8", None), ("int4", 32)])
def test_quantized_experts_match_naive_loop_on_their_dequantized_weights(cpu_kernel, scheme,
                                                                         group):
    x, ids, weights, w13, w2 = case(T=32, E=8, k=2, H=64, inter=32)
    (q13, s13, z13, d13), (q2, s2, z2, d2) = _packed(w13, w2, scheme, group)
    want = naive(x, ids, weights, d13, d2)
    args = (x, ids, weights, q13, s13, z13, q2, s2, z2, group or 0)
    ref = ops.moe_experts_quant_reference(*args)
    out = torch.ops.kiln.moe_experts_quant(*args)
    assert (ref.double() - want).abs().max() < 1e-5
    assert (out.double() - want).abs().max() < 1e-5
    for t in (0, 13):   # batch-invariant like the float pass
        alone = torch.ops.kiln.moe_experts_quant(x[t:t + 1], ids[t:t + 1], weights[t:t + 1],
                                                 *args[3:])
        assert torch.equal(alone[0], out[t]), (scheme, t)


def naive_a8(x, ids, weights, w13, w2, group):
    """Per token and expert: x (then the activation) quantized to int8 per `group` values
    (None: per row), each product from the dequantized weights in float64."""
    def q(v):
        g = v.shape[-1] if group is None else group
        vg = v.float().reshape(-1, g)
        s = vg.abs().amax(-1, keepdim=True) / 127
        s = torch.where(s > 0, s, torch.ones_like(s))
        return (torch.round(vg / s).clamp(-127, 127) * s).reshape(v.shape).double()

    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ q(x[t])
            a = (F.silu(h[:inter]) * h[inter:]).float()
            out[t] += float(weights[t, j]) * (w2[e].double() @ q(a))
    return out


@pytest.mark.parametrize("scheme,group", [("int8", None), ("int4", 32)], ids=["w8a8", "w4a8"])
def test_int8_activation_experts_match_naive_loop(cpu_kernel, scheme, group):
    x, ids, weights, w13, w2 = case(T=32, E=8, k=2, H=64, inter=32)
    (q13, s13, z13, d13), (q2, s2, z2, d2) = _packed(w13, w2, scheme, group)
    want = naive_a8(x, ids, weights, d13, d2, group)
    args = (x, ids, weights, q13, s13, z13, q2, s2, z2, group or 0)
    ref = ops.moe_experts_a8_reference(*args)
    out = torch.ops.kiln.moe_experts_a8(*args)
    scale = want.abs().max()
    assert (ref.double() - want).abs().max() < 1e-4 * scale
    assert (out.double() - ref.double()).abs().max() < 1e-5 * scale
    for t in (0, 13):
        alone = torch.ops.kiln.moe_experts_a8(x[t:t + 1], ids[t:t + 1], weights[t:t + 1],
                                              *args[3:])
        assert torch.equal(alone[0], out[t]), (scheme, t)


def test_qwen3_moe_sparse_layers_follow_transformers_rule():
    """Layer i is sparse unless in mlp_only_layers, and only when (i + 1) % step == 0."""
    from kiln.builder.arch.qwen3_moe import sparse_layers

    cfg = dict(num_hidden_layers=6, num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert sparse_layers(cfg) == (1, 5)
    assert sparse_layers(dict(cfg, decoder_sparse_step=1, mlp_only_layers=[])) == tuple(range(6))
    assert sparse_layers(dict(cfg, num_experts=0)) == ()


def test_moe_config_round_trips_and_counts_its_experts():
    from kiln.builder.arch.config import DecoderConfig

    cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                        num_heads=2, num_kv_heads=1, head_dim=16, num_experts=4,
                        experts_per_token=2, moe_intermediate_size=8, normalize_topk=False,
                        sparse_layers=(0, 2))
    assert DecoderConfig.from_dict(cfg.to_dict()) == cfg
    dense = DecoderConfig(**{**cfg.to_dict(), "num_experts": 0, "sparse_layers": ()})
    # two sparse layers: their dense MLP (3 * 32 * 64) becomes 4 experts and a router
    assert cfg.num_parameters - dense.num_parameters == 2 * (4 * 3 * 32 * 8 + 32 * 4
                                                             - 3 * 32 * 64)
