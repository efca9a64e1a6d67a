"""On a CUDA device: the portable kernels (pure-torch references) give the CPU's results."""
import pytest
import torch

from kiln.plugins.paged_kv.ops import paged_attention_reference

pytestmark = pytest.mark.gpu


def test_paged_attention_reference_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(0)
    H, KVH, D, bs, nb = 8, 2, 64, 16, 32
    lens, starts = [5, 1, 9], [0, 20, 3]
    T = sum(lens)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, KVH, KVH))
    kc, vc = torch.randn(nb, bs, KVH, D, generator=g), torch.randn(nb, bs, KVH, D, generator=g)
    tables = torch.tensor([[3, 7], [1, 9], [4, 2]], dtype=torch.int32)
    ctx = torch.tensor([s + n for s, n in zip(starts, lens)], dtype=torch.int32)
    qsl = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    slots = tables.long()[torch.repeat_interleave(torch.arange(3), torch.tensor(lens)), pos // bs] * bs + pos % bs
    args = (q, k, v, kc.clone(), vc.clone(), slots, tables, ctx, qsl, D ** -0.5)
    cpu = paged_attention_reference(*args)
    dev = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    out = paged_attention_reference(*dev)
    torch.testing.assert_close(out.cpu(), cpu, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dev[3].cpu(), args[3])
