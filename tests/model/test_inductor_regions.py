"""kiln.builder.target.kernel_regions: AOTInductor's CPU kernels are the same whatever thread
count the build process runs at, correct for any team size at run time, and fork their
OpenMP region only for calls of at least `min_elements` elements."""
import contextlib
import zipfile

import pytest
import torch

from kiln.builder.target import inductor_isa, kernel_regions, resolve_level
from tests.helpers import load_package

pytestmark = pytest.mark.model


class Fused(torch.nn.Module):
    def forward(self, x, w):   # a fused elementwise kernel and a row reduction
        return torch.nn.functional.silu(x) * w + x.sum(-1, keepdim=True)


class Total(torch.nn.Module):
    def forward(self, x):      # one reduction over everything: Inductor splits it over threads
        return (x * x).sum()


@contextlib.contextmanager
def torch_threads(n):
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def compile_at(ep, path, threads, **regions):
    with torch_threads(threads), inductor_isa(resolve_level("auto")), kernel_regions(**regions):
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
    with zipfile.ZipFile(path) as z:
        src = "".join(z.read(n).decode() for n in sorted(z.namelist())
                      if n.endswith("kernel.cpp")).replace("\r", "")
    # the code alone: the trailing comments name the build's temporary paths
    return "\n".join(line for line in src.splitlines()
                     if line.strip() and not line.startswith("//"))


def test_small_calls_run_serial_large_ones_parallel_both_match_eager(tmp_path):
    width, threshold = 64, 256
    model, w = Fused(), torch.randn(width)
    tokens = torch.export.Dim("tokens", min=1, max=4096)
    ep = torch.export.export(model, (torch.randn(512, width), w),
                             dynamic_shapes=({0: tokens}, None))
    src = compile_at(ep, tmp_path / "f.pt2", 1, min_elements=threshold)
    assert f">= {threshold})\n" in src and "else\n" in src
    assert "#pragma omp parallel\n" in src and "num_threads(" not in src
    run = load_package(str(tmp_path / "f.pt2"))
    with torch_threads(2):
        for t in (1, 3, 4, 5, 300):          # 64-192 elements serial, 256 and up forked
            x = torch.randn(t, width)
            torch.testing.assert_close(run(x, w), model(x, w), rtol=1e-5, atol=1e-5)


def test_the_build_machines_thread_count_never_enters_the_code(tmp_path):
    """Compiled at 1 and at 3 threads: one source, and a parallel reduction (partial sums
    per thread) right at 1, 2 and 5 threads, more than either build had."""
    model = Total()
    size = torch.export.Dim("size", min=2, max=1 << 22)
    ep = torch.export.export(model, (torch.randn(1 << 16),), dynamic_shapes=({0: size},))
    one = compile_at(ep, tmp_path / "one.pt2", 1)
    three = compile_at(ep, tmp_path / "three.pt2", 3)
    assert one == three
    assert "omp_get_max_threads()" in one and "num_threads(" not in one
    run = load_package(str(tmp_path / "one.pt2"))
    x = torch.randn(1 << 20, dtype=torch.float64).float()
    for threads in (1, 2, 5):
        with torch_threads(threads):
            torch.testing.assert_close(run(x), model(x), rtol=1e-4, atol=1e-2)
