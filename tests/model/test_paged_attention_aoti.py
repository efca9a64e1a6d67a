"""AOTInductor calls the compiled CPU kernel of kiln::paged_attention, writing the pool in place."""
from __future__ import annotations

import math

import pytest
import torch

from kiln.plugins.paged_kv import kernels
from kiln.plugins.paged_kv.ops import paged_attention, paged_attention_reference
from tests.helpers import load_package

pytestmark = pytest.mark.model

H, KVH, D, BS, NUM_BLOCKS, MAX_BLOCKS = 8, 2, 64, 16, 40, 16


class Attn(torch.nn.Module):
    """Stands in for a layer: some graph math around the op, so inductor compiles code too.
    window/softcap 0: the plain call (the op's defaults), as a global layer makes it."""

    def __init__(self, window: int = 0, softcap: float = 0.0):
        super().__init__()
        self.window, self.softcap = window, softcap

    def forward(self, q, k, v, k_cache, v_cache, slot_mapping, block_tables, context_lens,
                query_start_loc):
        o = paged_attention(q * 1.0, k, v, k_cache, v_cache, slot_mapping, block_tables,
                            context_lens, query_start_loc, 1.0 / math.sqrt(D),
                            window=self.window, softcap=self.softcap)
        return o + 0.0


def step_inputs(seqs, seed):
    """seqs: [(tokens already in the pool, tokens this step)]; metadata as int32."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS, generator=g)
    bt = torch.zeros(len(seqs), MAX_BLOCKS, dtype=torch.int32)
    slots, qsl, off = [], [0], 0
    for b, (ctx, n) in enumerate(seqs):
        nb = math.ceil((ctx + n) / BS)
        bt[b, :nb] = perm[off:off + nb].int()
        off += nb
        slots += [int(bt[b, p // BS]) * BS + p % BS for p in range(ctx, ctx + n)]
        qsl.append(qsl[-1] + n)
    T = qsl[-1]
    return (torch.randn(T, H, D, generator=g), torch.randn(T, KVH, D, generator=g),
            torch.randn(T, KVH, D, generator=g),
            torch.tensor(slots, dtype=torch.int32), bt,
            torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
            torch.tensor(qsl, dtype=torch.int32))


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (37, 0.0), (24, 2.5)],
                         ids=["global", "window", "window-softcap"])
def test_aoti_calls_kernel_in_place(tmp_path, window, softcap):
    kernels.load()
    k_cache = torch.randn(NUM_BLOCKS, BS, KVH, D)
    v_cache = torch.randn(NUM_BLOCKS, BS, KVH, D)
    q, k, v, sm, bt, cl, qsl = step_inputs([(0, 5), (20, 1), (3, 2)], seed=0)
    T, B = torch.export.Dim("T", min=2, max=256), torch.export.Dim("B", min=1, max=8)
    dyn = ({0: T}, {0: T}, {0: T}, None, None, {0: T}, {0: B}, {0: B}, {0: B + 1})
    ep = torch.export.export(Attn(window, softcap), (q, k, v, k_cache, v_cache, sm, bt, cl, qsl),
                             dynamic_shapes=dyn)
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "attn.pt2"))
    runner = load_package(pkg)

    # A different batch than the traced one: a prefill chunk after context, decodes, a new seq.
    q, k, v, sm, bt, cl, qsl = step_inputs([(40, 30), (100, 1), (0, 9), (7, 1)], seed=1)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    # The reference needs int64 indices: the graph's int32 ones run only in the C++ kernel.
    ref = paged_attention_reference(q, k, v, ref_k, ref_v, sm.long(), bt.long(), cl.long(),
                                    qsl.long(), 1.0 / math.sqrt(D), window, softcap)
    k_ptr, v_ptr, k_before = k_cache.data_ptr(), v_cache.data_ptr(), k_cache.clone()
    out = runner(q, k, v, k_cache, v_cache, sm, bt, cl, qsl)
    out = out[0] if isinstance(out, (list, tuple)) else out

    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert k_cache.data_ptr() == k_ptr and v_cache.data_ptr() == v_ptr
    assert not torch.equal(k_cache, k_before)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
