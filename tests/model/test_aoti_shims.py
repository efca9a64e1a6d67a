"""plugins/shims.py + plugins/csrc/aoti_shim.h: a CPU plan's compiled graph calls kiln's ops
through their C shims (no proxy executor), and gets what the ops return eagerly."""
import ctypes
import subprocess
import zipfile

import pytest
import torch

from kiln.builder.compile import compile_engine
from kiln.builder.target import resolve_level
from kiln.plugins import shims
from kiln.plugins.lora import kernels as lora_kernels
from kiln.plugins.moe import kernels as moe_kernels
from kiln.plugins.paged_kv import kernels as pa_kernels
from kiln.plugins.quant import formats, kernels as q_kernels
from tests.helpers import load_package

pytestmark = pytest.mark.model


def test_declarations_follow_the_schemas():
    decl = shims.declarations()
    assert {op.name().split("::")[-1] for op in decl} == set(shims.CPU_OPS)
    assert decl[torch.ops.kiln.linear_int4.default] == [
        "AOTITorchError aoti_torch_cpu_linear_int4(AtenTensorHandle, AtenTensorHandle, "
        "AtenTensorHandle, AtenTensorHandle, int64_t, AtenTensorHandle*, AtenTensorHandle*)"]
    assert "double, int64_t, double, AtenTensorHandle*)" in decl[
        torch.ops.kiln.paged_attention.default][0]      # scale, window, softcap
    with pytest.raises(ValueError, match="alpha"):     # a Scalar argument has no shim type
        shims.declaration(torch.ops.aten.add.Tensor)


def test_every_cpu_op_has_its_shim_in_a_kernel_library():
    exported = set()
    for lib in (q_kernels.build(), pa_kernels.build(), moe_kernels.build(),
                lora_kernels.build()):
        handle = ctypes.CDLL(str(lib))
        exported |= {op for op in shims.CPU_OPS if hasattr(handle, f"aoti_torch_cpu_{op}")}
    assert exported == set(shims.CPU_OPS)


class Linears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a8 = formats.quantize(torch.randn(64, 96, generator=g), "int4_a8")
        self.w8 = formats.quantize(torch.randn(96, 64, generator=g), "int8")
        self.b = torch.randn(96, generator=g)

    def forward(self, x):
        a8 = self.a8
        y = torch.ops.kiln.linear_int4_a8(x, a8.qweight, a8.scales, a8.zeros, None)
        y = y + torch.ops.kiln.linear_int4_rows16(x, a8.qweight, a8.scales, a8.zeros, None)
        return torch.ops.kiln.linear_int8(torch.relu(y), self.w8.qweight, self.w8.scales,
                                          self.b)


def test_compiled_graph_calls_the_shims_and_matches_eager(tmp_path):
    q_kernels.load()
    model = Linears()
    rows = torch.export.Dim("rows", min=1, max=64)
    ep = torch.export.export(model, (torch.randn(4, 96),), dynamic_shapes=({0: rows},))
    path = compile_engine(ep, tmp_path / "m.pt2", "aoti", resolve_level("auto")).file
    with zipfile.ZipFile(path) as z:
        z.extractall(tmp_path / "x")
        wrapper = "".join(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    assert "aoti_torch_cpu_linear_int4_a8(" in wrapper and "aoti_torch_cpu_linear_int8(" in wrapper
    assert "aoti_torch_cpu_linear_int4_rows16(" in wrapper
    assert "proxy_executor->call_function" not in wrapper
    so = next((tmp_path / "x").rglob("*.so"))
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True,
                               text=True).stdout
    assert "aoti_torch_cpu_linear_int4_a8" in undefined       # resolved from the kernel library
    run = load_package(str(path))
    for m in (1, 3, 64):
        x = torch.randn(m, 96)
        torch.testing.assert_close(run(x), model(x), rtol=0, atol=0)


class LoraLinear(torch.nn.Module):
    """A float linear with kiln::lora_apply's term; the adapters are inputs of the graph."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(48, 40, bias=False)

    def forward(self, x, slots, a, b, scales):
        return torch.ops.kiln.lora_apply(self.w(x), x, slots, a, b, scales)


def test_compiled_graph_calls_the_lora_shim(tmp_path):
    from tests.unit.test_lora_op import case

    lora_kernels.load()
    model = LoraLinear()
    y, x, slots, a, b, scales = case(T=6, K=48, N=40)
    args = (x, slots, a, b, scales)
    rows = torch.export.Dim("rows", min=1, max=64)
    ep = torch.export.export(model, args, dynamic_shapes=({0: rows}, {0: rows}, None, None,
                                                          None))
    path = compile_engine(ep, tmp_path / "m.pt2", "aoti", resolve_level("auto")).file
    with zipfile.ZipFile(path) as z:
        wrapper = "".join(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    assert "aoti_torch_cpu_lora_apply(" in wrapper
    assert "proxy_executor->call_function" not in wrapper
    run = load_package(str(path))
    for t in (1, 5, 17):
        y, x, slots, a, b, scales = case(T=t, K=48, N=40, seed=t)
        a2, b2 = a * 3, b.flip(0)             # other adapters, same compiled graph
        torch.testing.assert_close(run(x, slots, a2, b2, scales), model(x, slots, a2, b2, scales),
                                   rtol=0, atol=0)
