"""The quantized linear ops: schemas, fakes (for export) and dequantize-then-matmul references.

Where each op is implemented: its CPU kernel (csrc/, compiled by plugins/quant/kernels.py),
its reference (this module, any device) and its Triton kernel (plugins/quant/triton_linear.py,
what quant_linear() calls on CUDA; "-": none, CUDA runs F.linear or the reference):

    op (kiln::)         CPU kernel (csrc/)        Python reference               Triton kernel
    linear_fp32         linear_float.cpp          linear_fp32_reference          -
    linear_bf16         linear_float.cpp          linear_bf16_reference          -
    linear_int8         linear_weight_only.cpp    linear_int8_reference          linear_int8_triton
    linear_int4         linear_weight_only.cpp    linear_int4_reference          linear_int4_triton
    linear_fp8          linear_weight_only.cpp    linear_fp8_reference           linear_fp8_triton
    linear_int8_a8      linear_int8_a8.cpp        linear_int8_a8_reference       -
    linear_int4_a8      linear_int4_a8.cpp        linear_int4_a8_reference       -
    linear_int4_rows16  linear_int4_rows16.cpp    linear_int4_rows16_reference   -

Shared C++ headers: dequant_gemv.h (the decode-then-multiply GEMV and tile paths of the
float and weight-only linears), int8_dot.h and int8_gemm.h (integer dot products and GEMM:
W8A8 and the weight-only int8/int4 digits), int4_a8_blocks.h (the int4_a8 format's blocks:
W4A8 and rows16) with int4_a8_amx.h (their AMX tiles).

    kiln::linear_int8(x, qweight int8 [N,K], scales [N], bias?)                -> [M, N]
    kiln::linear_int4(x, qweight uint8 [N,K/2], scales [N,K/G], zeros [N,K/G], G, bias?)
    kiln::linear_fp8 (x, qweight float8_e4m3fn [N,K], scales [N], bias?)       -> [M, N]
    kiln::linear_bf16(x, weight bfloat16 [N,K], bias?)                          -> [M, N]
    kiln::linear_fp32(x, weight float32 [N,K], bias?)                           -> [M, N]
    kiln::linear_int8_a8(x, qweight int8 [N,K], scales [N], bias?)             -> [M, N]
    kiln::linear_int4_a8(x, qweight uint8 [N/16,K/32,256], scales f16 [N/16,K/32,16],
                         mins f16 [N/16,K/32,16], bias?)                         -> [M, N]
    kiln::linear_int4_rows16(x, qweight, scales, mins, bias?)   (int4_a8 weights) -> [M, N]

linear_int8_a8 is W8A8: x is quantized per row at run time (symmetric int8, max|x|/127,
round half to even) and multiplied in integers. linear_int4_a8 is W4A8: x is quantized per
group of 32 along K (llama.cpp's Q8_1 arithmetic: each group its own max|x|/127), each
group's integer dot product is scaled by its weight scale and activation scale, and the
group minimums add min * (activation scale * sum of the group's codes).
linear_int4_rows16 is weight-only on the same weights: x stays float (its CPU kernel holds
each group of x as two int8 digits, at most 3.1e-5 of the group's max|x| off, and takes
the group minimums against the float sum of x). It and the others are referenced by
dequantize-then-matmul.

x is [M, K] float32 or bfloat16; the output has x's dtype. Layouts: plugins/quant/formats.py.
The references below are registered for CompositeExplicitAutograd (any device); the compiled
CPU kernels (csrc/, loaded by plugins.quant.kernels.load()) are registered
for CPU and take precedence once loaded. Both compute in float32.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kiln.plugins.quant import formats

SCHEMAS = {
    "linear_int8": "linear_int8(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor",
    "linear_int4": ("linear_int4(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, "
                    "int group_size, Tensor? bias) -> Tensor"),
    "linear_fp8": "linear_fp8(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor",
    "linear_bf16": "linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    "linear_fp32": "linear_fp32(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    "linear_int8_a8": ("linear_int8_a8(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) "
                       "-> Tensor"),
    "linear_int4_a8": ("linear_int4_a8(Tensor x, Tensor qweight, Tensor scales, Tensor mins, "
                       "Tensor? bias) -> Tensor"),
    "linear_int4_rows16": ("linear_int4_rows16(Tensor x, Tensor qweight, Tensor scales, "
                           "Tensor mins, Tensor? bias) -> Tensor"),
}

_lib = torch.library.Library("kiln", "FRAGMENT")
for _schema in SCHEMAS.values():
    _lib.define(_schema)


def _linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w, b).to(x.dtype)


def linear_int8_reference(x, qweight, scales, bias=None):
    return _linear(x, formats.dequantize_int8(qweight, scales), bias)


def linear_int4_reference(x, qweight, scales, zeros, group_size: int, bias=None):
    return _linear(x, formats.dequantize_int4(qweight, scales, zeros, group_size), bias)


def linear_fp8_reference(x, qweight, scales, bias=None):
    return _linear(x, formats.dequantize_fp8(qweight, scales), bias)


def linear_bf16_reference(x, weight, bias=None):
    return _linear(x, weight.float(), bias)


def linear_fp32_reference(x, weight, bias=None):
    return _linear(x, weight, bias)


def linear_int4_rows16_reference(x, qweight, scales, mins, bias=None):
    return _linear(x, formats.dequantize_int4_a8(qweight, scales, mins), bias)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (codes float [M, K] in -127..127, scales [M, 1]); the kernel's arithmetic."""
    xf = x.float()
    sx = xf.abs().amax(dim=-1, keepdim=True) / 127
    sx = torch.where(sx > 0, sx, torch.ones_like(sx))
    return torch.round(xf / sx).clamp_(-127, 127), sx


