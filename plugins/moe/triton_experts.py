"""kiln::moe_experts as Triton kernels (NVIDIA GPUs): the experts pass over float experts.

    kiln::moe_experts_triton(x [T, H], topk_ids [T, k], topk_weights [T, k],
                             w13 [E, 2I, H], w2 [E, H, I])  (float32 | bfloat16 weights) -> [T, H]

Same arguments and result as kiln::moe_experts (plugins/moe/ops.py). The (token, j) pairs
are sorted by expert (stable: token order within an expert); program (e, m, n) takes rows
m*BLOCK_M.. of expert e's pairs and BLOCK_N output columns, so each expert's weights are
read by its own programs only, for every token routed to it:

    _gate_up_kernel:  act[p, n] = silu(x[t] . w13[e, n]) * (x[t] . w13[e, I + n])   [T*k, I]
    _down_kernel:     out[p, c] = act[p] . w2[e, c]                                [T*k, H]

then out[t] = sum_j topk_weights[t, j] * out[t*k + j] in j order. Tile sizes are constants,
never functions of T, so a token's result does not depend on the tokens beside it.
Registered with `torch.library.triton_op`; with TRITON_INTERPRET=1 set before import the
kernels run on CPU tensors (tests/interpret).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kiln.plugins.moe import ops
from kiln.plugins.triton_common import dot_precision, segment_rows

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, order_ptr, starts_ptr, act_ptr, H, I, TOPK,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    e, pid_m, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # expert e's (token, k) pairs, flat t * k + j
    _, pairs, mmask, any_rows = segment_rows(order_ptr, starts_ptr, e, pid_m, BLOCK_M)
    if any_rows:
        tok = (pairs // TOPK).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < I
        w_e = w_ptr + e.to(tl.int64) * 2 * I * H
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < H
            xs = tl.load(x_ptr + tok[:, None] * H + rk[None, :],
                         mask=mmask[:, None] & kmask[None, :], other=0.0)
            wmask = kmask[:, None] & nmask[None, :]
            wg = tl.load(w_e + rn[None, :].to(tl.int64) * H + rk[:, None], mask=wmask,
                         other=0.0).to(tl.float32)
            wu = tl.load(w_e + (I + rn[None, :]).to(tl.int64) * H + rk[:, None], mask=wmask,
                         other=0.0).to(tl.float32)
            acc_g = tl.dot(xs, wg, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(xs, wu, acc_u, input_precision=DOT_PRECISION)
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u                    # silu(gate) * up
        tl.store(act_ptr + pairs.to(tl.int64)[:, None] * I + rn[None, :], act,
                 mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, order_ptr, starts_ptr, out_ptr, H, I,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    e, pid_m, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # expert e's (token, k) pairs, flat t * k + j
    _, pairs, mmask, any_rows = segment_rows(order_ptr, starts_ptr, e, pid_m, BLOCK_M)
    if any_rows:
        p = pairs.to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < H
        w_e = w_ptr + e.to(tl.int64) * H * I
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < I
            a = tl.load(act_ptr + p[:, None] * I + rk[None, :],
                        mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_e + rn[None, :].to(tl.int64) * I + rk[:, None],
                        mask=kmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        tl.store(out_ptr + p[:, None] * H + rn[None, :], acc,
                 mask=mmask[:, None] & nmask[None, :])


@triton_op("kiln::moe_experts_triton", mutates_args=())
def moe_experts_triton(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """kiln::moe_experts on float32 / bfloat16 experts, in Triton."""
    ops.check_args(x, topk_ids, topk_weights, w13, w2)
    if w13.dtype not in (torch.float32, torch.bfloat16) or w2.dtype != w13.dtype:
        raise RuntimeError(f"kiln::moe_experts_triton: float32 or bfloat16 experts, got "
                           f"{w13.dtype} and {w2.dtype}")
    T, k = topk_ids.shape
    E, two_i, H = w13.shape
    inter = two_i // 2
    xf, w13, w2 = x.float().contiguous(), w13.contiguous(), w2.contiguous()
    flat = topk_ids.reshape(-1).long()
    by_expert, order = torch.sort(flat, stable=True)                    # pairs by expert
    order = order.to(torch.int32)
    # expert e's pairs are order[starts[e]:starts[e + 1]] (static shapes, for export)
    starts = torch.searchsorted(by_expert, torch.arange(E + 1, device=x.device)).to(torch.int32)
    act = xf.new_empty((T * k, inter))
    contrib = xf.new_empty((T * k, H))
    rows = triton.cdiv(T * k, BLOCK_M)            # blocks of one expert's pairs, at most
    prec = dot_precision(torch.float32)
    wrap_triton(_gate_up_kernel)[(E, rows, triton.cdiv(inter, BLOCK_N))](
        xf, w13, order, starts, act, H, inter, k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K, DOT_PRECISION=prec)
    wrap_triton(_down_kernel)[(E, rows, triton.cdiv(H, BLOCK_N))](
        act, w2, order, starts, contrib, H, inter, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K, DOT_PRECISION=prec)
    c = contrib.view(T, k, H)
    w = topk_weights.float()
    out = c[:, 0] * w[:, :1]
    for j in range(1, k):                                                # in j order
        out = out + c[:, j] * w[:, j:j + 1]
    return out.to(x.dtype)
