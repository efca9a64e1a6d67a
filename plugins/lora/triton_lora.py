"""kiln::lora_apply as Triton kernels (NVIDIA GPUs).

    kiln::lora_apply_triton(y [T, N], x [T, K], slots [T], lora_a [S, R, K], lora_b [S, N, R],
                            scales [S]) -> [T, N]

Same arguments and result as kiln::lora_apply (plugins/lora/ops.py). The tokens are sorted by
slot (stable: token order within a slot; slot -1 first, and skipped); program (s, m, ...)
takes tokens m*BLOCK_M.. of slot s, so each slot's A and B are read by its own programs only,
for every token of the slot:

    _shrink_kernel:  h[p, r] = x[t] . lora_a[s, r]                      [T, R]
    _expand_kernel:  out[t, n] = y[t, n] + scales[s] * h[p] . lora_b[s, n]   (BLOCK_N columns)

Rows of slot -1 keep y. Tile sizes are constants, never functions of T, so a token's result
does not depend on the tokens beside it. Registered with `torch.library.triton_op`; with
TRITON_INTERPRET=1 set before import the kernels run on CPU tensors (tests/interpret).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kiln.plugins.lora import ops
from kiln.plugins.triton_common import dot_precision, segment_rows

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, order_ptr, starts_ptr, h_ptr, K, R,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    s, pid_m = tl.program_id(0), tl.program_id(1)
    pos, tok, mmask, any_rows = segment_rows(order_ptr, starts_ptr, s, pid_m, BLOCK_M)
    if any_rows:
        t64 = tok.to(tl.int64)      # a new name: Triton keeps a variable's type across an if
        rr = tl.arange(0, BLOCK_R)
        rmask = rr < R
        a_s = a_ptr + s.to(tl.int64) * R * K
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < K
            xs = tl.load(x_ptr + t64[:, None] * K + rk[None, :],
                         mask=mmask[:, None] & kmask[None, :], other=0.0)
            a = tl.load(a_s + rr[None, :].to(tl.int64) * K + rk[:, None],
                        mask=kmask[:, None] & rmask[None, :], other=0.0)
            acc = tl.dot(xs, a, acc, input_precision=DOT_PRECISION)
        tl.store(h_ptr + pos.to(tl.int64)[:, None] * R + rr[None, :], acc,
                 mask=mmask[:, None] & rmask[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, scales_ptr, order_ptr, starts_ptr, out_ptr, N, R,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    s, pid_m, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pos, tok, mmask, any_rows = segment_rows(order_ptr, starts_ptr, s, pid_m, BLOCK_M)
    if any_rows:
        t64 = tok.to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        rr = tl.arange(0, BLOCK_R)
        rmask = rr < R
        h = tl.load(h_ptr + pos.to(tl.int64)[:, None] * R + rr[None, :],
                    mask=mmask[:, None] & rmask[None, :], other=0.0)
        b = tl.load(b_ptr + s.to(tl.int64) * N * R + rn[None, :].to(tl.int64) * R + rr[:, None],
                    mask=rmask[:, None] & nmask[None, :], other=0.0)
        delta = tl.dot(h, b, input_precision=DOT_PRECISION) * tl.load(scales_ptr + s)
        optr = out_ptr + t64[:, None] * N + rn[None, :]
        omask = mmask[:, None] & nmask[None, :]
        tl.store(optr, tl.load(optr, mask=omask, other=0.0) + delta, mask=omask)


@triton_op("kiln::lora_apply_triton", mutates_args=())
def lora_apply_triton(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor,
                      lora_a: torch.Tensor, lora_b: torch.Tensor,
                      scales: torch.Tensor) -> torch.Tensor:
    """kiln::lora_apply in Triton (float32 adapters; float32 or bfloat16 activations)."""
    ops.check_args(y, x, slots, lora_a, lora_b, scales)
    T, K = x.shape
    S, R, _ = lora_a.shape
    N = y.shape[1]
    xf = x.float().contiguous()
    a, b = lora_a.float().contiguous(), lora_b.float().contiguous()
    out = y.float().clone()
    by_slot, order = torch.sort(slots.long(), stable=True)               # tokens by slot
    order = order.to(torch.int32)
    # slot s's tokens are order[starts[s]:starts[s + 1]] (slot -1 sorts before starts[0])
    starts = torch.searchsorted(by_slot, torch.arange(S + 1, device=x.device)).to(torch.int32)
    h = xf.new_zeros((T, R))
    rows = triton.cdiv(T, BLOCK_M)              # blocks of one slot's tokens, at most
    block_r = max(16, triton.next_power_of_2(R))
    prec = dot_precision(torch.float32)
    wrap_triton(_shrink_kernel)[(S, rows)](
        xf, a, order, starts, h, K, R, BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K,
        DOT_PRECISION=prec)
    wrap_triton(_expand_kernel)[(S, rows, triton.cdiv(N, BLOCK_N))](
        h, b, scales.float().contiguous(), order, starts, out, N, R, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, BLOCK_R=block_r, DOT_PRECISION=prec)
    return out.to(y.dtype)
