"""torch.export captures the Triton ops as single ops, the KV pools as mutated inputs (the
form AOTInductor calls in place), with dynamic token, batch and pool dims: the part of the
CUDA build that runs without a GPU.

The export runs in a subprocess without TRITON_INTERPRET: exporting traces the ops with fake
tensors through `wrap_triton`'s traceable wrapper, which only compiled (not interpreted)
kernels have. Nothing is compiled or launched: fake tensors carry no data."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

pytestmark = pytest.mark.interpret

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json
import torch
from torch.export import Dim
from kiln.plugins.paged_kv import triton_attention
from kiln.plugins.quant import formats, triton_linear
from triton.runtime.jit import JITFunction
from tests.helpers import make_batch

assert isinstance(triton_attention._attend_kernel, JITFunction)


class Layer(torch.nn.Module):
    """attention -> int4 out projection -> int8 / fp8 linears, the way a model layer calls them"""
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.wo = formats.quantize(torch.randn(64, 9 * 64, generator=g), "int4", 64)
        self.w1 = formats.quantize(torch.randn(96, 64, generator=g), "int8")
        self.w2 = formats.quantize(torch.randn(64, 96, generator=g), "fp8")
        for name, qw in (("wo", self.wo), ("w1", self.w1), ("w2", self.w2)):
            for part in ("qweight", "scales", "zeros"):
                if getattr(qw, part) is not None:
                    self.register_buffer(f"{name}_{part}", getattr(qw, part))

    def forward(self, q, k, v, kc, vc, slots, bt, ctx, qsl):
        o = torch.ops.kiln.paged_attention_triton(q, k, v, kc, vc, slots, bt, ctx, qsl, 0.125)
        x = triton_linear.quant_linear(o.reshape(o.shape[0], -1), self.wo)
        return triton_linear.quant_linear(torch.relu(triton_linear.quant_linear(x, self.w1)),
                                          self.w2)


b = make_batch([(3, 5), (10, 1)], 9, 3, 64, 16, cache_dtype=torch.int8, max_seq_len=128)
T, B = Dim("T", min=1, max=512), Dim("B", min=1, max=32)
NB, MB = Dim("num_blocks", min=2, max=1 << 20), Dim("max_blocks", min=1, max=128)
ep = torch.export.export(Layer(), b.args()[:9], dynamic_shapes=(
    {0: T}, {0: T}, {0: T}, {0: NB}, {0: NB}, {0: T}, {0: B, 1: MB}, {0: B}, {0: B + 1}))
targets = sorted({str(n.target) for n in ep.graph.nodes if n.op == "call_function"})
ep = ep.run_decompositions()
print(json.dumps({"targets": targets,
                  "mutated": sorted(ep.graph_signature.user_inputs_to_mutate.values()),
                  "placeholders": [n.name for n in ep.graph.nodes if n.op == "placeholder"]}))
'''


def test_export_keeps_triton_ops_and_mutates_pools_in_place():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for op in ("paged_attention_triton", "linear_int4_triton", "linear_int8_triton",
               "linear_fp8_triton"):
        assert f"kiln.{op}.default" in got["targets"], got["targets"]
    assert got["mutated"] == ["kc", "vc"]
