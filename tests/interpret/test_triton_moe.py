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


EXPORT = r'''
import json
import torch
from torch.export import Dim
from kiln.plugins.moe import ops, triton_experts
from triton.runtime.jit import JITFunction
from tests.unit.test_moe_op import case

assert isinstance(triton_experts._gate_up_kernel, JITFunction)


class Layer(torch.nn.Module):
    def __init__(self, w13, w2):
        super().__init__()
        self.register_buffer("w13", w13)
        self.register_buffer("w2", w2)

    def forward(self, x, logits):
        ids, weights = ops.route(logits, 2, True)
        return torch.ops.kiln.moe_experts_triton(x, ids, weights, self.w13, self.w2)


x, _, _, w13, w2 = case(T=8)
T = Dim("T", min=1, max=512)
ep = torch.export.export(Layer(w13, w2), (x, torch.randn(8, 8)),
                         dynamic_shapes=({0: T}, {0: T}))
print(json.dumps(sorted({str(n.target) for n in ep.graph.nodes if n.op == "call_function"})))
'''


def test_export_keeps_the_experts_pass_one_op_with_a_dynamic_token_dim():
    """torch.export captures kiln::moe_experts_triton whole, T dynamic (no data-dependent
    shapes inside); run without TRITON_INTERPRET, nothing launched (tests/interpret's
    test_triton_export.py does the same for the other Triton ops)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    run = subprocess.run([sys.executable, "-c", EXPORT], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "kiln.moe_experts_triton.default" in json.loads(run.stdout.strip().splitlines()[-1])
