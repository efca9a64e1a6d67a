"""The `kiln::paged_attention` custom op: schema, fake (for export) and pure-torch reference.

One call per layer handles a packed batch mixing prefill chunks and decode tokens:

    tokens (T) :  | seq 0 chunk (3) | seq 1 (1) | seq 2 chunk (4) |
    query_start_loc = [0, 3, 4, 8]
    context_lens[b] = tokens of seq b in the pool *after* this step
    position of token j of seq b = context_lens[b] - q_len[b] + j

The op writes k/v into their slots of the pool **in place** (the pool is listed in the
schema's mutated args, so AOTInductor calls it without copying the pool) and returns the
attention output. Token t attends to positions 0..pos(t) of its own sequence (causal inside
a chunk, everything before the chunk from the pool). GQA: head h reads kv head h // (H/KVH).

Options of a layer (0: off, the exact computation without them):
    window > 0   the token at position p attends to positions (p - window, p] only (`window`
                 keys, itself included; Mistral's and Gemma's local layers). The kernels start
                 each query tile at its first visible block and never read blocks before it.
    softcap > 0  scores (after `scale`) become softcap * tanh(scores / softcap), before the
                 causal/window mask and the softmax (Gemma 2).
The block pool keeps a windowed sequence's old blocks: they are freed with the sequence, not
when they fall out of the window (a global layer, prefix caching and preemption all still
see the whole block table, and a plan's layers share one table per sequence).

Pools of int8 or float8_e4m3fn hold quantized rows (codes + a per-token, per-kv-head scale;
plugins/paged_kv/kv_format.py): K/V are quantized when written and dequantized when read.

Kernels: the reference below is registered for CompositeExplicitAutograd (any device); a
compiled kernel registered for a backend key (CPU, CUDA) takes precedence when loaded.
"""
from __future__ import annotations

import torch

from kiln.plugins.paged_kv import kv_format

SCHEMA = (
    "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor slot_mapping, Tensor block_tables, Tensor context_lens, Tensor query_start_loc, "
    "float scale, int window=0, float softcap=0.0) -> Tensor"
)

_lib = torch.library.Library("kiln", "FRAGMENT")
_lib.define(SCHEMA)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V [T, KVH, D] into their flat slots of the pools, in place
    (quantized first when the pool is int8/fp8)."""
    bs = k_cache.shape[1]
    blocks, offsets = slot_mapping // bs, slot_mapping % bs   # pools may be permuted views
    for x, pool in ((k, k_cache), (v, v_cache)):
        rows = kv_format.encode(x, pool.dtype)
        if kv_format.is_quantized(pool.dtype):   # as bytes: no index_put_ for float8 on CPU
            pool, rows = pool.view(torch.uint8), rows.view(torch.uint8)
        pool.index_put_((blocks, offsets), rows)


def paged_attention_reference(q, k, v, k_cache, v_cache, slot_mapping, block_tables,
                              context_lens, query_start_loc, scale: float, window: int = 0,
                              softcap: float = 0.0) -> torch.Tensor:
    """Pure-torch paged attention (vectorized over sequences; pads queries per sequence).

    q [T, H, D]; k, v [T, KVH, D]; k_cache, v_cache [num_blocks, bs, KVH, D (+4 quantized)];
    slot_mapping [T]; block_tables [B, max_blocks]; context_lens [B]; query_start_loc [B+1].
    Returns [T, H, D] in q's dtype. Computes in float32.
    """
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    T, H, D = q.shape
    B = context_lens.shape[0]
    bs, KVH = k_cache.shape[1], k_cache.shape[2]
    G = H // KVH
    dev = q.device
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()          # [B]
    seq_ids = torch.repeat_interleave(torch.arange(B, device=dev), q_lens, output_size=T)
    tok_idx = torch.arange(T, device=dev) - query_start_loc[:-1].long()[seq_ids]
    max_q = int(q_lens.max())
    n_blocks = (int(context_lens.max()) + bs - 1) // bs
    ctx = n_blocks * bs
    bt = block_tables[:, :n_blocks].long()
    K = kv_format.decode(k_cache[bt]).reshape(B, ctx, KVH, D)             # [B, C, KVH, D]
    V = kv_format.decode(v_cache[bt]).reshape(B, ctx, KVH, D)
    Qp = q.new_zeros((B, max_q, H, D), dtype=torch.float32)
    Qp[seq_ids, tok_idx] = q.float()
    Qp = Qp.view(B, max_q, KVH, G, D)
    scores = torch.einsum("bqkgd,bckd->bkgqc", Qp, K) * scale              # [B, KVH, G, Q, C]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    first_pos = (context_lens.long() - q_lens)                             # [B]
    qpos = first_pos[:, None] + torch.arange(max_q, device=dev)[None, :]  # [B, Q]
    cpos = torch.arange(ctx, device=dev)
    allowed = cpos[None, None, :] <= qpos[:, :, None]                      # [B, Q, C]
    if window > 0:
        allowed &= cpos[None, None, :] > qpos[:, :, None] - window
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)                 # padded rows -> 0
    out = torch.einsum("bkgqc,bckd->bqkgd", probs, V)                      # [B, Q, KVH, G, D]
    out = out.reshape(B, max_q, H, D)[seq_ids, tok_idx]
    return out.to(q.dtype)


_lib.impl("paged_attention", paged_attention_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("kiln::paged_attention")
def _paged_attention_fake(q, k, v, k_cache, v_cache, slot_mapping, block_tables, context_lens,
                          query_start_loc, scale, window=0, softcap=0.0):
    return torch.empty_like(q)


def paged_attention(q, k, v, k_cache, v_cache, slot_mapping, block_tables, context_lens,
                    query_start_loc, scale: float, window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    """The op for q's device: on CUDA the Triton kernels (kiln::paged_attention_triton, which
    AOTInductor compiles into the plan), elsewhere kiln::paged_attention (the fastest kernel
    registered for the device). Chosen when the model is traced: devices are static.
    window > 0: each token attends to the last `window` positions (itself included);
    softcap > 0: scores (after `scale`) become softcap * tanh(scores / softcap)."""
    if window < 0 or softcap < 0:
        raise ValueError(f"paged_attention: window ({window}) and softcap ({softcap}) must be "
                         ">= 0 (0: off)")
    if q.device.type == "cuda":
        from kiln.plugins.paged_kv import triton_attention  # noqa: F401  (imports triton)

        op = torch.ops.kiln.paged_attention_triton
    else:
        op = torch.ops.kiln.paged_attention
    if not window and not softcap:   # the call (and the graph) of a plain layer, unchanged
        return op(q, k, v, k_cache, v_cache, slot_mapping, block_tables, context_lens,
                  query_start_loc, scale)
    return op(q, k, v, k_cache, v_cache, slot_mapping, block_tables, context_lens,
              query_start_loc, scale, int(window), float(softcap))
