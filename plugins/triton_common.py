"""Triton helpers shared by the plugins' GPU kernels (paged_kv's attention, quant's linears).

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


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision for activations of `dtype`. Operands are float32 in
    registers either way: fp32 activations multiply in full precision (ieee); bf16/fp16 ones
    use TF32 tensor cores, exact for bf16 operands and int8/E4M3 codes (10 mantissa bits).
    (Triton's interpreter multiplies bf16 operands of tl.dot as raw bits, so bf16 dots are
    avoided altogether.)"""
    return "ieee" if dtype == torch.float32 else "tf32"
