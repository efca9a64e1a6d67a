"""The compiled CPU kernel of kiln::paged_attention against the pure-torch reference (model
tier: the kernel is compiled from C++)."""
from __future__ import annotations

import pytest
import torch

from kiln.plugins.paged_kv import kernels, kv_format
from tests.helpers import (HEAD_SHAPES, MIXED, SEQ_SHAPE_IDS, SEQ_SHAPES, WINDOW_IDS, WINDOWS,
                           Batch, check_int32_metadata_and_strided_qkv, check_paged_attention,
                           check_window_skips_blocks, make_batch)

pytestmark = pytest.mark.model


@pytest.fixture(scope="module", autouse=True)
def cpu_kernel():
    kernels.load()  # compiles once per source/flags/torch (cached), then registers for CPU


def check(batch: Batch, atol=1e-4, rtol=1e-4):
    """Kernel == reference; both pools equal the original except in exactly the step's slots."""
    return check_paged_attention(torch.ops.kiln.paged_attention, batch, atol, rtol)


@pytest.mark.parametrize("H,KVH,D,bs", HEAD_SHAPES)
def test_mixed_prefill_and_decode(H, KVH, D, bs):
    check(make_batch(MIXED, H, KVH, D, bs, seed=H * 1000 + D + bs))


@pytest.mark.parametrize("seqs", SEQ_SHAPES, ids=SEQ_SHAPE_IDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_shapes_and_splits(seqs, threads):
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check(make_batch(seqs, 9, 3, 64, 16, seed=len(seqs)))
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32),
])
def test_bf16(dtype, cache_dtype):
    b = make_batch(MIXED, 8, 2, 64, 16, dtype=dtype, cache_dtype=cache_dtype, seed=7)
    check(b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["q-fp32", "q-bf16"])
