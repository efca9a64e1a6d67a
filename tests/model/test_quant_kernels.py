"""The compiled CPU kernels of kiln::linear_{int8,int4,fp8,bf16} against their references, and
QuantLinear through torch.export / AOTInductor (model tier: the kernels are compiled from C++)."""
import pytest
import torch
from torch import nn

from kiln.plugins.quant import formats, kernels, ops
from kiln.plugins.quant.modules import QuantLinear
from tests.helpers import (K_NOT_MULTIPLE_OF_32, ODD_BATCHES, ODD_SHAPES, SMOLLM2_SHAPES,
                           check_quant_linear, load_package, rows16_digits_bound)

pytestmark = pytest.mark.model

BATCHES = [1, 3, 17, 32, 33]


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels():
    kernels.load()


def _check(x, w, scheme, gs, bias=None):
    check_quant_linear(ops.quant_linear, x, w, scheme, gs, bias)   # the CPU kernel


def test_kernels_are_registered_for_cpu():
    for name in ("linear_int8", "linear_int4", "linear_fp8", "linear_bf16", "linear_int4_rows16"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kiln::{name}", "CPU")


@pytest.mark.parametrize("scheme,gs", [("int8", None), ("fp8", None), ("int4", 32), ("int4", 64),
                                       ("bf16", None), ("int4_a8", None)])
@pytest.mark.parametrize("n,k", SMOLLM2_SHAPES)
@pytest.mark.parametrize("m", BATCHES)
def test_kernel_matches_reference_smollm2_shapes(m, n, k, scheme, gs):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    _check(torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05, scheme, gs)


@pytest.mark.parametrize("scheme,gs", [("int8", None), ("fp8", None), ("int4", 128),
                                       ("bf16", None)])
@pytest.mark.parametrize("m", ODD_BATCHES)
@pytest.mark.parametrize("n,k", ODD_SHAPES)
def test_kernel_matches_reference_odd_shapes_with_bias(m, n, k, scheme, gs):
    g = torch.Generator().manual_seed(m + n + k)
    _check(torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), scheme, gs,
           bias=torch.randn(n, generator=g))


@pytest.mark.parametrize("scheme", ["int8", "fp8", "bf16"])
@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("k", K_NOT_MULTIPLE_OF_32)
def test_int8_fp8_kernel_k_not_multiple_of_32(m, k, scheme):
    g = torch.Generator().manual_seed(k)
    _check(torch.randn(m, k, generator=g), torch.randn(19, k, generator=g), scheme, None)


@pytest.mark.parametrize("scheme,gs", [("int8", None), ("fp8", None), ("int4", 64),
                                       ("bf16", None), ("int4_a8", None)])
@pytest.mark.parametrize("m", [1, 17])
def test_kernel_bf16_activations(m, scheme, gs):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 576, generator=g).to(torch.bfloat16)
    _check(x, torch.randn(960, 576, generator=g) * 0.05, scheme, gs)


@pytest.mark.parametrize("scheme,gs", [("int8", None), ("fp8", None), ("int4", 64),
                                       ("bf16", None)])
@pytest.mark.parametrize("m", [1, 33])
def test_kernel_matches_reference_lm_head(m, scheme, gs):
    g = torch.Generator().manual_seed(1)
    _check(torch.randn(m, 576, generator=g), torch.randn(49152, 576, generator=g) * 0.05,
           scheme, gs)


