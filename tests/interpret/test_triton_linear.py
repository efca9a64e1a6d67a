"""kiln::linear_{int8,int4,fp8}_triton (the GPU kernels) under Triton's interpreter, on CPU
tensors, against the dequantize-then-matmul references: the CPU kernels' shapes (SmolLM2's
layers, odd sizes with bias, K not a multiple of 32, bf16 activations, the lm_head)."""
import pytest
import torch

pytest.importorskip("triton")

from kiln.plugins.quant import formats, triton_linear  # noqa: E402
from tests.helpers import (K_NOT_MULTIPLE_OF_32, ODD_BATCHES, ODD_SHAPES,  # noqa: E402
                           SMOLLM2_SHAPES, check_quant_linear)

pytestmark = pytest.mark.interpret

SCHEMES = [("int8", None), ("fp8", None), ("int4", 32), ("int4", 64)]


def test_kernels_are_interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(triton_linear._linear_per_channel_kernel, InterpretedFunction)
    assert isinstance(triton_linear._linear_int4_kernel, InterpretedFunction)


def _check(x, w, scheme, gs, bias=None):
    check_quant_linear(triton_linear.quant_linear, x, w, scheme, gs, bias)


@pytest.mark.parametrize("scheme,gs", SCHEMES)
@pytest.mark.parametrize("n,k", SMOLLM2_SHAPES)
@pytest.mark.parametrize("m", [1, 33])
def test_matches_reference_smollm2_shapes(m, n, k, scheme, gs):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    _check(torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05, scheme, gs)


@pytest.mark.parametrize("scheme,gs", [("int8", None), ("fp8", None), ("int4", 128)])
@pytest.mark.parametrize("m", ODD_BATCHES)
@pytest.mark.parametrize("n,k", ODD_SHAPES)
def test_matches_reference_odd_shapes_with_bias(m, n, k, scheme, gs):
    g = torch.Generator().manual_seed(m + n + k)
    _check(torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), scheme, gs,
           bias=torch.randn(n, generator=g))


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("k", K_NOT_MULTIPLE_OF_32)
def test_k_not_multiple_of_32(m, k, scheme):
    g = torch.Generator().manual_seed(k)
    _check(torch.randn(m, k, generator=g), torch.randn(19, k, generator=g), scheme, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme,gs", [("int8", None), ("fp8", None), ("int4", 64)])
def test_half_precision_activations(dtype, scheme, gs):
    g = torch.Generator().manual_seed(17)
    x = torch.randn(17, 576, generator=g).to(dtype)
    _check(x, torch.randn(960, 576, generator=g) * 0.05, scheme, gs)


def test_lm_head():
    """SmolLM2's 49152 x 576 lm_head (int8 per row in quantized plans), one decode row."""
    g = torch.Generator().manual_seed(1)
    _check(torch.randn(1, 576, generator=g), torch.randn(49152, 576, generator=g) * 0.05,
           "int8", None)


def test_adversarial_weights():
    w = torch.randn(64, 256) * 0.05
    w[0] = 0
    w[3, 5] = 300.0
    w[7] *= 1e-30
    x = torch.randn(5, 256)
    for scheme, gs in SCHEMES:
        _check(x, w, scheme, gs)


def test_empty_batch():
    qw = formats.quantize(torch.randn(16, 64), "int8")
    assert triton_linear.quant_linear(torch.randn(0, 64), qw).shape == (0, 16)


def test_rejects_bad_arguments():
    qw = formats.quantize(torch.randn(8, 192), "int4", 64)
    with pytest.raises(RuntimeError, match="group_size"):
        torch.ops.kiln.linear_int4_triton(torch.randn(1, 192), qw.qweight, qw.scales, qw.zeros,
                                          128, None)
    q8 = formats.quantize(torch.randn(8, 64), "int8")
    with pytest.raises(RuntimeError, match="K=65"):
        torch.ops.kiln.linear_int8_triton(torch.randn(2, 65), q8.qweight, q8.scales, None)
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        torch.ops.kiln.linear_fp8_triton(torch.randn(2, 64), q8.qweight, q8.scales, None)
    with pytest.raises(ValueError, match="bf16"):
        triton_linear.quant_linear(torch.randn(2, 64), formats.quantize(torch.randn(8, 64), "bf16"))