@pytest.mark.parametrize("H,KVH,D,bs", [(9, 3, 64, 16), (8, 2, 128, 32), (6, 2, 36, 8)])
def test_quantized_cache(cache_dtype, dtype, H, KVH, D, bs):
    """Codes + per-row scale: the kernel writes the reference's exact bytes and attends over
    the same dequantized values (odd head dims take the scalar tails)."""
    b = make_batch(MIXED, H, KVH, D, bs, dtype=dtype, cache_dtype=cache_dtype, seed=D + bs)
    assert b.k_cache.shape[-1] == D + 4
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    check(b, atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
@pytest.mark.parametrize("H,KVH,D,bs", [(9, 3, 64, 64), (8, 2, 128, 16)])
def test_pool_layouts(cache_dtype, H, KVH, D, bs):
    """The runtime's pools (kv heads apart within a block) and plain contiguous ones give the
    same output and the same bytes in the pools; new_pools makes the former."""
    outs = []
    for pool_layout in (True, False):
        b = make_batch(MIXED, H, KVH, D, bs, cache_dtype=cache_dtype, pool_layout=pool_layout)
        assert b.k_cache.is_contiguous() != pool_layout
        outs.append((check(b), b.k_cache.contiguous(), b.v_cache.contiguous()))
    for x, y in zip(*outs):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    k, _ = kv_format.new_pools("int8", 1, 4, bs, KVH, D)
    assert k[0].shape == (4, bs, KVH, D + 4) and k[0].stride()[1:] == (D + 4, bs * (D + 4), 1)


@pytest.mark.parametrize("name,bound", [("int8", 0.5 / 127), ("fp8", 1 / 16)])
def test_quantized_rows_round_trip(name, bound):
    """encode/decode of K/V rows: error within half a step of the row's scale (int8) or the
    E4M3 relative step; outlier rows and all-zero rows included."""
    dt = kv_format.storage_dtype(name)
    x = torch.randn(64, 4, 64, generator=torch.Generator().manual_seed(0))
    x[3, 1, 7] = 300.0          # an outlier: only its own row gets a coarse scale
    x[5, 2] = 0.0               # an all-zero row: scale 0, decodes to zeros
    rows = kv_format.encode(x, dt)
    assert rows.dtype == dt and rows.shape == (64, 4, 68)
    y = kv_format.decode(rows)
    amax = x.abs().amax(-1, keepdim=True)
    err = (y - x).abs()
    if name == "int8":
        assert (err <= bound * amax + 1e-6).all()
    else:   # E4M3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal floor
        assert (err <= bound * x.abs() + amax / 448 * 2 ** -9 + 1e-6).all()
    assert torch.equal(y[5, 2], torch.zeros(64))
    if name == "int8":          # the outlier's neighbour rows keep their fine steps
        assert err[3, 0].max() < 0.05 < err[3, 1].max()


def test_quantized_pool_holds_more_tokens():
    f32 = kv_format.bytes_per_token("fp32", 30, 3, 64)
    assert kv_format.bytes_per_token("bf16", 30, 3, 64) * 2 == f32
    for name in ("int8", "fp8"):
        assert kv_format.bytes_per_token(name, 30, 3, 64) == 2 * 30 * 3 * 68
        assert f32 / kv_format.bytes_per_token(name, 30, 3, 64) > 3.7


@pytest.mark.parametrize("seqs,window", WINDOWS, ids=WINDOW_IDS)
@pytest.mark.parametrize("H,KVH,D,bs", [(4, 4, 64, 16), (9, 3, 64, 8), (8, 1, 48, 64),
                                        (16, 2, 48, 8), (6, 2, 36, 16)])
@pytest.mark.parametrize("softcap", [0.0, 1.5], ids=["nocap", "softcap"])
def test_sliding_window(seqs, window, H, KVH, D, bs, softcap):
    """A window per layer (and soft-capping): GQA, decode and chunks crossing the window."""
    b = make_batch(seqs, H, KVH, D, bs, seed=window + D + bs)
    b.window, b.softcap = window, softcap
    check(b)


@pytest.mark.parametrize("seqs,window", WINDOWS[:4], ids=WINDOW_IDS[:4])
@pytest.mark.parametrize("threads", [1, 2])
def test_window_never_reads_blocks_outside_it(seqs, window, threads):
    """Blocks wholly before a window are skipped, not read and masked: NaN there is harmless."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        b = make_batch(seqs, 9, 3, 64, 16, seed=window)
        b.window = window
        check_window_skips_blocks(torch.ops.kiln.paged_attention, b)
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8,
                                         torch.float8_e4m3fn],
                         ids=["fp32", "bf16", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["q-fp32", "q-bf16"])
@pytest.mark.parametrize("H,KVH,D,bs", [(9, 3, 64, 16), (8, 2, 128, 32), (6, 2, 36, 8)])
def test_window_and_softcap_every_pool(cache_dtype, dtype, H, KVH, D, bs):
    b = make_batch(MIXED, H, KVH, D, bs, dtype=dtype, cache_dtype=cache_dtype, seed=D + bs)
    b.window, b.softcap = 45, 2.0
    tol = 2e-2 if torch.bfloat16 in (dtype, cache_dtype) else 1e-4
    check(b, atol=tol, rtol=tol)


def test_window_reference_is_transformers_mask():
    """The reference's window: token at p sees keys in (p - window, p], capped scores, as a
    dense masked softmax over one sequence computes it."""
    from kiln.plugins.paged_kv.ops import paged_attention_reference

    b = make_batch([(30, 20)], 4, 2, 16, 8, seed=1)
    b.window, b.softcap = 7, 3.0
    K = b.k_cache[b.block_tables[0, :7]].reshape(-1, 2, 16).clone()
    V = b.v_cache[b.block_tables[0, :7]].reshape(-1, 2, 16).clone()
    K[30:50], V[30:50] = b.k, b.v
    out = paged_attention_reference(*b.args(b.k_cache.clone(), b.v_cache.clone()))
    s = torch.einsum("qhd,khd->hqk", b.q, K[:50].repeat_interleave(2, 1)) * b.scale
    s = 3.0 * torch.tanh(s / 3.0)
    p, c = torch.arange(30, 50)[:, None], torch.arange(50)[None, :]
    s = s.masked_fill(~((c <= p) & (c > p - 7)), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", s.softmax(-1), V[:50].repeat_interleave(2, 1))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    b.window, b.softcap = 0, 0.0   # the window and the cap change the result
    assert not torch.allclose(paged_attention_reference(*b.args(b.k_cache.clone(),
                                                                b.v_cache.clone())), out)


def test_int32_metadata_and_strided_qkv():
    check_int32_metadata_and_strided_qkv(torch.ops.kiln.paged_attention)


def _call(b: Batch, **over):
    a = dict(zip(["q", "k", "v", "k_cache", "v_cache", "slot_mapping", "block_tables",
                  "context_lens", "query_start_loc", "scale", "window", "softcap"], b.args()))
    a.update(over)
    return torch.ops.kiln.paged_attention(*a.values())


@pytest.mark.parametrize("change,match", [
    (lambda b: dict(q=b.q[:, :5]), "multiple of kv heads"),
    (lambda b: dict(query_start_loc=b.query_start_loc[:-1]), "B\\+1"),
    (lambda b: dict(k_cache=b.k_cache.contiguous()), "same strides"),
    (lambda b: dict(k_cache=torch.zeros(*b.k_cache.shape[:3], 80)[..., :64],
                    v_cache=torch.zeros(*b.v_cache.shape[:3], 80)[..., :64]), "dense"),
    (lambda b: dict(q=b.q.half(), k=b.k.half(), v=b.v.half()), "float32 or bfloat16"),
    (lambda b: dict(k=b.k.bfloat16()), "share a dtype"),
    (lambda b: dict(v_cache=b.v_cache.bfloat16()), "k_cache and v_cache"),
    (lambda b: dict(k_cache=b.k_cache.half(), v_cache=b.v_cache.half()), "float8_e4m3fn"),
    (lambda b: dict(k_cache=b.k_cache.to(torch.int8), v_cache=b.v_cache.to(torch.int8)),
     "4 scale bytes"),
    (lambda b: dict(q=b.q[..., :32]), "head_dim"),
    (lambda b: dict(slot_mapping=b.slot_mapping.float()), "int32 or int64"),
    (lambda b: dict(slot_mapping=b.slot_mapping + 10**6), "outside the pool"),
    (lambda b: dict(block_tables=b.block_tables + 10**6), "outside the pool"),
    (lambda b: dict(context_lens=torch.tensor([3, 0])), "less than"),
    (lambda b: dict(context_lens=b.context_lens + 10**5), "capacity"),
    (lambda b: dict(q=b.q[:-1]), "k and v must be"),
    (lambda b: dict(window=-1), "window must be >= 0"),
    (lambda b: dict(softcap=-1.0), "softcap must be >= 0"),
], ids=["heads", "qsl-size", "cache-layout", "cache-gaps", "fp16", "qkv-dtypes", "cache-dtypes",
        "head-dim", "cache-fp16", "int8-without-scales", "index-dtype", "bad-slot", "bad-block", "short-context", "long-context",
        "token-count", "window", "softcap"])
def test_bad_inputs_raise(change, match):
    b = make_batch([(10, 4), (3, 1)], 8, 2, 64, 16)
    with pytest.raises(RuntimeError, match=match):
        _call(b, **change(b))
