"""`kiln::paged_attention_triton`: the paged-attention op as Triton kernels (NVIDIA GPUs).

Same schema, semantics and pool formats as `kiln::paged_attention` (plugins/paged_kv/ops.py):
one call per layer writes the step's K/V into their slots of the pools **in place** and
attends, for a packed batch mixing prefill chunks and decode tokens (causal inside a chunk,
GQA, block tables), over fp32/bf16/fp16 pools or int8/fp8 rows of codes + a float32 scale
(plugins/paged_kv/kv_format.py), writing the same bytes as the reference.

It is registered with `torch.library.triton_op` and launches its kernels through
`wrap_triton`, so torch.export keeps it as one op with mutated pools and AOTInductor compiles
the kernels into the package (no Python at serving time). With `TRITON_INTERPRET=1` set
before this module is imported the kernels run on CPU tensors (Triton's interpreter): that is
how the tests check them against the reference on machines without a GPU.

Two kernels, launched in order on one stream:

    write  grid (T / 16, KVH)            quantize (if the pool is int8/fp8) and store the rows
                                         of 16 tokens
    attend grid (T // BLOCK_Q + B, KVH)  one tile of <= BLOCK_Q query tokens of one sequence x
                                         the G query heads of one kv head; online softmax over
                                         the sequence's context, BLOCK_N keys at a time, each
                                         key's block looked up in the block table; with a
                                         window, from the tile's first visible key

    program p of `attend` -> its sequence b: the last b with  qsl[b] // BLOCK_Q + b <= p
    (a binary search; these starts grow by >= 1 per sequence and leave each sequence at least
    ceil(q_len / BLOCK_Q) tiles, so T // BLOCK_Q + B programs always cover the batch).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kiln.plugins.paged_kv import kv_format
from kiln.plugins.triton_common import bf16_bits, dot_precision

OP = "kiln::paged_attention_triton"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
POOL_DTYPES = FLOAT_DTYPES + (torch.int8, torch.float8_e4m3fn)
_QUANT_CODE = {torch.int8: 1, torch.float8_e4m3fn: 2}     # 0: a float pool
BLOCK_N = 64          # keys per inner step (may span pool blocks: each key finds its own)
WRITE_BLOCK_T = 16    # tokens per program of the write kernel
ROWS = 64             # query rows per tile: BLOCK_Q tokens x G_PAD heads


@triton.jit
def _rne(x):
    """Round to nearest, ties to even (torch.round), exact in float32 arithmetic."""
    fl = tl.floor(x)
    frac = x - fl
    odd = (fl - 2.0 * tl.floor(fl * 0.5)) == 1.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, fl + 1.0, fl)


@triton.jit
def _e4m3_bits(y):
    """float32 y, |y| <= 448 -> float8_e4m3fn bit pattern (int32), round to nearest even.

    Done in integer/float arithmetic rather than a hardware convert so that every device
    (and the interpreter) writes torch's exact bytes:  value = r * ulp with
    ulp = 2**(max(e, -6) - 3);  code = ((max(e, -6) + 7) << 3) + r - 8  covers normals,
    subnormals (r < 8) and a round-up into the next binade (r == 16)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = _rne(tl.math.div_rn(a, ulp)).to(tl.int32)
    return (sign << 7) | (((e + 7) << 3) + r - 8)


