"""Shared test helpers: a tiny greedy generator over LlamaModel with paged KV caches, and the
batches, shapes and reference checks the kernels are tested on (CPU, Triton, CUDA tiers).

The generator drives the packed engine step the way the runtime does: all prompts are
prefilled together in one step (packed along T), then every sequence decodes one token per
step. Blocks are handed out contiguously or shuffled (to catch block-table bugs).
"""
from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from kiln.builder.arch.llama import LlamaModel


@dataclass
class Generated:
    tokens: list[list[int]]                 # new tokens per prompt (stopped at eos if given)
    prefill_logits: torch.Tensor            # [B, vocab] logits at each prompt's last position
    step_logits: list[list[torch.Tensor]] = field(default_factory=list)  # per seq, per new token


def load_package(package) -> Callable:
    """An AOTInductor package, loaded the way the runtime loads a plan's engine: unpacked into
    a private directory that is removed once loaded (torch's aoti_load_package leaves its
    unpacked copy in /tmp whenever its loader is not collected)."""
    import tempfile

    from kiln.runtime.plan import load_aoti_package

    with tempfile.TemporaryDirectory(prefix="kiln-test-") as scratch:
        return load_aoti_package(Path(package), Path(scratch))


def greedy_generate(model: LlamaModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    tokens_per_block: int = 4, shuffle_blocks: bool = False, seed: int = 0,
                    eos_ids: Optional[Sequence[int]] = None) -> Generated:
    """Greedy decoding of `prompts` (lists of ids) through paged caches; eager mode."""
    cfg = model.cfg
    B = len(prompts)
    bs = tokens_per_block
    max_len = max(len(p) for p in prompts) + max_new_tokens
    per_seq = -(-max_len // bs)
    num_blocks = B * per_seq + 1                       # block 0 unused: catches off-by-ones
    ids = list(range(1, num_blocks))
    if shuffle_blocks:
        random.Random(seed).shuffle(ids)
    block_tables = torch.tensor([ids[b * per_seq:(b + 1) * per_seq] for b in range(B)])
    dtype = next(model.parameters()).dtype
    shape = (num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    k_caches = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
    v_caches = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]

    seqs = [list(p) for p in prompts]
    new: list[list[int]] = [[] for _ in range(B)]
    logits_hist: list[list[torch.Tensor]] = [[] for _ in range(B)]
    computed = [0] * B                                 # tokens already in the KV pool
    active = list(range(B))
    prefill_logits = None
    with torch.no_grad():
        while active:
            input_ids, positions, slots, qsl = [], [], [], [0]
            for b in active:
                chunk = range(computed[b], len(seqs[b]))
                input_ids += [seqs[b][p] for p in chunk]
                positions += list(chunk)
                slots += [int(block_tables[b, p // bs]) * bs + p % bs for p in chunk]
                qsl.append(qsl[-1] + len(chunk))
            logits = model(torch.tensor(input_ids), torch.tensor(positions),
                           torch.tensor(slots), block_tables[active],
                           torch.tensor([len(seqs[b]) for b in active]),
                           torch.tensor(qsl), torch.tensor(qsl[1:]) - 1, k_caches, v_caches)
            if prefill_logits is None:
                prefill_logits = logits.clone()
            still = []
            for row, b in enumerate(active):
                computed[b] = len(seqs[b])
                tok = int(logits[row].argmax())
                seqs[b].append(tok)
                new[b].append(tok)
                logits_hist[b].append(logits[row].clone())
                done = len(new[b]) >= max_new_tokens or (eos_ids and tok in eos_ids)
                if not done:
                    still.append(b)
            active = still
    return Generated(new, prefill_logits, logits_hist)


# ---- paged attention: packed batches and the kernel-vs-reference check ---------------------
# (the CPU kernel in tests/model/test_paged_attention.py, the Triton kernel in tests/interpret
# and tests/gpu: the same batches and shapes)

@dataclass
class Batch:
    q: torch.Tensor             # [T, H, D]
    k: torch.Tensor             # [T, KVH, D]
    v: torch.Tensor
    k_cache: torch.Tensor       # [num_blocks, bs, KVH, D]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [B, max_blocks]
    context_lens: torch.Tensor  # [B]
    query_start_loc: torch.Tensor  # [B+1]
    scale: float
    window: int = 0             # the layer's sliding window (0: the whole context)
    softcap: float = 0.0        # score soft-capping (0: off)

    def args(self, k_cache=None, v_cache=None):
        return (self.q, self.k, self.v,
                self.k_cache if k_cache is None else k_cache,
                self.v_cache if v_cache is None else v_cache,
                self.slot_mapping, self.block_tables, self.context_lens, self.query_start_loc,
                self.scale, self.window, self.softcap)


def make_batch(seqs, H, KVH, D, bs, dtype=torch.float32, cache_dtype=torch.float32,
               max_seq_len=2048, seed=0, pool_layout=True) -> Batch:
    """seqs: [(tokens already in the pool, tokens this step)]; blocks shuffled over the pool,
    laid out as the runtime's pools (kv_format.new_pools), or plain contiguous tensors with
    pool_layout=False (the ops take both)."""
    from kiln.plugins.paged_kv import kv_format

    g = torch.Generator().manual_seed(seed)
    max_blocks = math.ceil(max_seq_len / bs)
    need = [math.ceil((c + n) / bs) for c, n in seqs]
    num_blocks = sum(need) + 5  # spare blocks that nobody owns must stay untouched
    perm = torch.randperm(num_blocks, generator=g)
    # Unused table entries hold real (foreign) block ids: the kernel must not read them.
    bt = torch.randint(0, num_blocks, (len(seqs), max_blocks), generator=g)
    slots, qsl, off = [], [0], 0
    for b, ((ctx, n), nb) in enumerate(zip(seqs, need)):
        bt[b, :nb] = perm[off:off + nb]
        off += nb
        for p in range(ctx, ctx + n):
            slots.append(int(bt[b, p // bs]) * bs + p % bs)
        qsl.append(qsl[-1] + n)
    T = qsl[-1]
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    layout = kv_format.in_pool_layout if pool_layout else (lambda x: x)
    return Batch(
        q=rnd(T, H, D).to(dtype), k=rnd(T, KVH, D).to(dtype), v=rnd(T, KVH, D).to(dtype),
        k_cache=layout(kv_format.encode(rnd(num_blocks, bs, KVH, D), cache_dtype)),
        v_cache=layout(kv_format.encode(rnd(num_blocks, bs, KVH, D), cache_dtype)),
        slot_mapping=torch.tensor(slots, dtype=torch.long), block_tables=bt,
        context_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.long),
        query_start_loc=torch.tensor(qsl, dtype=torch.long), scale=1.0 / math.sqrt(D))


def check_paged_attention(op, batch: Batch, atol=1e-4, rtol=1e-4) -> torch.Tensor:
    """op(*batch.args()) == the pure-torch reference; both pools equal the original except in
    exactly the step's slots, where they hold the reference's bytes (quantized rows included)."""
    from kiln.plugins.paged_kv import kv_format
    from kiln.plugins.paged_kv.ops import paged_attention_reference

    kc0, vc0 = batch.k_cache.clone(), batch.v_cache.clone()
    ref_k, ref_v = kc0.clone(), vc0.clone()
    ref = paged_attention_reference(*batch.args(ref_k, ref_v))
    k_ptr = batch.k_cache.data_ptr()
    out = op(*batch.args())
    assert batch.k_cache.data_ptr() == k_ptr
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)

    bs = kc0.shape[1]
    where = (batch.slot_mapping // bs, batch.slot_mapping % bs)
    raw = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731
    for pool, orig, new in ((batch.k_cache, kc0, batch.k), (batch.v_cache, vc0, batch.v)):
        expect = raw(orig.clone())
        expect[where] = raw(kv_format.encode(new, orig.dtype))
        assert torch.equal(raw(pool), expect)
    assert torch.equal(raw(batch.k_cache), raw(ref_k))
    assert torch.equal(raw(batch.v_cache), raw(ref_v))
    return out


def check_int32_metadata_and_strided_qkv(op) -> None:
    """op with int32 index tensors and q, k, v as strided views of one fused projection (what
    the Llama model passes) == the reference on contiguous int64 inputs."""
    from kiln.plugins.paged_kv.ops import paged_attention_reference

    b = make_batch(MIXED, 9, 3, 64, 16, seed=3)
    T, H, KVH, D = b.q.shape[0], 9, 3, 64
    qkv = torch.randn(T, (H + 2 * KVH) * D)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    b.q, b.k, b.v = q.view(T, H, D), k.reshape(T, KVH, D), v.reshape(T, KVH, D)
    assert not b.v.is_contiguous()
    ref_k, ref_v = b.k_cache.clone(), b.v_cache.clone()
    ref = paged_attention_reference(*b.args(ref_k, ref_v))
    out = op(b.q, b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping.int(), b.block_tables.int(),
             b.context_lens.int(), b.query_start_loc.int(), b.scale)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(b.k_cache, ref_k) and torch.equal(b.v_cache, ref_v)


MIXED = [(0, 37), (100, 50), (500, 1), (2047, 1), (0, 1), (13, 3), (300, 64), (5, 0)]
HEAD_SHAPES = [             # (H, KVH, D, tokens_per_block)
    (4, 4, 64, 16),         # MHA
    (9, 3, 64, 8),          # SmolLM2-135M heads
    (8, 2, 128, 32),
    (8, 1, 48, 64),         # odd head dim, single kv head
    (12, 4, 128, 16),
    (16, 2, 48, 8),
    (16, 2, 128, 16),       # eight query heads a kv head (Llama 3 70B, Qwen3 MoE)
    (8, 4, 256, 16),        # Gemma 2 2B's heads (head dim 256)
    (6, 2, 36, 16),         # head dim not a multiple of the vector width / a power of two
]
SEQ_SHAPES = [              # [(tokens already in the pool, tokens this step)] per batch
    [(2047, 1)],                               # one long decode: context split into parts
    [(300, 1)],                                # two parts of about equal length (160 + 141)
    [(511, 1)] * 32,                           # decode batch
    [(0, 512)],                                # one long prefill chunk, many query tiles
    [(1000, 300), (7, 1)],                     # chunk with earlier context + decode
    [(0, 1)],
]
SEQ_SHAPE_IDS = ["decode1-2048", "decode1-301", "decode32-512", "prefill512", "chunk-after-context",
                 "first-token"]
WINDOWS = [                 # (seqs, window): windows smaller and larger than the context
    (MIXED, 33),                               # not a multiple of a block; chunks crossing it
    ([(2047, 1)], 256),                        # long decode: the window's blocks, in partitions
    ([(2047, 1), (700, 1)], 100),
    ([(1000, 300), (7, 1)], 77),               # a chunk crossing the window after context
    ([(0, 512)], 64),                          # a prefill chunk longer than the window
    ([(50, 1), (0, 37)], 4096),                # a window larger than the context
    ([(300, 1)] * 8 + [(20, 5)], 1),           # each token sees only itself
]
WINDOW_IDS = ["mixed-33", "decode2048-256", "decode-100", "chunk-77", "prefill512-64",
              "beyond-context", "window-1"]


def poison_outside_windows(batch: Batch) -> Batch:
    """A copy of batch whose pool blocks lying wholly before the window of each sequence's
    first query token hold NaN: a kernel that reads them (even to mask them) returns NaN."""
    import dataclasses

    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    bs = kc.shape[1]
    q_lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    for b, (ctx, nq) in enumerate(zip(batch.context_lens.tolist(), q_lens)):
        first_visible = max(0, ctx - nq - batch.window + 1)
        for blk in range(first_visible // bs):
            kc[batch.block_tables[b, blk]] = float("nan")
            vc[batch.block_tables[b, blk]] = float("nan")
    return dataclasses.replace(batch, k_cache=kc, v_cache=vc)


def check_window_skips_blocks(op, batch: Batch, atol=1e-4, rtol=1e-4) -> None:
    """op on a pool poisoned outside the windows == the reference on the clean pool."""
    from kiln.plugins.paged_kv.ops import paged_attention_reference

    poisoned = poison_outside_windows(batch)
    assert torch.isnan(poisoned.k_cache).any()
    ref = paged_attention_reference(*batch.args(batch.k_cache.clone(), batch.v_cache.clone()))
    out = op(*poisoned.args())
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


# ---- quantized linear kernels: shapes and the kernel-vs-reference check --------------------
SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # (n, k): wqkv, wo, w13, w2
ODD_SHAPES = [(1, 128), (37, 256), (129, 384)]                        # (n, k), checked with bias
ODD_BATCHES = [1, 3, 8, 33]
K_NOT_MULTIPLE_OF_32 = [1, 7, 70, 577]


def rows16_digits_bound(x, qw) -> torch.Tensor:
    """[M, N]: how far kiln::linear_int4_rows16 may be from x @ dequantize(qw).T from holding
    each group of 32 of x as two int8 digits (at most max|x of the group| / (2 * 127 * 128)
    off each) times the codes' part of each weight, d * q = w - min (the minimums go against
    the float sum of x)."""
    from kiln.plugins.quant import formats

    gmax = x.abs().reshape(x.shape[0], -1, 32).amax(dim=2).repeat_interleave(32, dim=1)
    mins = formats.dequantize_int4_a8(torch.zeros_like(qw.qweight), qw.scales, qw.zeros)
    dq = formats.dequantize(qw).double() - mins.double()
    return (gmax.double() / (2 * 127 * 128)) @ dq.abs().T


@functools.lru_cache(maxsize=None)
def _computes_bf16(lib: Path) -> bool:
    from kiln.plugins import cpp_build

    return "bf16 from 8 rows" in cpp_build.kernel_path(lib)


def reference_input(x, w, scheme: str, lib=None):
    """The x a quant linear's reference takes for kiln's kernel of a library (default: this
    host's): bf16-rounded where kiln::linear_bf16 computes x @ w.T in bf16, on AMX-BF16 tiles
    or AVX-512 BF16 dot products (plugins/quant/csrc/bf16_gemm.h, bf16_dot.h: a float32 batch
    of 8+ rows, K >= 32), else x itself."""
    from kiln.plugins.quant import kernels

    m, k = x.shape
    rounds = (scheme == "bf16" and x.dtype == torch.float32 and m >= 8 and k >= 32
              and _computes_bf16(Path(lib or kernels.build())))
    return x.bfloat16().float() if rounds else x


def check_quant_linear(linear, x, w, scheme, gs, bias=None) -> None:
    """linear(x, quantized w, bias) == dequantize-then-F.linear, within a relative tolerance."""
    from kiln.plugins.quant import formats, ops

    qw = formats.quantize(w, scheme, gs)
    out = linear(x, qw, bias)
    args = ((qw.qweight, qw.scales, qw.zeros, qw.group_size) if qw.scheme == "int4" else
            (qw.qweight, qw.scales, qw.zeros) if qw.scheme == "int4_a8" else (qw.qweight, qw.scales))
    ref = ops.REFERENCES[scheme](reference_input(x, w, scheme), *args, bias)
    assert out.shape == ref.shape and out.dtype == x.dtype
    scale = ref.float().abs().max().item() + 1e-6
    tol = 1e-2 if x.dtype in (torch.bfloat16, torch.float16) else 2e-5
    if scheme == "int4_a8" and x.dtype == torch.float32 and x.shape[-1] % 32 == 0:
        # weight-only: each group of 32 of x is held as two int8 digits, at most
        # max|x of the group| / (2 * 127 * 128) off each element (linear_int4_rows16.cpp)
        bound = rows16_digits_bound(x, qw)
        excess = (out.double() - ref.double()).abs() - bound - tol * scale
        assert (excess <= 0).all(), (f"int4_a8 x{tuple(x.shape)} w{tuple(w.shape)}: "
                                     f"{excess.max().item():.3g} over the digits' bound")
        return
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * scale, f"{scheme} g={gs} x{tuple(x.shape)} w{tuple(w.shape)}: " \
                               f"max err {err:.3g} vs scale {scale:.3g}"


# ---- specs -----------------------------------------------------------------------------------
TINY_SPEC = """
name: t
model:
  source: random
  arch: {vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1,
         num_attention_heads: 2}
"""   # the smallest valid spec text: tests append sections to it


def spec_problems(text: str) -> tuple[dict[str, str], str]:
    """The spec text's problems ({yaml path: message}, the whole message); it must fail."""
    import pytest

    from kiln.builder.spec import SpecError, parse_spec

    with pytest.raises(SpecError) as e:
        parse_spec(text)
    return dict(e.value.problems), str(e.value)


def chi2_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Pearson's chi-square test of observed counts against probabilities (cells expected
    below 5 draws pooled into one) -> the p-value."""
    small = [c for c in probs if probs[c] * n < 5]
    cells = [[c] for c in probs if c not in small] + ([small] if small else [])
    stat = 0.0
    for group in cells:
        e = n * sum(probs[c] for c in group)
        o = sum(counts.get(c, 0) for c in group)
        stat += (o - e) ** 2 / e
    assert sum(counts.values()) == n and set(counts) <= set(probs), "a draw outside the support"
    df = torch.tensor((len(cells) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))
