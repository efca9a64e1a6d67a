"""The quantized linears as Triton kernels (NVIDIA GPUs), in plugins/quant/formats.py's layouts.

    kiln::linear_int8_triton(x, qweight int8 [N,K], scales [N], bias?)                -> [M, N]
    kiln::linear_int4_triton(x, qweight uint8 [N,K/2], scales [N,K/G], zeros [N,K/G], G, bias?)
    kiln::linear_fp8_triton (x, qweight float8_e4m3fn [N,K], scales [N], bias?)       -> [M, N]

Same arguments and results as kiln::linear_{int8,int4,fp8} (plugins/quant/ops.py): weight-only
quantization, the weights dequantized in registers, float32 accumulation, the output in x's
dtype. Registered with `torch.library.triton_op` and launched through `wrap_triton`, so
torch.export keeps each as one op and AOTInductor compiles its kernel into the package. With
`TRITON_INTERPRET=1` set before import they run on CPU tensors (the tests' way to check them
against the references without a GPU).

Tiles: BLOCK_M rows of x by BLOCK_N output channels, K walked BLOCK_K at a time. Tile sizes
depend only on the weight (static under torch.export), never on M (a dynamic dim).

int4, one BLOCK_K = group_size step (one scale and zero point per channel per step): the
packed bytes [BLOCK_N, BLOCK_K/2] hold, per 32-wide block s of the step, k = 32s + j in their
low nibbles and k = 32s + 16 + j in their high ones (j = byte % 16). Rather than interleave
nibbles, x is loaded twice in the matching order, and the step is two dots:

    acc += x[:, lo_k] @ deq(low nibbles).T + x[:, lo_k + 16] @ deq(high nibbles).T
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kiln.plugins.quant import formats
from kiln.plugins.triton_common import bf16_bits, dot_precision

X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_M = 16


@triton.jit
def _epilogue(acc, rm, rn, M, N, b_ptr, y_ptr, sym, HAS_BIAS: tl.constexpr,
              OUT_BF16: tl.constexpr):
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    off = rm.to(tl.int64)[:, None] * sym + rn[None, :]
    if OUT_BF16:   # round to nearest even, as torch's .to(bfloat16) (the interpreter truncates)
        tl.store(y_ptr.to(tl.pointer_type(tl.int16), bitcast=True) + off, bf16_bits(acc),
                 mask=mask)
    else:
        tl.store(y_ptr + off, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _linear_per_channel_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, sym,
                               HAS_BIAS: tl.constexpr, FP8: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                               OUT_BF16: tl.constexpr):
    """int8 or E4M3 codes [N, K] with one float32 scale per output channel:
    y = (x @ codes.T) * scales (+ bias); codes are exact in float32 and TF32."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * sxm + kk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w_mask = n_ok[:, None] & k_ok[None, :]
        w_off = rn.to(tl.int64)[:, None] * swn + kk[None, :]
        if FP8:    # read as bytes: masked lanes must be 0, not a NaN code
            w_raw = tl.load(w_ptr.to(tl.pointer_type(tl.uint8), bitcast=True) + w_off,
                            mask=w_mask, other=0)
            w = w_raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            w = tl.load(w_ptr + w_off, mask=w_mask, other=0).to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    acc = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    _epilogue(acc, rm, rn, M, N, b_ptr, y_ptr, sym, HAS_BIAS, OUT_BF16)


