"""kiln::paged_attention_triton (the GPU kernel) under Triton's interpreter, on CPU tensors,
against the pure-torch reference: the batches and shapes the CPU kernel is tested on."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.plugins.paged_kv import kv_format, triton_attention  # noqa: E402
from tests.helpers import (HEAD_SHAPES, MIXED, SEQ_SHAPE_IDS, SEQ_SHAPES,  # noqa: E402
                           WINDOW_IDS, WINDOWS, Batch, check_int32_metadata_and_strided_qkv,
                           check_paged_attention, check_window_skips_blocks, make_batch)

pytestmark = pytest.mark.interpret


def test_kernels_are_interpreted():
    """The conftest's TRITON_INTERPRET reached the kernels (else they would try to compile)."""
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(triton_attention._attend_kernel, InterpretedFunction)
    assert isinstance(triton_attention._write_kv_kernel, InterpretedFunction)


def check(batch: Batch, atol=1e-4, rtol=1e-4):
    """Triton op == reference; both pools equal the original except in exactly the step's
    slots, where they hold the reference's bytes (quantized rows included)."""
    return check_paged_attention(torch.ops.kiln.paged_attention_triton, batch, atol, rtol)


@pytest.mark.parametrize("H,KVH,D,bs", HEAD_SHAPES)
def test_mixed_prefill_and_decode(H, KVH, D, bs):
    check(make_batch(MIXED, H, KVH, D, bs, seed=H * 1000 + D + bs))


@pytest.mark.parametrize("seqs", SEQ_SHAPES, ids=SEQ_SHAPE_IDS)
def test_shapes(seqs):
    check(make_batch(seqs, 9, 3, 64, 16, seed=len(seqs)))


@pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),            # GPU-only pool dtype (no CPU kernel)
])
def test_half_precision(dtype, cache_dtype):
    b = make_batch(MIXED, 8, 2, 64, 16, dtype=dtype, cache_dtype=cache_dtype, seed=7)
    check(b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype,H,KVH,D,bs", [
    (torch.float32, 9, 3, 64, 16),
    (torch.bfloat16, 8, 2, 128, 32),
    (torch.float32, 6, 2, 36, 8),
], ids=["q-fp32-smollm2", "q-bf16-d128", "q-fp32-d36"])
def test_quantized_cache(cache_dtype, dtype, H, KVH, D, bs):
    """Codes + per-row scale: the kernel writes the reference's exact bytes (its own
    round-to-nearest-even, not the device's convert) and attends over the same values."""
    b = make_batch(MIXED, H, KVH, D, bs, dtype=dtype, cache_dtype=cache_dtype, seed=D + bs)
    assert b.k_cache.shape[-1] == D + 4
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    check(b, atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
def test_pool_layouts(cache_dtype):
    """The runtime's pools (kv heads apart within a block) and contiguous ones: same output,
    same bytes written."""
    outs = []
    for pool_layout in (True, False):
        b = make_batch(MIXED, 8, 2, 64, 32, cache_dtype=cache_dtype, pool_layout=pool_layout)
        outs.append((check(b), b.k_cache.contiguous(), b.v_cache.contiguous()))
    for x, y in zip(*outs):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("seqs,window", WINDOWS, ids=WINDOW_IDS)
@pytest.mark.parametrize("H,KVH,D,bs,softcap", [(9, 3, 64, 8, 0.0), (6, 2, 36, 16, 1.5)],
                         ids=["smollm2", "d36-softcap"])
def test_sliding_window(seqs, window, H, KVH, D, bs, softcap):
    """A window per layer (and soft-capping): GQA, decode and chunks crossing the window."""
    b = make_batch(seqs, H, KVH, D, bs, seed=window + D + bs)
    b.window, b.softcap = window, softcap
    check(b)


@pytest.mark.parametrize("seqs,window", WINDOWS[:4], ids=WINDOW_IDS[:4])
def test_window_never_reads_blocks_outside_it(seqs, window):
    b = make_batch(seqs, 9, 3, 64, 16, seed=window)
    b.window = window
    check_window_skips_blocks(torch.ops.kiln.paged_attention_triton, b)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8, torch.float8_e4m3fn],
                         ids=["bf16", "int8", "fp8"])