@pytest.mark.parametrize("n,k", [(37, 576), (64, 1536), (130, 100)])
def test_bf16_kernel_at_prefill_rows_is_batch_invariant(n, k):
    """A prefill's rows (past a panel of x: 224 rows at K = 576; past a chunk of 256 rows on the
    broadcast GEMM) match the reference, and a row of 8+ gets the same bits whichever batch of
    8+ rows it is computed in."""
    g = torch.Generator().manual_seed(n + k)
    x, w = torch.randn(300, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    _check(x, w, "bf16", None, bias=b)
    qw = formats.quantize(w, "bf16")
    out = ops.quant_linear(x, qw, b)
    for size in (8, 9):   # 8: the broadcast GEMM's half blocks of x rows, where it runs
        top = 300 // size * size
        parts = torch.cat([ops.quant_linear(x[i:i + size], qw, b) for i in range(0, top, size)])
        assert torch.equal(out[:top], parts), size


def test_kernel_adversarial_weights():
    w = torch.randn(64, 256) * 0.05
    w[0] = 0
    w[3, 5] = 300.0
    w[7] *= 1e-30
    x = torch.randn(5, 256)
    for scheme, gs in [("int8", None), ("fp8", None), ("int4", 32), ("bf16", None)]:
        _check(x, w, scheme, gs)


def test_empty_batch():
    qw = formats.quantize(torch.randn(16, 64), "int8")
    assert ops.quant_linear(torch.randn(0, 64), qw).shape == (0, 16)


def test_kernel_rejects_group_size_not_dividing_k():
    qw = formats.quantize(torch.randn(8, 192), "int4", 64)
    with pytest.raises(RuntimeError, match="group_size"):
        torch.ops.kiln.linear_int4(torch.randn(1, 192), qw.qweight, qw.scales, qw.zeros, 128, None)


def test_kernel_rejects_wrong_k():
    qw = formats.quantize(torch.randn(8, 64), "int8")
    with pytest.raises(RuntimeError, match="K="):
        torch.ops.kiln.linear_int8(torch.randn(2, 65), qw.qweight, qw.scales, None)


class _Tiny(nn.Module):
    def __init__(self, scheme, gs):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        l1, l2 = nn.Linear(64, 96), nn.Linear(96, 64, bias=False)
        for lin in (l1, l2):
            nn.init.normal_(lin.weight, std=0.1, generator=g)
        self.l1 = QuantLinear.from_linear(l1, scheme, gs)
        self.l2 = QuantLinear.from_linear(l2, scheme, gs,
                                          input_scale=torch.rand(96, generator=g) + 0.5)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


@pytest.mark.parametrize("scheme,gs", [("int8", None), ("fp8", None), ("int4", 32),
                                       ("bf16", None)])
def test_quant_linear_exports_and_runs(scheme, gs):
    m = _Tiny(scheme, gs).eval()
    x = torch.randn(5, 64)
    tokens = torch.export.Dim("tokens", min=1, max=256)
    ep = torch.export.export(m, (x,), dynamic_shapes=({0: tokens},))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert f"kiln.linear_{scheme}.default" in targets
    for rows in (1, 5, 33):
        xi = torch.randn(rows, 64)
        torch.testing.assert_close(ep.module()(xi), m(xi))


def test_quant_linear_matches_float_linear():
    lin = nn.Linear(128, 64)
    x = torch.randn(3, 128)
    q = QuantLinear.from_linear(lin, "int8")
    torch.testing.assert_close(q(x), lin(x), rtol=0.02, atol=0.02)
    s = torch.rand(128) + 0.5                       # AWQ input scale keeps the product
    qs = QuantLinear.from_linear(lin, "int8", input_scale=s)
    torch.testing.assert_close(qs(x), lin(x), rtol=0.02, atol=0.02)


def test_quant_linear_compiles_with_aoti(tmp_path):
    m = _Tiny("int4", 32).eval()
    x = torch.randn(5, 64)
    tokens = torch.export.Dim("tokens", min=1, max=256)
    ep = torch.export.export(m, (x,), dynamic_shapes=({0: tokens},))
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "q.pt2"))
    runner = load_package(pkg)
    for rows in (1, 17):
        xi = torch.randn(rows, 64)
        torch.testing.assert_close(runner(xi), m(xi), rtol=1e-4, atol=1e-4)


def _check_a8(x, w, bias=None):
    qw = formats.quantize(w, "int8")
    out = ops.quant_linear(x, qw, bias, activations="int8")     # the CPU kernel
    ref = ops.linear_int8_a8_reference(x, qw.qweight, qw.scales, bias)
    assert out.shape == ref.shape and out.dtype == x.dtype
    scale = ref.float().abs().max().item() + 1e-6
    err = (out.float() - ref.float()).abs().max().item()
    # integer dot products: only the float epilogue may round differently
    assert err <= 1e-6 * scale, f"x{tuple(x.shape)} w{tuple(w.shape)}: max err {err:.3g}"
    return out


@pytest.mark.parametrize("n,k", SMOLLM2_SHAPES + [(37, 100), (1, 64), (130, 200), (181, 128)])
@pytest.mark.parametrize("m", BATCHES)
def test_w8a8_kernel_matches_reference(m, n, k):
    g = torch.Generator().manual_seed(m * 3 + n + k)
    x = torch.randn(m, k, generator=g)
    x[0, :3] = 0                                     # ties and zeros quantize like the reference
    _check_a8(x, torch.randn(n, k, generator=g) * 0.05, bias=torch.randn(n, generator=g))


def test_w8a8_zero_rows_and_extremes():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 576, generator=g)
    x[1] = 0                                         # scale 1, all codes 0
    x[2] *= 1e4                                      # large values: saturated codes, no overflow
    x[3, 7] = 1e6                                    # one outlier dominates the row's scale
    out = _check_a8(x, torch.randn(960, 576, generator=g))
    assert (out[1] == 0).all()


def test_w8a8_is_close_to_float_linear():
    """W8A8 error stays near int8 weight-only's: per-row activation scales keep it small."""
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(32, 576, generator=g), torch.randn(1536, 576, generator=g) * 0.05
    qw = formats.quantize(w, "int8")
    exact = x @ w.T
    a8 = ops.quant_linear(x, qw, None, activations="int8")
    rel = ((a8 - exact).norm() / exact.norm()).item()
    assert rel < 0.02, rel