@triton.jit
def _store_rows(x, cache_ptr, rows, t_mask, d, d_mask, D: tl.constexpr, QUANT: tl.constexpr,
                BF16_FROM_F32: tl.constexpr):
    """Store tokens' rows x [BLOCK_T, D_PAD] at element offsets rows [BLOCK_T] of a pool."""
    m = t_mask[:, None] & d_mask[None, :]
    off = rows[:, None] + d[None, :]
    if QUANT == 0:
        if BF16_FROM_F32:   # round to nearest even in integer arithmetic (see bf16_bits)
            bits_ptr = cache_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
            tl.store(bits_ptr + off, bf16_bits(x), mask=m)
        else:
            tl.store(cache_ptr + off, x.to(cache_ptr.dtype.element_ty), mask=m)
    else:
        xf = tl.where(m, x.to(tl.float32), 0.0)
        amax = tl.max(tl.abs(xf), axis=1)[:, None]
        if QUANT == 1:
            top = 127.0
        else:
            top = 448.0
        # top / amax as one division, then a multiply: the reference's exact roundings. GPU
        # code's `/` is an approximate division (2 ulp): div_rn rounds as IEEE and torch do
        safe = tl.where(amax > 0, amax, 1.0)
        inv = tl.where(amax > 0, tl.math.div_rn(tl.zeros_like(safe) + top, safe), 0.0)
        y = tl.minimum(tl.maximum(xf * inv, -top), top)
        if QUANT == 1:
            code = _rne(y).to(tl.int32)
        else:
            code = _e4m3_bits(y)
        byte_ptr = cache_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
        tl.store(byte_ptr + off, (code & 0xFF).to(tl.uint8), mask=m)
        scale_bits = tl.math.div_rn(amax, tl.zeros_like(amax) + top).to(tl.int32, bitcast=True)               # [BLOCK_T, 1]
        i4 = tl.arange(0, 4)[None, :]
        tl.store(byte_ptr + rows[:, None] + D + i4,
                 ((scale_bits >> (8 * i4)) & 0xFF).to(tl.uint8), mask=t_mask[:, None])


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, T,
                     sk_t, sk_h, sv_t, sv_h, sc_blk, sc_tok, sc_head,
                     D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
                     BLOCK_T: tl.constexpr, QUANT: tl.constexpr, BF16_FROM_F32: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    t_mask = t < T
    d = tl.arange(0, D_PAD)
    d_mask = d < D
    m = t_mask[:, None] & d_mask[None, :]
    slot = tl.load(slot_ptr + t, mask=t_mask, other=0).to(tl.int64)
    rows = slot // BS * sc_blk + slot % BS * sc_tok + h * sc_head
    t64 = t.to(tl.int64)[:, None]
    k = tl.load(k_ptr + t64 * sk_t + h * sk_h + d[None, :], mask=m, other=0.0)
    _store_rows(k, k_cache_ptr, rows, t_mask, d, d_mask, D, QUANT, BF16_FROM_F32)
    v = tl.load(v_ptr + t64 * sv_t + h * sv_h + d[None, :], mask=m, other=0.0)
    _store_rows(v, v_cache_ptr, rows, t_mask, d, d_mask, D, QUANT, BF16_FROM_F32)


@triton.jit
def _load_rows(cache_ptr, rows, n_valid, d, d_mask, D: tl.constexpr, QUANT: tl.constexpr):
    """Pool rows at element offsets rows [BLOCK_N] -> float32 [BLOCK_N, D_PAD] (0 if masked)."""
    m = n_valid[:, None] & d_mask[None, :]
    if QUANT == 2:   # E4M3 codes, read as bytes (masked lanes must be 0, not a NaN code)
        byte_ptr = cache_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
        raw = tl.load(byte_ptr + rows[:, None] + d[None, :], mask=m, other=0)
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        x = tl.load(cache_ptr + rows[:, None] + d[None, :], mask=m, other=0).to(tl.float32)
    if QUANT != 0:
        byte_ptr = cache_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
        i4 = tl.arange(0, 4)
        b = tl.load(byte_ptr + rows[:, None] + D + i4[None, :], mask=n_valid[:, None], other=0)
        bits = tl.sum(b.to(tl.int32) << (8 * i4)[None, :], axis=1)
        x = x * bits.to(tl.float32, bitcast=True)[:, None]
    return x


