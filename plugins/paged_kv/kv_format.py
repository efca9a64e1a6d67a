"""How a KV pool stores one token's K (or V) row of one kv head, per `kv_cache` dtype.

    fp32 / bf16 / fp16   D values of that dtype.
    int8 / fp8 (E4M3)    D one-byte codes, then the row's float32 scale (4 bytes, native
                         byte order): written when the token's K/V is stored, per token and
                         kv head, scale = max|x| / QMAX and code = round(x / scale)
                         (QMAX 127 for int8, 448 for E4M3); read back as code * scale.

So a layer's pool is [num_blocks, tokens_per_block, kv_heads, row_width] of the storage dtype
(row_width = D, or D + 4 when quantized), stored kv head by kv head within each block
(new_pools: a [num_blocks, kv_heads, tokens_per_block, row_width] tensor seen through a
permuted view), so the rows one attention work item reads from a block lie together; the
ops take any such order of the first three dims from the pools' strides. A quantized pool
holds about 4x (vs fp32) or 2x (vs bf16) the tokens of a float pool in the same bytes. The
paged-attention op reads the format from the pool's dtype (int8 or float8_e4m3fn means codes
+ scale); its reference (plugins/paged_kv/ops.py) and its CPU kernel implement the same
rounding, so they write the same bytes.
"""
from __future__ import annotations

import torch

from kiln.contracts.manifest import POOL_ORDERS

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "fp8": 1}
QUANTIZED = ("int8", "fp8")
SCALE_BYTES = 4


def _check(name: str) -> str:
    if name not in ELEMENT_BYTES:
        raise ValueError(f"unknown kv_cache dtype {name!r}; allowed: {', '.join(ELEMENT_BYTES)}")
    return name


def row_width(name: str, head_dim: int) -> int:
    """Elements (of the storage dtype) of one token's row of one kv head."""
    return head_dim + SCALE_BYTES if _check(name) in QUANTIZED else head_dim


def bytes_per_token(name: str, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """K and V bytes one token takes in the pools, over all layers (scales included)."""
    return 2 * num_layers * num_kv_heads * row_width(name, head_dim) * ELEMENT_BYTES[name]


_STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
            "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def storage_dtype(name: str):
    """The torch dtype of a pool of this kv_cache dtype."""
    return _STORAGE[_check(name)]


def name_of(dtype) -> str:
    """The kv_cache name of a pool dtype (torch.float32 -> "fp32")."""
    for name, dt in _STORAGE.items():
        if dt == dtype:
            return name
    raise ValueError(f"no kv_cache dtype stores {dtype}")


def qmax(dtype) -> float | None:
    """Largest code of a quantized pool dtype (int8 127, E4M3 448); None for float pools."""
    return {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}.get(dtype)


def is_quantized(dtype) -> bool:
    return qmax(dtype) is not None


def pool_shape(name: str, num_blocks: int, tokens_per_block: int, num_kv_heads: int,
               head_dim: int) -> tuple[int, int, int, int]:
    return (num_blocks, tokens_per_block, num_kv_heads, row_width(name, head_dim))


# The order new plans' pools store [block, token, kv head] in (the manifest's
# kv_cache.pool_order; plans that predate it were captured on "block_token_head").
POOL_ORDER = "block_head_token"
# Each order as the permutation from pool_shape's dims to the stored ones (its own inverse).
_STORED_DIMS = {"block_token_head": (0, 1, 2, 3), "block_head_token": (0, 2, 1, 3)}


def _stored_dims(order: str) -> tuple[int, ...]:
    if order not in _STORED_DIMS:
        raise ValueError(f"unknown KV pool order {order!r}; allowed: {', '.join(POOL_ORDERS)}")
    return _STORED_DIMS[order]


def new_pools(name: str, num_layers: int, num_blocks: int, tokens_per_block: int,
              num_kv_heads: int, head_dim: int, device="cpu", order: str = POOL_ORDER):
    """Zeroed (k_caches, v_caches): one pool per layer for K and for V, each of pool_shape,
    with every kv head's rows of a block together (see the module's docstring), or stored in
    that shape's own order with order="block_token_head" (a plan built before the heads-apart
    order).

    A decode step reads every sequence's whole context from memory, block by scattered
    block, one kv head at a time: with the heads apart, what one head reads of a block is
    one run of bytes (with 64-token blocks, 64 rows), not rows strided by the other heads'
    (docs/JOURNAL.md has the measurements)."""
    shape = pool_shape(name, num_blocks, tokens_per_block, num_kv_heads, head_dim)
    dims = _stored_dims(order)
    stored = tuple(shape[d] for d in dims)
    dt = storage_dtype(name)

    def pool():
        return torch.zeros(stored, dtype=dt, device=device).permute(dims)
    return [pool() for _ in range(num_layers)], [pool() for _ in range(num_layers)]


def in_pool_layout(x, order: str = POOL_ORDER):
    """A copy of x [num_blocks, tokens_per_block, kv_heads, row] stored in `order` as
    new_pools stores its pools; same shape and values."""
    dims = _stored_dims(order)
    return x.permute(dims).contiguous().permute(dims)


def dense_rows(pool) -> bool:
    """True when pool's elements fill its storage once, rows at stride 1, in some order of its
    first three dims (what the paged-attention kernels address through the strides)."""
    order = sorted(range(3), key=lambda d: -pool.stride(d))
    return pool.stride(3) == 1 and pool.permute(*order, 3).is_contiguous()


def encode(x, dtype):
    """Rows x [..., D] as pool rows of `dtype` ([..., D] float, or [..., D + 4] codes+scale)."""
    top = qmax(dtype)
    if top is None:
        return x.to(dtype)
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # qmax / amax as one division (a float / tensor would be reciprocal-then-multiply: two
    # roundings), so the CPU kernel's codes match these bit for bit
    inv = torch.where(amax > 0, torch.full_like(amax, top) / amax, torch.zeros_like(amax))
    y = xf * inv
    if dtype == torch.int8:
        codes = torch.round(y).clamp_(-top, top).to(torch.int8).view(torch.uint8)
    else:
        codes = y.clamp_(-top, top).to(dtype).view(torch.uint8)
    # a tensor divisor: CUDA divides by a Python number as a multiply by its reciprocal,
    # which can miss the CPU's and the kernels' scale by one bit
    scale = (amax / torch.full_like(amax, top)).contiguous().view(torch.uint8)   # [..., 4]
    return torch.cat([codes, scale], dim=-1).view(dtype)


def decode(rows):
    """Pool rows [..., row_width] -> float32 [..., D]."""
    if not is_quantized(rows.dtype):
        return rows.float()
    D = rows.shape[-1] - SCALE_BYTES
    raw = rows.view(torch.uint8)
    scale = raw[..., D:].contiguous().view(torch.float32)                 # [..., 1]
    return rows[..., :D].float() * scale
