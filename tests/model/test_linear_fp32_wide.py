"""kiln::linear_fp32 on a vocabulary-wide weight (the lm_head): from 8 to 64 rows of x the
kernel hands BLAS out^T = W x^T; the result must be x W^T, and the same bits from 16 rows."""
import pytest
import torch

from kiln.plugins.quant import kernels

pytestmark = pytest.mark.model


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    kernels.load()


@pytest.mark.parametrize("m", [7, 8, 16, 32, 64, 65])
def test_wide_output_matches_x_wt(m):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(16384, 96, generator=g)
    x = torch.randn(m, 96, generator=g)
    got = torch.ops.kiln.linear_fp32(x, w, None)
    ref = x @ w.t()
    assert got.shape == (m, 16384) and got.is_contiguous()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    bias = torch.randn(16384, generator=g)      # with a bias: the other BLAS path, same sums
    torch.testing.assert_close(torch.ops.kiln.linear_fp32(x, w, bias), ref + bias,
                               rtol=1e-5, atol=1e-4)
