"""Weight formats of the `quant` plugin: quantize / dequantize per scheme, pure torch.

Every scheme is weight-only: activations stay float32 (or bf16) and the kernels dequantize
weights in registers. A weight is nn.Linear's [N, K] (N outputs, K inputs); `w ≈ deq(...)`.

int8  symmetric, per output channel
      qweight int8 [N, K];  scales float32 [N]
      w[n, k] = qweight[n, k] * scales[n],   scales = absmax(row) / 127,  q in [-127, 127]
      error bound: |w - deq| <= scales[n] / 2

int4  asymmetric, group-wise along K (group_size 32, 64 or 128; K % group_size == 0)
      qweight uint8 [N, K // 2];  scales float32 [N, K // G];  zeros float32 [N, K // G]
      w[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g],   g = k // G,  q in 0..15
      scales = (max - min) / 15 of the group, zeros = -min / scales (a float zero point, not
      rounded to an integer): w = q * scales + min, llama.cpp's Q4_1 arithmetic, so a Q4_1
      GGUF's weights (group 32) come back exactly. A constant group (max == min) gets scale 1
      and q = 0, so it is exact too. error bound: |w - deq| <= scales[n, g] / 2

      Packed layout, chosen for the AVX2 unpack (one 16-byte load -> 32 weights):
      K is cut in blocks of 32; block b of row n is 16 bytes, byte j (0..15) holding
      q[32b + j] in its low nibble and q[32b + 16 + j] in its high nibble:

          byte:      0        1      ...     15
          low  :   q[0]     q[1]     ...   q[15]      (x & 0x0F)
          high :   q[16]    q[17]    ...   q[31]      (x >> 4)

fp8   E4M3 (float8_e4m3fn), per output channel scale
      qweight float8_e4m3fn [N, K];  scales float32 [N]
      w[n, k] = float(qweight[n, k]) * scales[n],   scales = absmax(row) / 448
      error bound: |w - deq| <= max(|w| * 2**-4, scales[n] * 2**-10)
      (3 mantissa bits: half an ulp is 2**-4 relative; subnormal step is 2**-9 * scale)

int4_a8  int4 for the integer kernels: asymmetric, groups of 32 along K with a float
      minimum (llama.cpp's Q4_1 arithmetic, so a Q4_1 GGUF's weights are stored exactly),
      rows interleaved 16 at a time for integer dot products. Multiplied with int8
      activations (W4A8, kiln::linear_int4_a8) or, as a CPU plan's int4 weight-only format
      at group 32, with float activations (kiln::linear_int4_rows16).
      qweight uint8 [N/16, K/32, 256];  scales float16 [N/16, K/32, 16];  zeros float16
      [N/16, K/32, 16] (the groups' minimums, not zero points)
      w[n, k] = q[n, k] * scales[n/16, k/32, n%16] + zeros[n/16, k/32, n%16],  q in 0..15
      scales = (max - min) / 15 of the group, zeros = min (both rounded to float16 first;
      q is rounded against the stored values). error bound: |w - deq| <= scales / 2, plus
      the float16 roundings: scales * 2**-5 + |w| * 2**-10 + 2**-20 (underflow)

      Packed layout: block (rb, g) holds rows 16rb..16rb+15, k in 32g..32g+31, as four
      64-byte chunks c; byte 64c + 4r + j holds q[row r, k = 8c + j] in its low nibble and
      q[row r, k = 8c + 4 + j] in its high nibble (j = 0..3). One chunk's low (high) nibbles
      are 16 rows x 4 consecutive k: the unsigned operand of one vpdpbusd against four
      activation codes broadcast to every row.

bf16  bfloat16 weights, no scale (a bf16 plan: weight-only, activations stay float32)
      qweight bfloat16 [N, K];  scales None
      w[n, k] = float(qweight[n, k])
      error bound: |w - deq| <= max(|w| * 2**-8, 2**-134)   (7 mantissa bits, round to
      nearest even; the second term: bf16 subnormals)

fp32  float32 weights as they are (qweight float32 [N, K], scales None): the linear runs the
      plugin's streaming GEMV at small M instead of BLAS. error bound: 0

All-zero rows get a scale of tiny (finfo.tiny) / qmax so nothing divides by zero.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_BLOCK = 32                   # weights per 16-byte packed block (see layout above)
GROUP_SIZES = (32, 64, 128)
FP8_MAX = 448.0                   # largest finite float8_e4m3fn
SCHEMES = ("int8", "int4", "fp8", "bf16", "int4_a8", "fp32")
INT4_A8_ROWS = 16                 # weight rows per interleaved block (16 int32 lanes)
INT4_A8_GROUP = 32                # weights per scale/min, and activations per scale
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantized [N, K] weight: the op's tensor arguments, in the op's order."""
    scheme: str                   # int8 | int4 | fp8 | bf16 | int4_a8 | fp32
    qweight: torch.Tensor
    scales: torch.Tensor | None   # None for bf16 and fp32
    zeros: torch.Tensor | None    # int4: zero points; int4_a8: group minimums; else None
    group_size: int | None        # int4 / int4_a8 only
    shape: tuple[int, int]        # (N, K) of the float weight


