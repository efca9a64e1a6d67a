"""builder.target.serial_small_kernels: AOTInductor's CPU kernels fork their OpenMP region
only for calls of at least `min_elements` elements and run smaller ones on the calling
thread; both paths compute what the eager function does."""
import os
import zipfile

import pytest
import torch

from builder.target import inductor_isa, resolve_level, serial_small_kernels

pytestmark = pytest.mark.model


class Fused(torch.nn.Module):
    def forward(self, x, w):   # a fused elementwise kernel and a row reduction
        return torch.nn.functional.silu(x) * w + x.sum(-1, keepdim=True)


@pytest.fixture
def all_cores():
    """Inductor writes a region without num_threads (the only kind rewritten) when the
    compiling thread count equals the CPU count; other tests leave torch at one thread."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: Inductor writes no parallel regions")
    prev = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count())
    yield
    torch.set_num_threads(prev)


def test_small_calls_run_serial_large_ones_parallel_both_match_eager(tmp_path, all_cores):
    width, threshold = 64, 256
    model, w = Fused(), torch.randn(width)
    tokens = torch.export.Dim("tokens", min=1, max=4096)
    ep = torch.export.export(model, (torch.randn(512, width), w),
                             dynamic_shapes=({0: tokens}, None))
    with inductor_isa(resolve_level("auto")), serial_small_kernels(min_elements=threshold):
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "f.pt2"))
    with zipfile.ZipFile(path) as z:
        src = "".join(z.read(n).decode() for n in z.namelist() if n.endswith("kernel.cpp"))
    assert "auto kiln_region_0 = [&]()" in src and f">= {threshold}) {{" in src
    assert "#pragma omp parallel\n" in src.replace("\r", "")
    run = torch._inductor.aoti_load_package(path)
    for t in (1, 3, 4, 5, 300):          # 64-192 elements serial, 256 and up forked
        x = torch.randn(t, width)
        torch.testing.assert_close(run(x, w), model(x, w), rtol=1e-5, atol=1e-5)
