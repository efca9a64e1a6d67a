"""On a CUDA device: the LoRA and MoE Triton kernels, compiled, against the naive per-token
loops the `interpret` tier checks them with (same cases, on the GPU)."""
import pytest
import torch

pytestmark = pytest.mark.gpu

triton = pytest.importorskip("triton")


def _cuda(args):
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("shape", [dict(), dict(T=1, S=1, ranks=(8,)),
                                   dict(T=37, S=4, R=8, K=67, N=13, ranks=(8, 1, 3, 8)),
                                   dict(T=300, S=3, R=16, K=576, N=1536, ranks=(16, 8, 4))])
def test_lora_triton_matches_naive_loop(shape):
    from kiln.plugins.lora import triton_lora  # noqa: F401
    from tests.unit.test_lora_op import case, naive

    args = case(**shape)
    out = torch.ops.kiln.lora_apply_triton(*_cuda(args))
    assert out.is_cuda and out.dtype == torch.float32
    want = naive(*args)
    assert (out.cpu().double() - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())


def test_lora_triton_rows_without_adapter_keep_y():
    from kiln.plugins.lora import triton_lora  # noqa: F401
    from tests.unit.test_lora_op import case

    y, x, _, a, b, scales = case(T=5)
    slots = torch.tensor([-1, 1, -1, -1, 0])
    out = torch.ops.kiln.lora_apply_triton(*_cuda((y, x, slots, a, b, scales))).cpu()
    assert torch.equal(out[slots < 0], y[slots < 0])


@pytest.mark.parametrize("shape", [dict(T=20), dict(T=5, E=16, k=4, H=35, inter=9),
                                   dict(T=1, k=1), dict(T=256, E=8, k=2, H=512, inter=1024)])
def test_moe_triton_matches_naive_loop(shape):
    from kiln.plugins.moe import triton_experts  # noqa: F401
    from tests.unit.test_moe_op import case, naive

    args = case(**shape)
    out = torch.ops.kiln.moe_experts_triton(*_cuda(args))
    assert out.is_cuda and out.dtype == torch.float32
    want = naive(*args)
    assert (out.cpu().double() - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())


def test_moe_triton_batch_invariant_on_the_gpu():
    from kiln.plugins.moe import triton_experts  # noqa: F401
    from tests.unit.test_moe_op import case

    x, ids, weights, w13, w2 = _cuda(case(T=32))
    batch = torch.ops.kiln.moe_experts_triton(x, ids, weights, w13, w2)
    for t in (0, 17, 31):
        alone = torch.ops.kiln.moe_experts_triton(x[t:t + 1], ids[t:t + 1], weights[t:t + 1],
                                                  w13, w2)
        assert torch.equal(alone[0], batch[t]), t