def check_group_size(k: int, group_size: int) -> None:
    """Raises ValueError naming group_size unless it is allowed and divides K."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise ValueError(f"int4 group_size {group_size} does not divide the weight's input "
                         f"dim K={k}; choose a group_size in {GROUP_SIZES} dividing {k}")


# ---------------------------------------------------------------- int8

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (qweight int8 [N, K], scales float32 [N])."""
    w = w.detach().float()
    absmax = w.abs().amax(dim=1).clamp_min(_TINY)
    scales = absmax / 127.0
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return qweight.float() * scales.float()[:, None]


# ---------------------------------------------------------------- int4

def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integer values 0..15 (K % 32 == 0) -> uint8 [N, K // 2] in the block layout."""
    n, k = q.shape
    if k % INT4_BLOCK:
        raise ValueError(f"int4 packing needs K % {INT4_BLOCK} == 0, got K={k}")
    blocks = q.to(torch.uint8).reshape(n, k // INT4_BLOCK, 2, INT4_BLOCK // 2)
    packed = blocks[:, :, 0, :] | (blocks[:, :, 1, :] << 4)          # [N, K/32, 16]
    return packed.reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] block layout -> uint8 [N, K] values 0..15."""
    n, kh = packed.shape
    blocks = packed.reshape(n, kh // (INT4_BLOCK // 2), INT4_BLOCK // 2)
    lo, hi = blocks & 0x0F, blocks >> 4
    return torch.stack((lo, hi), dim=2).reshape(n, kh * 2)


def quantize_int4(w: torch.Tensor, group_size: int = 128
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (qweight uint8 [N, K/2], scales [N, K/G], zeros [N, K/G]); RTN."""
    n, k = w.shape
    check_group_size(k, group_size)
    g = w.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scales = (hi - lo) / 15.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))   # constant groups
    zeros = -lo / scales
    q = torch.round((g - lo[..., None]) / scales[..., None]).clamp_(0, 15)
    return pack_int4(q.reshape(n, k)), scales.contiguous(), zeros.contiguous()


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    q = unpack_int4(qweight).float()
    n, k = q.shape
    check_group_size(k, group_size)
    g = q.reshape(n, k // group_size, group_size)
    return ((g - zeros.float()[..., None]) * scales.float()[..., None]).reshape(n, k)


# ---------------------------------------------------------------- int4_a8 (W4A8)

def _int4_a8_shape_ok(n: int, k: int) -> bool:
    return n % INT4_A8_ROWS == 0 and k % INT4_A8_GROUP == 0


def check_int4_a8_shape(n: int, k: int) -> None:
    """Raises ValueError unless [N, K] fits the interleaved layout."""
    if not _int4_a8_shape_ok(n, k):
        raise ValueError(f"int4 weights with int8 activations need N % {INT4_A8_ROWS} == 0 "
                         f"and K % {INT4_A8_GROUP} == 0, got [N, K] = [{n}, {k}]")


def fits_int4_a8(w: torch.Tensor) -> bool:
    """Whether an [N, K] weight can take this format (shape, and float16 scales and minimums)."""
    w = w.detach()          # max and -min: no |w| copy of the whole weight
    return (_int4_a8_shape_ok(*w.shape)
            and max(w.max().item(), -w.min().item()) <= torch.finfo(torch.float16).max)


def pack_int4_a8(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integer values 0..15 -> uint8 [N/16, K/32, 256] (layout above)."""
    n, k = q.shape
    check_int4_a8_shape(n, k)
    g = k // INT4_A8_GROUP
    # [rb, r, g, c, h, j] -> [rb, g, c, r, j, h]
    t = q.to(torch.uint8).reshape(n // 16, 16, g, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    return (t[..., 0] | (t[..., 1] << 4)).reshape(n // 16, g, 256).contiguous()


def unpack_int4_a8(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N/16, K/32, 256] -> uint8 [N, K] values 0..15."""
    nb, g, _ = packed.shape
    t = packed.reshape(nb, g, 4, 16, 4)                                # [rb, g, c, r, j]
    t = torch.stack((t & 0x0F, t >> 4), dim=-1)                        # [rb, g, c, r, j, h]
    return t.permute(0, 3, 1, 2, 5, 4).reshape(nb * 16, g * 32)


def quantize_int4_a8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (qweight uint8 [N/16, K/32, 256], scales f16, mins f16 [N/16, K/32, 16])."""
    n, k = w.shape
    check_int4_a8_shape(n, k)
    g = w.detach().float().reshape(n, k // INT4_A8_GROUP, INT4_A8_GROUP)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    f16 = torch.finfo(torch.float16)
    if lo.min() < -f16.max or hi.max() > f16.max:
        raise ValueError(f"int4 with int8 activations stores float16 scales: a weight of "
                         f"magnitude {max(-lo.min().item(), hi.max().item()):.3g} exceeds "
                         f"{f16.max}")
    mins = lo.half()
    scales = ((hi - mins.float()) / 15.0).half()
    s = scales.float()[..., None]
    q = torch.where(s > 0, torch.round((g - mins.float()[..., None]) / s.clamp_min(_TINY)),
                    torch.zeros_like(g)).clamp_(0, 15)

    def rows16(t):   # [N, G] -> [N/16, G, 16]
        return t.reshape(n // 16, 16, -1).transpose(1, 2).contiguous()

    return pack_int4_a8(q.reshape(n, k)), rows16(scales), rows16(mins)


def dequantize_int4_a8(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
                       ) -> torch.Tensor:
    q = unpack_int4_a8(qweight).float()
    n, k = q.shape

    def per_weight(t):   # [N/16, G, 16] -> [N, K]
        return t.float().transpose(1, 2).reshape(n, -1).repeat_interleave(INT4_A8_GROUP, dim=1)

    return q * per_weight(scales) + per_weight(mins)


# ---------------------------------------------------------------- fp8 (E4M3)

def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (qweight float8_e4m3fn [N, K], scales float32 [N])."""
    w = w.detach().float()
    absmax = w.abs().amax(dim=1).clamp_min(_TINY)
    scales = absmax / FP8_MAX
    q = (w / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scales.contiguous()


def dequantize_fp8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return qweight.float() * scales.float()[:, None]


# ---------------------------------------------------------------- per scheme

QUANTIZE_ROWS = 8192     # rows quantized at a time (a multiple of INT4_A8_ROWS)


def quantize(w: torch.Tensor, scheme: str, group_size: int | None = None) -> QuantizedWeight:
    """Quantize one [N, K] weight with `scheme` (int8 | int4 | fp8 | bf16 | int4_a8 | fp32).

    A weight of more than QUANTIZE_ROWS rows is quantized that many rows at a time: every
    format's groups and scales lie within a row (int4_a8's interleaved blocks within 16
    rows), so the result is the same, without whole-weight float temporaries (an 8B model's
    untied lm_head, 128K x 4096: 2 GB each, several at once). A bf16 weight (a streamed
    build keeps the checkpoint's bf16) is widened to float32 a block of rows at a time:
    exactly, so the result is the same."""
    n = int(w.shape[0])
    if scheme in ("fp32", "bf16"):
        return _quantize(w, scheme, group_size)
    if n <= QUANTIZE_ROWS:
        return _quantize(w.float(), scheme, group_size)
    if scheme == "int4_a8":
        check_int4_a8_shape(n, int(w.shape[1]))
    parts = [_quantize(w[i:i + QUANTIZE_ROWS].float(), scheme, group_size)
             for i in range(0, n, QUANTIZE_ROWS)]

    def cat(field: str):
        ts = [getattr(p, field) for p in parts]
        return None if ts[0] is None else torch.cat(ts)
    return QuantizedWeight(scheme, cat("qweight"), cat("scales"), cat("zeros"),
                           parts[0].group_size, (n, int(w.shape[1])))


def _quantize(w: torch.Tensor, scheme: str, group_size: int | None) -> QuantizedWeight:
    shape = (int(w.shape[0]), int(w.shape[1]))
    if scheme == "fp32":
        return QuantizedWeight("fp32", w.detach().float().contiguous(), None, None, None, shape)
    if scheme == "bf16":
        return QuantizedWeight("bf16", w.detach().to(torch.bfloat16).contiguous(), None, None,
                               None, shape)
    if scheme == "int8":
        q, s = quantize_int8(w)
        return QuantizedWeight("int8", q, s, None, None, shape)
    if scheme == "fp8":
        q, s = quantize_fp8(w)
        return QuantizedWeight("fp8", q, s, None, None, shape)
    if scheme == "int4_a8":
        if group_size not in (None, INT4_A8_GROUP):
            raise ValueError(f"int4 with int8 activations has group_size {INT4_A8_GROUP}, "
                             f"got {group_size}")
        q, s, z = quantize_int4_a8(w)
        return QuantizedWeight("int4_a8", q, s, z, INT4_A8_GROUP, shape)
    if scheme == "int4":
        gs = 128 if group_size is None else group_size
        q, s, z = quantize_int4(w, gs)
        return QuantizedWeight("int4", q, s, z, gs, shape)
    raise ValueError(f"unknown quantization scheme {scheme!r}; allowed: {', '.join(SCHEMES)}")


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The float32 [N, K] weight a QuantizedWeight stands for."""
    if qw.scheme == "int8":
        return dequantize_int8(qw.qweight, qw.scales)
    if qw.scheme in ("bf16", "fp32"):
        return qw.qweight.float()
    if qw.scheme == "fp8":
        return dequantize_fp8(qw.qweight, qw.scales)
    if qw.scheme == "int4_a8":
        return dequantize_int4_a8(qw.qweight, qw.scales, qw.zeros)
    return dequantize_int4(qw.qweight, qw.scales, qw.zeros, qw.group_size)


def error_bound(w: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """Per-element bound on |w - dequantize(qw)| that the scheme guarantees (see top)."""
    n, k = qw.shape
    # + two float32 roundings of |w| (the division by the scale and the dequantizing product):
    # on an AVX-512 host, one-sided rows (|w| in [1, 5]) exceeded scale/2 alone by 1e-8.
    rounding = w.float().abs() * 2.0 ** -22
    if qw.scheme == "int8":
        return qw.scales[:, None] / 2 + rounding
    if qw.scheme == "int4_a8":   # + float16 roundings of scale and minimum, and underflow
        d = qw.scales.float().transpose(1, 2).reshape(n, -1).repeat_interleave(INT4_A8_GROUP, 1)
        return d * (0.5 + 2.0 ** -5) + w.float().abs() * 2.0 ** -10 + 2.0 ** -20
    if qw.scheme == "int4":
        return (qw.scales / 2).repeat_interleave(qw.group_size, dim=1) + rounding
    if qw.scheme == "fp32":
        return torch.zeros_like(w.float())
    if qw.scheme == "bf16":   # half an ulp; bf16 subnormals step by 2**-133
        return torch.maximum(w.float().abs() * 2.0 ** -8, torch.full_like(w.float(), 2.0 ** -134))
    return torch.maximum(w.float().abs() * 2.0 ** -4, qw.scales[:, None] * 2.0 ** -10)
