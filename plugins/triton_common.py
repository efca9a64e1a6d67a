"""Triton helpers shared by the plugins' GPU kernels (paged_kv's attention, quant's linears,
moe's experts, lora's deltas).

Imports triton: only the Triton kernel modules import this one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def bf16_bits(x):
    """float32 x -> bfloat16 bit pattern (int16), round to nearest even like torch's .to();
    the interpreter's own float32 -> bfloat16 cast truncates."""
    bits = x.to(tl.int32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.int16)


@triton.jit
def segment_rows(order_ptr, starts_ptr, g, pid_m, BLOCK_M: tl.constexpr):
    """Rows pid_m*BLOCK_M.. of group g in a grouped order (group g holds
    order[starts[g]:starts[g + 1]]: an expert's (token, k) pairs, an adapter slot's tokens)
    -> (their positions in the order, the order's entries there, the mask, whether any row
    is in the group)."""
    start = tl.load(starts_ptr + g)
    end = tl.load(starts_ptr + g + 1)
    pos = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = pos < end
    return pos, tl.load(order_ptr + pos, mask=mask, other=0), mask, start + pid_m * BLOCK_M < end


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision for activations of `dtype`. Operands are float32 in
    registers either way: fp32 activations multiply in full precision (ieee); bf16/fp16 ones
    use TF32 tensor cores, exact for bf16 operands and int8/E4M3 codes (10 mantissa bits).
    (Triton's interpreter multiplies bf16 operands of tl.dot as raw bits, so bf16 dots are
    avoided altogether.)"""
    return "ieee" if dtype == torch.float32 else "tf32"
