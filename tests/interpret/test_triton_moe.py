"""kiln::moe_experts_triton (the GPU experts pass) under Triton's interpreter, on CPU tensors,
against a naive per-token loop, and its batch invariance."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.plugins.moe import triton_experts  # noqa: E402
from tests.unit.test_moe_op import case, naive  # noqa: E402

pytestmark = pytest.mark.interpret


def test_kernels_are_interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(triton_experts._gate_up_kernel, InterpretedFunction)
    assert isinstance(triton_experts._down_kernel, InterpretedFunction)


@pytest.mark.parametrize("shape", [dict(T=20), dict(T=5, E=16, k=4, H=35, inter=9),
                                   dict(T=1, k=1)])
def test_matches_naive_loop(shape):
    args = case(**shape)
    out = torch.ops.kiln.moe_experts_triton(*args)
    assert out.dtype == torch.float32
    assert (out.double() - naive(*args)).abs().max() < 1e-5


def test_bf16_weights_and_activations():
    x, ids, weights, w13, w2 = case(T=6)
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    out = torch.ops.kiln.moe_experts_triton(x.bfloat16(), ids, weights, w13, w2)
    want = naive(x.bfloat16().float(), ids, weights, w13.float(), w2.float())
    assert out.dtype == torch.bfloat16 and (out.double() - want).abs().max() < 2e-2


def test_batch_invariant():
    """A token's output is bit for bit the one it gets alone (tiles never depend on T)."""
    x, ids, weights, w13, w2 = case(T=32)
    batch = torch.ops.kiln.moe_experts_triton(x, ids, weights, w13, w2)
    for t in (0, 17):
        alone = torch.ops.kiln.moe_experts_triton(x[t:t + 1], ids[t:t + 1], weights[t:t + 1],
                                                  w13, w2)
        assert torch.equal(alone[0], batch[t]), t
