"""The executor allocates its KV pools in the order a plan records (kv_cache.pool_order):
the heads-apart order of plans built now, the [block, token, head] order of older plans, and
the engine step reads both the same."""
from __future__ import annotations

import pytest
import torch

from kiln.contracts.manifest import POOL_ORDERS
from kiln.plugins.paged_kv import kernels
from kiln.runtime.executor import Executor, KVLayout, ModelInput
from tests.runtime_helpers import tiny_model

pytestmark = pytest.mark.model


def test_executor_pools_follow_the_plans_order():
    kernels.load()   # the CPU kernel, as a plan's step runs it
    model = tiny_model()
    cfg = model.cfg
    bs = 4
    toks = [[5, 9, 2, 7, 1, 3, 8, 6, 4], [11, 12, 13]]
    logits = {}
    for order in POOL_ORDERS:
        layout = KVLayout(cfg.num_layers, 16, bs, cfg.num_kv_heads, cfg.head_dim, "int8", order)
        ex = Executor(model, layout)
        k = ex.k_caches[0]
        assert k.shape == (16, bs, cfg.num_kv_heads, cfg.head_dim + 4)
        assert k.is_contiguous() == (order == "block_token_head")
        prefill = ex.execute(ModelInput.build(toks, [0, 0], [[1, 2, 3], [4]], bs))
        decode = ex.execute(ModelInput.build([[2], [14]], [9, 3], [[1, 2, 3], [4]], bs))
        logits[order] = torch.cat([prefill, decode])
    first, second = logits.values()
    torch.testing.assert_close(first, second, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown KV pool order"):
        Executor(model, KVLayout(cfg.num_layers, 4, bs, cfg.num_kv_heads, cfg.head_dim,
                                 "fp32", "head_block_token"))