@triton.jit
def _softcap(s, cap):
    """cap * tanh(s / cap), tanh from exp (saturates to +-1 where exp overflows or vanishes)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * (s / cap)) + 1.0))


@triton.jit
def _attend_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, bt_ptr, ctx_ptr, qsl_ptr,
                   scale, window, softcap, B, sq_t, sq_h, so_t, so_h, sbt,
                   sc_blk, sc_tok, sc_head,
                   G: tl.constexpr, G_PAD: tl.constexpr,
                   D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
                   BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, OUT_BF16: tl.constexpr,
                   WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    lo = 0
    hi = B
    while lo < hi:                                  # the sequence this tile belongs to
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    b = lo - 1
    q_start = tl.load(qsl_ptr + b).to(tl.int32)
    q_len = tl.load(qsl_ptr + b + 1).to(tl.int32) - q_start
    tile = pid - (q_start // BLOCK_Q + b)
    if tile * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(ctx_ptr + b).to(tl.int32)

    r = tl.arange(0, BLOCK_Q * G_PAD)               # row = (token of the tile, head of group)
    tok = tile * BLOCK_Q + r // G_PAD
    g = r % G_PAD
    row_valid = (tok < q_len) & (g < G)
    qpos = ctx_len - q_len + tok                    # each row's position in its sequence
    d = tl.arange(0, D_PAD)
    d_mask = d < D
    head = kvh * G + g
    q_off = (q_start + tok).to(tl.int64) * sq_t + head * sq_h
    q = tl.load(q_ptr + q_off[:, None] + d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_Q * G_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)
    kv_end = ctx_len - q_len + tl.minimum((tile + 1) * BLOCK_Q, q_len)   # keys this tile sees
    if WINDOWED:   # keys before the first row's window: never read
        kv_start = tl.maximum(ctx_len - q_len + tile * BLOCK_Q - window + 1, 0)
    else:
        kv_start = 0
    for start in range(kv_start, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_valid = n < kv_end
        blk = tl.load(bt_ptr + b.to(tl.int64) * sbt + n // BS, mask=n_valid, other=0)
        rows = blk.to(tl.int64) * sc_blk + (n % BS) * sc_tok + kvh * sc_head
        kt = _load_rows(k_cache_ptr, rows, n_valid, d, d_mask, D, QUANT)
        vt = _load_rows(v_cache_ptr, rows, n_valid, d, d_mask, D, QUANT)
        # float32 scalars: AOTInductor passes Python floats as fp64, which would make s fp64
        s = tl.dot(q, tl.trans(kt), input_precision=DOT_PRECISION) * tl.cast(scale, tl.float32)
        if SOFTCAP:
            s = _softcap(s, tl.cast(softcap, tl.float32))
        allowed = (n[None, :] <= qpos[:, None]) & n_valid[None, :]
        if WINDOWED:
            allowed = allowed & (n[None, :] > qpos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (q_start + tok).to(tl.int64) * so_t + head * so_h
    o_mask = row_valid[:, None] & d_mask[None, :]
    if OUT_BF16:
        bits_ptr = out_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
        tl.store(bits_ptr + o_off[:, None] + d[None, :], bf16_bits(out), mask=o_mask)
    else:
        tl.store(out_ptr + o_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=o_mask)


def _check_inputs(q, k, v, k_cache, v_cache, slot_mapping, block_tables, context_lens,
                  query_start_loc) -> None:
    """The checks that need no device sync (shapes, dtypes, layouts); the CPU kernel also
    range-checks slots and block ids, which here would cost a sync per layer per step."""
    def need(ok, msg):
        if not ok:
            raise RuntimeError(f"kiln::paged_attention_triton: {msg}")

    need(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "q, k, v must be [T, heads, D]")
    T, H, D = q.shape
    need(k.shape == v.shape and k.shape[0] == T and k.shape[2] == D,
         f"k and v must be [T={T}, KVH, D={D}], got {tuple(k.shape)} and {tuple(v.shape)}")
    KVH = k.shape[1]
    need(H % KVH == 0, f"query heads ({H}) must be a multiple of kv heads ({KVH})")
    need(q.dtype in FLOAT_DTYPES, f"q must be float32, bfloat16 or float16, got {q.dtype}")
    need(k.dtype == q.dtype and v.dtype == q.dtype, "q, k and v must share a dtype")
    need(k_cache.dtype == v_cache.dtype and k_cache.shape == v_cache.shape,
         "k_cache and v_cache must have one dtype and shape")
    need(k_cache.dtype in POOL_DTYPES, f"pool dtype {k_cache.dtype}: allowed float32, "
         "bfloat16, float16, int8 or float8_e4m3fn")
    need(k_cache.dim() == 4 and k_cache.shape[2] == KVH,
         f"pools must be [num_blocks, tokens_per_block, KVH={KVH}, row], got "
         f"{tuple(k_cache.shape)}")
    width = kv_format.row_width(kv_format.name_of(k_cache.dtype), D)
    need(k_cache.shape[3] == width, f"pool rows must be {width} wide for head_dim {D} "
         f"({'D codes + 4 scale bytes' if width != D else 'D values'}), got {k_cache.shape[3]}")
    need(k_cache.stride() == v_cache.stride() and kv_format.dense_rows(k_cache),
         "pools must be dense with rows of stride 1 and one set of strides, got "
         f"{k_cache.stride()} and {v_cache.stride()}")
    for name, t in (("slot_mapping", slot_mapping), ("block_tables", block_tables),
                    ("context_lens", context_lens), ("query_start_loc", query_start_loc)):
        need(t.dtype in (torch.int32, torch.int64), f"{name} must be int32 or int64")
    need(block_tables.dim() == 2 and query_start_loc.shape[0] == context_lens.shape[0] + 1,
         "query_start_loc must be [B+1] for context_lens [B]")
    need(slot_mapping.shape[0] == T, f"slot_mapping must be [T={T}]")


def _inner(x: torch.Tensor) -> torch.Tensor:
    """x with a unit stride on its last dim (views of a fused qkv projection already are)."""
    return x if x.stride(-1) == 1 else x.contiguous()


@triton_op(OP, mutates_args={"k_cache", "v_cache"})
def paged_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Writes k, v into the pools at slot_mapping and returns attention [T, H, D] (q's dtype);
    arguments as kiln::paged_attention."""
    if window < 0 or softcap < 0:
        raise RuntimeError(f"{OP}: window ({window}) and softcap ({softcap}) must be >= 0")
    _check_inputs(q, k, v, k_cache, v_cache, slot_mapping, block_tables, context_lens,
                  query_start_loc)
    q, k, v = _inner(q), _inner(k), _inner(v)
    slot_mapping, query_start_loc = slot_mapping.contiguous(), query_start_loc.contiguous()
    context_lens, block_tables = context_lens.contiguous(), _inner(block_tables)
    T, H, D = q.shape
    KVH = k.shape[1]
    G = H // KVH
    G_PAD = triton.next_power_of_2(G)
    D_PAD = max(16, triton.next_power_of_2(D))
    BS = k_cache.shape[1]
    cache_strides = k_cache.stride()[:3]   # block, token, kv head (kv_format.new_pools)
    quant = _QUANT_CODE.get(k_cache.dtype, 0)
    B = context_lens.shape[0]
    out = q.new_empty((T, H, D))

    wrap_triton(_write_kv_kernel)[(triton.cdiv(T, WRITE_BLOCK_T), KVH)](
        k, v, k_cache, v_cache, slot_mapping, T, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), *cache_strides, D=D, D_PAD=D_PAD, BS=BS, BLOCK_T=WRITE_BLOCK_T,
        QUANT=quant,
        BF16_FROM_F32=k.dtype == torch.float32 and k_cache.dtype == torch.bfloat16)
    block_q = max(1, ROWS // G_PAD)
    wrap_triton(_attend_kernel)[(T // block_q + B, KVH)](
        q, k_cache, v_cache, out, block_tables, context_lens, query_start_loc,
        scale, window, softcap, B, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), *cache_strides,
        G=G, G_PAD=G_PAD, D=D, D_PAD=D_PAD, BS=BS, BLOCK_Q=block_q,
        BLOCK_N=BLOCK_N, QUANT=quant, DOT_PRECISION=dot_precision(q.dtype),
        OUT_BF16=q.dtype == torch.bfloat16, WINDOWED=window > 0, SOFTCAP=softcap > 0,
        num_warps=8 if D_PAD >= 128 else 4)
    return out
