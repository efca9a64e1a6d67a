"""kiln::linear_fp32 at a decode batch's rows (8-64 rows of x, 8-128 in AVX-512 builds:
gemm_f32_dot.h's register-blocked kernel on AVX2 builds and on AVX-512 builds off Intel CPUs,
BLAS on others) and at a prefill's (off Intel CPUs the same kernel in chunks of rows, BLAS on
Intel's): x W^T (+ bias) within fp32 rounding on shapes that leave partial tiles and chunks (N
not a multiple of the 12-row group, rows not a multiple of 8 or of a chunk), and where the dot
kernel runs a row's output the same bits at every number of rows it takes (MKL's sgemm gave
other bits at 9-11 rows than at 64)."""
from pathlib import Path

import pytest
import torch

from kiln.plugins import isa
from kiln.plugins.quant import kernels

pytestmark = pytest.mark.model


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    kernels.load()


def _ref(x, w, bias=None):
    out = x.double() @ w.double().t()
    return (out if bias is None else out + bias.double()).float()


@pytest.mark.parametrize("n,k", [(100, 37), (576, 576), (25, 1536), (166, 192)])
@pytest.mark.parametrize("m", [8, 9, 17, 32, 33, 64, 65, 128, 129, 200, 257, 470])
def test_matches_x_wt(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    got = torch.ops.kiln.linear_fp32(x, w, None)
    assert got.shape == (m, n) and got.is_contiguous()
    torch.testing.assert_close(got, _ref(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(torch.ops.kiln.linear_fp32(x, w, bias), _ref(x, w, bias),
                               rtol=1e-5, atol=1e-4)


def _intel() -> bool:
    return "GenuineIntel" in Path("/proc/cpuinfo").read_text()


def _dot_kernel_runs() -> bool:
    """gemm_f32_dot.h's kernel takes 8-64 rows in AVX2 builds, and 8-128 in AVX-512 builds on
    CPUs other than Intel's (kernels.load: this host's level); off Intel any more rows, in
    chunks of at most that many."""
    level = isa.host_level().name
    return level == "avx2" or (level != "none" and not _intel())


@pytest.mark.skipif(not _dot_kernel_runs(),
                    reason="the dot kernel runs in AVX2 builds and in AVX-512 builds off Intel")
@pytest.mark.parametrize("k", [200, 192, 1040])
def test_row_does_not_depend_on_batch(k):
    """K = 192 takes the broadcast GEMM from 16 rows where the level has it (16 weight rows a
    block up to 16 rows of x, N = 166 leaving 6 past the blocks; from 17 rows tasks of 24
    weight rows in pair tiles, leaving a tile of 12 and 10 single rows) and the register tiles
    below: all give the same bits. K = 200 (not a multiple of 16) stays on the register tiles;
    K = 1040 takes the broadcast GEMM only where 512-bit vectors run at full width (AMD Zen 5).
    Off Intel the rows past the kernel's most go through it in chunks: a prefill's rows get the
    same bits."""
    top = 64 if isa.host_level().name == "avx2" else 128   # the most rows the kernel takes
    if not _intel():
        top = 2 * top + 37   # three chunks
    g = torch.Generator().manual_seed(k)
    w, x = torch.randn(166, k, generator=g), torch.randn(top, k, generator=g)
    bias = torch.randn(166, generator=g)
    full = torch.ops.kiln.linear_fp32(x, w, bias)
    for m in range(8, top + 1):
        got = torch.ops.kiln.linear_fp32(x[:m], w, bias)
        assert torch.equal(got, full[:m]), f"{m} rows"
        # the same rows anywhere in the batch: the last m rows alone
        assert torch.equal(torch.ops.kiln.linear_fp32(x[top - m:], w, bias), full[top - m:]), m


@pytest.mark.parametrize("m", [8, 200])
def test_runs_in_inference_mode(m):
    """As the engine calls it: on inference tensors (BLAS at a prefill's rows on Intel CPUs)."""
    g = torch.Generator().manual_seed(m)
    w, x = torch.randn(300, 96, generator=g), torch.randn(m, 96, generator=g)
    bias = torch.randn(300, generator=g)
    with torch.inference_mode():
        got = torch.ops.kiln.linear_fp32(x, w, bias)
    torch.testing.assert_close(got, _ref(x, w, bias), rtol=1e-5, atol=1e-4)