@triton.jit
def _linear_int4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, ssn,
                        sym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, OUT_BF16: tl.constexpr):
    """Packed int4 [N, K/2] (block layout of formats.py), per (channel, group) scale and zero:
    w = (q - zero) * scale, as formats.dequantize_int4 computes it."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.arange(0, GROUP // 2)                     # byte of the step
    lo_k = 32 * (c // 16) + c % 16                   # k of its low nibble (high: + 16)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * sxm
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * swn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, GROUP):
        g = k0 // GROUP
        s = tl.load(s_ptr + rn.to(tl.int64) * ssn + g, mask=n_ok, other=0.0)[:, None]
        z = tl.load(z_ptr + rn.to(tl.int64) * ssn + g, mask=n_ok, other=0.0)[:, None]
        packed = tl.load(w_rows + k0 // 2 + c[None, :], mask=n_ok[:, None], other=0)
        w_lo = ((packed & 0x0F).to(tl.float32) - z) * s
        w_hi = ((packed >> 4).to(tl.float32) - z) * s
        x_lo = tl.load(x_rows + k0 + lo_k[None, :], mask=m_ok[:, None], other=0.0)
        x_hi = tl.load(x_rows + k0 + 16 + lo_k[None, :], mask=m_ok[:, None], other=0.0)
        acc += tl.dot(x_lo.to(tl.float32), tl.trans(w_lo), input_precision=DOT_PRECISION)
        acc += tl.dot(x_hi.to(tl.float32), tl.trans(w_hi), input_precision=DOT_PRECISION)
    _epilogue(acc, rm, rn, M, N, b_ptr, y_ptr, sym, HAS_BIAS, OUT_BF16)


def _check(op: str, x, qweight, scales, k_of_qweight: int, bias) -> None:
    def need(ok, msg):
        if not ok:
            raise RuntimeError(f"kiln::{op}: {msg}")

    need(x.dim() == 2, f"x must be [M, K], got {tuple(x.shape)}")
    need(x.dtype in X_DTYPES, f"x must be float32, bfloat16 or float16, got {x.dtype}")
    need(x.shape[1] == k_of_qweight, f"x has K={x.shape[1]}, the weight K={k_of_qweight}")
    need(scales.dtype == torch.float32, "scales must be float32")
    need(bias is None or tuple(bias.shape) == (qweight.shape[0],),
         f"bias must be [N={qweight.shape[0]}]")


def _tiles_per_channel(n: int, k: int) -> tuple[int, int]:
    return (64 if n >= 64 else 32), (128 if k >= 128 else 32)


def _per_channel(op: str, x, qweight, scales, bias, fp8: bool) -> torch.Tensor:
    _check(op, x, qweight, scales, qweight.shape[1], bias)
    x, qweight, scales = x.contiguous(), qweight.contiguous(), scales.contiguous()
    M, K = x.shape
    N = qweight.shape[0]
    y = x.new_empty((M, N))
    if M == 0:
        return y
    block_n, block_k = _tiles_per_channel(N, K)
    b = bias.contiguous() if bias is not None else scales   # unread without HAS_BIAS
    wrap_triton(_linear_per_channel_kernel)[(triton.cdiv(M, BLOCK_M), triton.cdiv(N, block_n))](
        x, qweight, scales, b, y, M, N, K, x.stride(0), qweight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, FP8=fp8, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(x.dtype), OUT_BF16=x.dtype == torch.bfloat16)
    return y


@triton_op("kiln::linear_int8_triton", mutates_args=())
def linear_int8_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y = x @ (qweight * scales[:, None]).T + bias; int8 per output channel."""
    if qweight.dtype != torch.int8:
        raise RuntimeError(f"kiln::linear_int8_triton: qweight must be int8, got {qweight.dtype}")
    return _per_channel("linear_int8_triton", x, qweight, scales, bias, fp8=False)


@triton_op("kiln::linear_fp8_triton", mutates_args=())
def linear_fp8_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y = x @ (float(qweight) * scales[:, None]).T + bias; E4M3 per output channel."""
    if qweight.dtype != torch.float8_e4m3fn:
        raise RuntimeError("kiln::linear_fp8_triton: qweight must be float8_e4m3fn, got "
                           f"{qweight.dtype}")
    return _per_channel("linear_fp8_triton", x, qweight, scales, bias, fp8=True)


@triton_op("kiln::linear_int4_triton", mutates_args=())
def linear_int4_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       zeros: torch.Tensor, group_size: int,
                       bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y = x @ deq(qweight, scales, zeros).T + bias; int4 group-wise, formats.py's layout."""
    K = qweight.shape[1] * 2
    _check("linear_int4_triton", x, qweight, scales, K, bias)
    try:
        formats.check_group_size(K, group_size)
    except ValueError as e:
        raise RuntimeError(f"kiln::linear_int4_triton: {e}") from None
    if qweight.dtype != torch.uint8 or tuple(scales.shape) != (qweight.shape[0], K // group_size) \
            or zeros.shape != scales.shape:
        raise RuntimeError("kiln::linear_int4_triton: qweight must be uint8 [N, K/2], scales "
                           f"and zeros [N, K/{group_size}]")
    x, qweight = x.contiguous(), qweight.contiguous()
    scales, zeros = scales.contiguous(), zeros.contiguous().float()
    M, N = x.shape[0], qweight.shape[0]
    y = x.new_empty((M, N))
    if M == 0:
        return y
    block_n = 64 if N >= 64 else 32
    b = bias.contiguous() if bias is not None else scales
    wrap_triton(_linear_int4_kernel)[(triton.cdiv(M, BLOCK_M), triton.cdiv(N, block_n))](
        x, qweight, scales, zeros, b, y, M, N, K, x.stride(0), qweight.stride(0),
        scales.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, GROUP=group_size, DOT_PRECISION=dot_precision(x.dtype),
        OUT_BF16=x.dtype == torch.bfloat16)
    return y


OPS = {"int8": "linear_int8_triton", "int4": "linear_int4_triton", "fp8": "linear_fp8_triton"}


def quant_linear(x: torch.Tensor, qw: formats.QuantizedWeight,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The Triton op for qw's scheme (int8 | int4 | fp8)."""
    if qw.scheme == "int8":
        return torch.ops.kiln.linear_int8_triton(x, qw.qweight, qw.scales, bias)
    if qw.scheme == "fp8":
        return torch.ops.kiln.linear_fp8_triton(x, qw.qweight, qw.scales, bias)
    if qw.scheme == "int4":
        return torch.ops.kiln.linear_int4_triton(x, qw.qweight, qw.scales, qw.zeros,
                                                 qw.group_size, bias)
    raise ValueError(f"no Triton kernel for scheme {qw.scheme!r}; allowed: {', '.join(OPS)}")