def linear_int8_a8_reference(x, qweight, scales, bias=None):
    xq, sx = quantize_activations(x)
    acc = xq.double() @ qweight.double().T          # exact integer sums
    y = acc.float() * (sx * scales[None, :].float())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_activation_groups(x: torch.Tensor, group: int = formats.INT4_A8_GROUP
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (codes float [M, K/group, group] in -127..127, scales [M, K/group]): each
    group of `group` values along K quantized symmetric int8 on its own max|x| / 127."""
    m, k = x.shape
    xg = x.float().reshape(m, k // group, group)
    sx = xg.abs().amax(dim=-1) / 127
    sx = torch.where(sx > 0, sx, torch.ones_like(sx))
    return torch.round(xg / sx[..., None]).clamp_(-127, 127), sx


def linear_int4_a8_reference(x, qweight, scales, mins, bias=None):
    xq, sx = quantize_activation_groups(x)                        # [M, G, 32], [M, G]
    q = formats.unpack_int4_a8(qweight).double()                  # [N, K]
    n = q.shape[0]
    d = scales.float().transpose(1, 2).reshape(n, -1)             # [N, G]
    mn = mins.float().transpose(1, 2).reshape(n, -1)
    qg = q.reshape(n, -1, formats.INT4_A8_GROUP)
    y = torch.zeros(x.shape[0], n)
    for g in range(xq.shape[1]):                                  # exact integer sums per group
        acc = (xq[:, g].double() @ qg[:, g].T).float()            # [M, N]
        y += acc * (sx[:, g, None] * d[None, :, g])
        y += (sx[:, g] * xq[:, g].sum(dim=-1))[:, None] * mn[None, :, g]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


_lib.impl("linear_int8", linear_int8_reference, "CompositeExplicitAutograd")
_lib.impl("linear_bf16", linear_bf16_reference, "CompositeExplicitAutograd")
_lib.impl("linear_fp32", linear_fp32_reference, "CompositeExplicitAutograd")
_lib.impl("linear_int4", linear_int4_reference, "CompositeExplicitAutograd")
_lib.impl("linear_fp8", linear_fp8_reference, "CompositeExplicitAutograd")
_lib.impl("linear_int8_a8", linear_int8_a8_reference, "CompositeExplicitAutograd")
_lib.impl("linear_int4_a8", linear_int4_a8_reference, "CompositeExplicitAutograd")
_lib.impl("linear_int4_rows16", linear_int4_rows16_reference, "CompositeExplicitAutograd")


def _out_fake(x, n):
    return x.new_empty((x.shape[0], n))


@torch.library.register_fake("kiln::linear_int8")
def _linear_int8_fake(x, qweight, scales, bias):
    return _out_fake(x, qweight.shape[0])


@torch.library.register_fake("kiln::linear_int4")
def _linear_int4_fake(x, qweight, scales, zeros, group_size, bias):
    torch._check(qweight.shape[1] * 2 == x.shape[1], lambda: "int4 qweight/x K mismatch")
    return _out_fake(x, qweight.shape[0])


@torch.library.register_fake("kiln::linear_fp8")
def _linear_fp8_fake(x, qweight, scales, bias):
    return _out_fake(x, qweight.shape[0])


@torch.library.register_fake("kiln::linear_int8_a8")
def _linear_int8_a8_fake(x, qweight, scales, bias):
    return _out_fake(x, qweight.shape[0])


@torch.library.register_fake("kiln::linear_int4_a8")
@torch.library.register_fake("kiln::linear_int4_rows16")
def _linear_int4_a8_fake(x, qweight, scales, mins, bias):
    torch._check(qweight.shape[1] * formats.INT4_A8_GROUP == x.shape[1],
                 lambda: "int4_a8 qweight/x K mismatch")
    return _out_fake(x, qweight.shape[0] * formats.INT4_A8_ROWS)


@torch.library.register_fake("kiln::linear_fp32")
def _linear_fp32_fake(x, weight, bias):
    return _out_fake(x, weight.shape[0])


@torch.library.register_fake("kiln::linear_bf16")
def _linear_bf16_fake(x, weight, bias):
    return _out_fake(x, weight.shape[0])


REFERENCES = {
    "int8": linear_int8_reference,
    "int4": linear_int4_reference,
    "fp8": linear_fp8_reference,
    "bf16": lambda x, qweight, scales, bias=None: linear_bf16_reference(x, qweight, bias),
    "fp32": lambda x, qweight, scales, bias=None: linear_fp32_reference(x, qweight, bias),
    "int4_a8": linear_int4_rows16_reference,     # with float activations (weight-only)
}


ACTIVATIONS = ("float", "int8")   # what a packed linear multiplies x as


def quant_linear(x: torch.Tensor, qw: formats.QuantizedWeight,
                 bias: Optional[torch.Tensor] = None, activations: str = "float"
                 ) -> torch.Tensor:
    """Calls the op for qw's scheme (the fastest kernel registered for x's device; on CUDA
    the Triton kernels of int8/int4/fp8, which AOTInductor compiles into the plan; cuBLAS
    for bf16).
    activations "int8" (CPU): W8A8 with int8 weights (x quantized per row at run time),
    W4A8 with int4_a8 weights (x quantized per group of 32); int4_a8 weights with float
    activations run kiln::linear_int4_rows16 (weight-only)."""
    if activations == "int8":
        if qw.scheme == "int4_a8":
            return torch.ops.kiln.linear_int4_a8(x, qw.qweight, qw.scales, qw.zeros, bias)
        if qw.scheme != "int8":
            raise ValueError(f"int8 activations need int8 or int4_a8 weights, not {qw.scheme}")
        return torch.ops.kiln.linear_int8_a8(x, qw.qweight, qw.scales, bias)
    if qw.scheme == "int4_a8":   # weight-only on the interleaved format (CPU plans)
        return torch.ops.kiln.linear_int4_rows16(x, qw.qweight, qw.scales, qw.zeros, bias)
    if x.device.type == "cuda":
        if qw.scheme == "fp32":
            return F.linear(x, qw.qweight, bias)
        if qw.scheme == "bf16":   # cuBLAS in x's dtype (float32 accumulation)
            return F.linear(x, qw.qweight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        from kiln.plugins.quant import triton_linear  # imports triton

        return triton_linear.quant_linear(x, qw, bias)
    if qw.scheme == "int8":
        return torch.ops.kiln.linear_int8(x, qw.qweight, qw.scales, bias)
    if qw.scheme == "fp8":
        return torch.ops.kiln.linear_fp8(x, qw.qweight, qw.scales, bias)
    if qw.scheme == "bf16":
        return torch.ops.kiln.linear_bf16(x, qw.qweight, bias)
    if qw.scheme == "fp32":
        return torch.ops.kiln.linear_fp32(x, qw.qweight, bias)
    return torch.ops.kiln.linear_int4(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, bias)
