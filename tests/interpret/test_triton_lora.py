"""kiln::lora_apply_triton (the GPU LoRA pass) under Triton's interpreter, on CPU tensors,
against a naive per-token loop: mixed slots, rows without an adapter, padded ranks."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.plugins.lora import triton_lora  # noqa: E402
from tests.unit.test_lora_op import case, naive  # noqa: E402

pytestmark = pytest.mark.interpret


def test_kernels_are_interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(triton_lora._shrink_kernel, InterpretedFunction)
    assert isinstance(triton_lora._expand_kernel, InterpretedFunction)


@pytest.mark.parametrize("shape", [dict(), dict(T=1, S=1, ranks=(8,)),
                                   dict(T=37, S=4, R=8, K=67, N=13, ranks=(8, 1, 3, 8)),
                                   dict(T=20, S=2, R=24, ranks=(24, 5))])
def test_matches_naive_loop(shape):
    args = case(**shape)
    out = torch.ops.kiln.lora_apply_triton(*args)
    assert out.dtype == torch.float32
    assert (out.double() - naive(*args)).abs().max() < 1e-4


def test_rows_without_adapter_keep_y():
    y, x, _, a, b, scales = case(T=5)
    slots = torch.tensor([-1, 1, -1, -1, 0])
    out = torch.ops.kiln.lora_apply_triton(y, x, slots, a, b, scales)
    assert torch.equal(out[slots < 0], y[slots < 0])
    assert (out.double() - naive(y, x, slots, a, b, scales)).abs().max() < 1e-4


def test_bf16_activations():
    y, x, slots, a, b, scales = case(T=6)
    out = torch.ops.kiln.lora_apply_triton(y.bfloat16(), x.bfloat16(), slots, a, b, scales)
    want = naive(y.bfloat16().float(), x.bfloat16().float(), slots, a, b, scales)
    assert out.dtype == torch.bfloat16 and (out.double() - want).abs().max() < 0.1