@pytest.mark.parametrize("scheme,gs", [("int8", None), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("m", [1, 2, 3, 7])
def test_decode_digits_precision_with_an_outlier_channel(m, scheme, gs):
    """The VNNI decoders hold x as three int8 digits of fixed point per row (at most
    max|x| / (2 * 127 * 128^2) off each element): with one channel 1000x the others, each
    output stays within that bound times the row's sum |w| of the float product."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 1536, generator=g)
    x[:, 17] = 1000.0
    w = torch.randn(576, 1536, generator=g) * 0.05
    qw = formats.quantize(w, scheme, gs)
    out = ops.quant_linear(x, qw)
    wd = formats.dequantize(qw)
    ref = x.double() @ wd.double().T
    bound = (x.abs().amax(dim=1, keepdim=True).double() / (2 * 127 * 128 ** 2)) * \
        wd.double().abs().sum(dim=1)[None, :]
    slack = 1e-6 * ref.abs().amax()                  # float32 accumulation
    assert ((out.double() - ref).abs() <= bound + slack).all()


@pytest.mark.parametrize("m", [1, 2, 3, 7, 33])
def test_int4_rows16_digits_precision_with_an_outlier_channel(m):
    """kiln::linear_int4_rows16 holds each group of 32 of x as two int8 digits of fixed point
    (at most max|x of the group| / (2 * 127 * 128) off each element): with one channel 1000x
    the others, each output stays within that bound times |w - group min|, summed over the
    row."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 1536, generator=g)
    x[:, 17] = 1000.0
    w = torch.randn(576, 1536, generator=g) * 0.05
    qw = formats.quantize(w, "int4_a8")
    out = ops.quant_linear(x, qw)
    wd = formats.dequantize(qw).double()
    ref = x.double() @ wd.T
    bound = rows16_digits_bound(x, qw)
    slack = 1e-6 * ref.abs().amax()                  # float32 accumulation
    err = (out.double() - ref).abs()
    assert (err <= bound + slack).all()
    # the other groups keep their own precision: far tighter than a per-row scale would give
    row_bound = (x.abs().amax(dim=1, keepdim=True).double() / (2 * 127 * 128)
                 * wd.abs().sum(dim=1)[None, :])
    assert (err < 0.1 * row_bound).all()


@pytest.mark.parametrize("op", ["linear_int4_a8", "linear_int4_rows16"])
def test_int4_a8_activation_groups_of_zeros_ties_and_extremes(op):
    """The per-group quantization of x (vectorized: one row of x quantizes on one thread
    before the GEMV forks) matches the reference's: a group of zeros (scale 1, no digits),
    halves that round to even, values near float32's limit, one outlier in a group."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, 576, generator=g)
    x[0, 32:64] = 0
    ties = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5] * 4)
    x[1, 64:96] = ties                              # max 127: scale 1, x / s exactly .5
    x[2] *= 1e30                                    # no overflow in the scales or the sums
    x[3, 7] = 1e6                                   # one group dominated by one value
    w = torch.randn(960, 576, generator=g) * 0.05
    q = formats.quantize(w, "int4_a8")
    out = getattr(torch.ops.kiln, op)(x, q.qweight, q.scales, q.zeros, None)
    ref = getattr(ops, f"{op}_reference")(x, q.qweight, q.scales, q.zeros, None)
    assert torch.isfinite(out).all()
    scale = ref.abs().amax(dim=1, keepdim=True)
    bound = 0 if op == "linear_int4_a8" else rows16_digits_bound(x, q)
    excess = (out - ref).abs().double() - bound - 2e-5 * scale
    assert (excess <= 0).all(), excess.amax(dim=1) / scale[:, 0]


@pytest.mark.parametrize("k,n", [(1, 19), (5, 3), (12, 1), (64, 7), (576, 960)])
def test_int8_and_w8a8_at_many_rows_on_any_shape(k, n):
    """From 4 or 8 (W8A8) or 8 (int8) rows of x the int8 kernels go through the batched GEMMs
    (int8_gemm.h; oneDNN's _int_mm for the shapes those do not take): the same results as the
    references on every shape, tiny K and N included (a [19, 1] weight's transpose once gave
    garbage on _int_mm, with no error)."""
    g = torch.Generator().manual_seed(k * 1000 + n)
    x, w = torch.randn(17, k, generator=g), torch.randn(n, k, generator=g)
    q = formats.quantize(w, "int8")
    ref = ops.linear_int8_a8_reference(x, q.qweight, q.scales, None)
    out = ops.quant_linear(x, q, None, activations="int8")
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max().clamp_min(1e-6)
    ref = x @ (q.qweight.float() * q.scales[:, None]).t()
    out = ops.quant_linear(x, q, None)
    assert (out - ref).abs().max() <= 2e-5 * ref.abs().max().clamp_min(1e-6)