def test_window_and_softcap_every_pool(cache_dtype):
    b = make_batch(MIXED, 8, 2, 128, 32, cache_dtype=cache_dtype, seed=5)
    b.window, b.softcap = 45, 2.0
    tol = 2e-2 if cache_dtype == torch.bfloat16 else 1e-4
    check(b, atol=tol, rtol=tol)


def test_fp8_rounding_ties_and_extremes():
    """Rows whose scaled values fall on E4M3 rounding ties, subnormals, the 448 maximum and
    signed zeros: the Triton write rounds exactly as torch's float8 cast."""
    D = 16
    codes = torch.arange(0, 126, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[:-1] + codes[1:]) / 2                      # exact ties between neighbours
    vals = torch.cat([mids, -mids, codes[:10] * 0.999, torch.tensor([448.0, -0.0])])
    body = torch.zeros(-(-vals.numel() // (D - 1)) * (D - 1))
    body[:vals.numel()] = vals
    body = body.view(-1, D - 1)
    # a first column of 448 makes every row's scale 1: its codes are its values
    rows = torch.cat([torch.full((body.shape[0], 1), 448.0), body], dim=1)
    T = rows.shape[0]
    k = rows.view(T, 1, D)
    v = -k
    kc = torch.zeros(T, 1, 1, D + 4, dtype=torch.float8_e4m3fn)
    vc = kc.clone()
    q = torch.randn(T, 1, D)
    slots = torch.arange(T)
    ones = torch.ones(T, dtype=torch.long)
    torch.ops.kiln.paged_attention_triton(q, k, v, kc, vc, slots, slots.view(T, 1), ones,
                                          torch.arange(T + 1), 1.0)
    expect = kv_format.encode(k, torch.float8_e4m3fn).view(torch.uint8).view(T, 1, 1, D + 4)
    assert torch.equal(kc.view(torch.uint8), expect)
    expect_v = kv_format.encode(v, torch.float8_e4m3fn).view(torch.uint8).view(T, 1, 1, D + 4)
    assert torch.equal(vc.view(torch.uint8), expect_v)


def test_int32_metadata_and_strided_qkv():
    check_int32_metadata_and_strided_qkv(torch.ops.kiln.paged_attention_triton)


@pytest.mark.parametrize("change,match", [
    (lambda b: dict(q=b.q[:, :5]), "multiple of kv heads"),
    (lambda b: dict(query_start_loc=b.query_start_loc[:-1]), "B\\+1"),
    (lambda b: dict(k_cache=b.k_cache.contiguous()), "one set of strides"),
    (lambda b: dict(k_cache=torch.zeros(*b.k_cache.shape[:3], 80)[..., :64],
                    v_cache=torch.zeros(*b.v_cache.shape[:3], 80)[..., :64]), "dense"),
    (lambda b: dict(k=b.k.bfloat16()), "share a dtype"),
    (lambda b: dict(v_cache=b.v_cache.bfloat16()), "one dtype"),
    (lambda b: dict(k_cache=b.k_cache.double(), v_cache=b.v_cache.double()), "pool dtype"),
    (lambda b: dict(k_cache=b.k_cache.to(torch.int8), v_cache=b.v_cache.to(torch.int8)),
     "scale bytes"),
    (lambda b: dict(q=b.q[..., :32]), "k and v must be"),
    (lambda b: dict(slot_mapping=b.slot_mapping.float()), "int32 or int64"),
    (lambda b: dict(q=b.q[:-1]), "k and v must be"),
], ids=["heads", "qsl-size", "cache-layout", "cache-gaps", "qkv-dtypes", "cache-dtypes", "cache-fp64",
        "int8-without-scales", "head-dim", "index-dtype", "token-count"])
def test_bad_inputs_raise(change, match):
    b = make_batch([(10, 4), (3, 1)], 8, 2, 64, 16)
    a = dict(zip(["q", "k", "v", "k_cache", "v_cache", "slot_mapping", "block_tables",
                  "context_lens", "query_start_loc", "scale"], b.args()))
    a.update(change(b))
    with pytest.raises(RuntimeError, match=match):
        torch.ops.kiln.paged_attention_triton(*a.values())
