"""The `kiln::moe_experts` custom op: schema, fake (for export) and pure-torch reference;
`route`, the top-k softmax routing every family shares.

One call per sparse layer runs the selected experts of every token of the packed step:

    x [T, H]; topk_ids [T, k] int64; topk_weights [T, k] float32
    w13 [E, 2*I, H] (each expert's gate rows then up rows); w2 [E, H, I]
    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))
             with e = topk_ids[t, j], summed in j order

Kernels group the tokens by expert and make one pass over each selected expert's weights.
Every token's output is computed the same way whatever other tokens share the step (each
dot product in a fixed order, the k contributions summed in j order): batch-invariant.

kiln::moe_experts_quant is the same pass over packed experts (int8, fp8, int4: the quant
plugin's weight-only formats): each weight row is decoded once per step and multiplied in
float32 with every token routed to it. kiln::moe_experts_a8 takes the same int8 / int4
experts with int8 activations (W8A8 per row, W4A8 per group of 32): integer dot products.

The references are registered for CompositeExplicitAutograd (any device); the compiled CPU
kernels (csrc/moe_experts_cpu.cpp, plugins.moe.kernels) are registered for CPU and take
precedence once loaded. Both compute in float32; the output has x's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.plugins.quant import formats
from kiln.plugins.quant import ops as quant_ops

SCHEMA = ("moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, "
          "Tensor w2) -> Tensor")
# Packed experts (plugins/quant/formats.py, one matrix per expert): int8 / fp8 qweight
# [E, N, K] with scales [E, N]; int4 qweight uint8 [E, N, K/2] with scales and zeros
# [E, N, K/G] (group_size G; 0 for the others). The format follows qweight's dtype.
QUANT_SCHEMA = ("moe_experts_quant(Tensor x, Tensor topk_ids, Tensor topk_weights, "
                "Tensor w13, Tensor w13_scales, Tensor? w13_zeros, Tensor w2, Tensor w2_scales, "
                "Tensor? w2_zeros, int group_size) -> Tensor")

# The same packed int8 / int4 experts with int8 activations quantized at run time: W8A8
# (int8 weights, x per row) and W4A8 (int4 at group_size 32, x per group of 32).
A8_SCHEMA = QUANT_SCHEMA.replace("moe_experts_quant", "moe_experts_a8")

_lib = torch.library.Library("kiln", "FRAGMENT")
_lib.define(SCHEMA)
_lib.define(QUANT_SCHEMA)
_lib.define(A8_SCHEMA)


def route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (topk_ids [T, k] int64, topk_weights [T, k] float32): softmax
    over all experts in float32, the k largest, renormalized to sum to 1 when `normalize`
    (Mixtral; Qwen3-MoE with norm_topk_prob). Per row, so batch-invariant."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def check_args(x, topk_ids, topk_weights, w13, w2) -> None:
    """ValueError naming the argument whose shape does not fit the others."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"kiln::moe_experts: x [T, H], w13 [E, 2I, H], w2 [E, H, I] expected; "
                         f"got {list(x.shape)}, {list(w13.shape)}, {list(w2.shape)}")
    e, two_i, h = w13.shape
    if h != x.shape[1] or tuple(w2.shape) != (e, h, two_i // 2) or two_i % 2:
        raise ValueError(f"kiln::moe_experts: w13 {list(w13.shape)} and w2 {list(w2.shape)} "
                         f"do not fit x {list(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"kiln::moe_experts: topk_ids {list(topk_ids.shape)} and topk_weights "
                         f"{list(topk_weights.shape)} must both be [T={x.shape[0]}, k]")


def moe_experts_reference(x, topk_ids, topk_weights, w13, w2) -> torch.Tensor:
    """Pure-torch experts pass: tokens grouped by expert, each selected expert once."""
    check_args(x, topk_ids, topk_weights, w13, w2)
    return _experts_loop(x, topk_ids, topk_weights, w2.shape[2],
                         lambda e, xs: xs @ w13[e].float().T, lambda e, a: a @ w2[e].float().T)


def _experts_loop(x, topk_ids, topk_weights, inter: int, up, down) -> torch.Tensor:
    """The experts pass with each expert's projections given: up(e, xs [n, H]) -> [n, 2I],
    down(e, a [n, I]) -> [n, H]."""
    T, k = topk_ids.shape
    xf = x.float()
    contrib = xf.new_zeros((T, k, x.shape[1]))                      # [T, k, H]
    flat = topk_ids.reshape(-1)
    for e in torch.unique(flat).tolist():
        rows = (flat == e).nonzero().squeeze(1)                      # (t, j) pairs, flattened
        h = up(e, xf[rows // k])                                     # [n, 2I]
        a = F.silu(h[:, :inter]) * h[:, inter:]
        contrib.view(T * k, -1)[rows] = down(e, a)                   # [n, H]
    out = contrib[:, 0] * topk_weights[:, :1].float()
    for j in range(1, k):                                            # in j order
        out = out + contrib[:, j] * topk_weights[:, j:j + 1].float()
    return out.to(x.dtype)


def dequantize_experts(qweight, scales, zeros, group_size: int) -> torch.Tensor:
    """Packed experts [E, N, ...] -> float32 [E, N, K] (formats' dequantizers, per row)."""
    e, n = qweight.shape[:2]
    flat = lambda t: None if t is None else t.reshape(e * n, *t.shape[2:])  # noqa: E731
    if qweight.dtype == torch.uint8:
        w = formats.dequantize_int4(flat(qweight), flat(scales), flat(zeros), group_size)
    elif qweight.dtype == torch.int8:
        w = formats.dequantize_int8(flat(qweight), flat(scales))
    elif qweight.dtype == torch.float8_e4m3fn:
        w = formats.dequantize_fp8(flat(qweight), flat(scales))
    else:
        raise ValueError(f"kiln::moe_experts_quant: qweight of dtype {qweight.dtype}; "
                         "int8, float8_e4m3fn or uint8 (int4) expected")
    return w.view(e, n, -1)


def moe_experts_quant_reference(x, topk_ids, topk_weights, w13, w13_scales, w13_zeros, w2,
                                w2_scales, w2_zeros, group_size: int) -> torch.Tensor:
    """Dequantize every expert, then the float reference."""
    return moe_experts_reference(x, topk_ids, topk_weights,
                                 dequantize_experts(w13, w13_scales, w13_zeros, group_size),
                                 dequantize_experts(w2, w2_scales, w2_zeros, group_size))


def linear_a8_reference(xs, qweight, scales, zeros) -> torch.Tensor:
    """One expert's W8A8 (int8 qweight [N, K]) or W4A8 (int4 [N, K/2], group 32) product."""
    if qweight.dtype == torch.int8:
        return quant_ops.linear_int8_a8_reference(xs, qweight, scales)
    xq, sx = quant_ops.quantize_activation_groups(xs)                 # [n, G, 32], [n, G]
    q = formats.unpack_int4(qweight).double().view(qweight.shape[0], -1, 32)   # [N, G, 32]
    acc = torch.einsum("mgk,ngk->mng", xq.double(), q).float()         # exact integer sums
    sums = xq.sum(dim=-1)[:, None, :]                                  # [n, 1, G]
    return ((sx[:, None, :] * scales.float()[None]) * (acc - zeros.float()[None] * sums)).sum(-1)


def moe_experts_a8_reference(x, topk_ids, topk_weights, w13, w13_scales, w13_zeros, w2,
                             w2_scales, w2_zeros, group_size: int) -> torch.Tensor:
    """kiln::moe_experts_a8: each expert's projections as W8A8 / W4A8 products."""
    if w13.dtype == torch.uint8 and group_size != 32:
        raise ValueError(f"kiln::moe_experts_a8: int4 experts need group_size 32 (W4A8), "
                         f"got {group_size}")
    z = lambda t, e: None if t is None else t[e]  # noqa: E731
    return _experts_loop(
        x, topk_ids, topk_weights, w13.shape[1] // 2,
        lambda e, xs: linear_a8_reference(xs, w13[e], w13_scales[e], z(w13_zeros, e)),
        lambda e, a: linear_a8_reference(a, w2[e], w2_scales[e], z(w2_zeros, e)))


_lib.impl("moe_experts", moe_experts_reference, "CompositeExplicitAutograd")
_lib.impl("moe_experts_quant", moe_experts_quant_reference, "CompositeExplicitAutograd")
_lib.impl("moe_experts_a8", moe_experts_a8_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("kiln::moe_experts_a8")
def _moe_experts_a8_fake(x, topk_ids, topk_weights, w13, w13_scales, w13_zeros, w2,
                         w2_scales, w2_zeros, group_size):
    return torch.empty_like(x)


@torch.library.register_fake("kiln::moe_experts_quant")
def _moe_experts_quant_fake(x, topk_ids, topk_weights, w13, w13_scales, w13_zeros, w2,
                            w2_scales, w2_zeros, group_size):
    return torch.empty_like(x)


@torch.library.register_fake("kiln::moe_experts")
def _moe_experts_fake(x, topk_ids, topk_weights, w13, w2):
    torch._check(w13.shape[2] == x.shape[1], lambda: "moe_experts: w13/x hidden mismatch")
    return torch.empty_like(x)
