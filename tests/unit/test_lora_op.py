"""kiln::lora_apply (reference and compiled CPU kernel, at every ISA level this host runs)
against a naive per-token loop: mixed slots, rows without an adapter, zero-padded ranks."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

from kiln.plugins import isa
from kiln.plugins.lora import kernels, ops

pytestmark = pytest.mark.unit


def naive(y, x, slots, a, b, scales, ranks=None):
    """One token at a time in float64, each adapter at its own rank (`ranks`: slot -> r)."""
    out = y.double().clone()
    for t in range(x.shape[0]):
        s = int(slots[t])
        if s < 0:
            continue
        r = a.shape[1] if ranks is None else ranks[s]
        h = a[s, :r].double() @ x[t].double()
        out[t] += float(scales[s]) * (b[s, :, :r].double() @ h)
    return out


def case(T=24, S=3, R=16, K=40, N=56, ranks=(16, 8, 4), seed=0, slots=None):
    """A stack of S adapters of the given ranks zero-padded to R, tokens of mixed slots
    (-1 included)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(T, K, generator=g), torch.randn(T, N, generator=g)
    a, b = torch.zeros(S, R, K), torch.zeros(S, N, R)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, K, generator=g) / K ** 0.5
        b[s, :, :r] = torch.randn(N, r, generator=g)
    if slots is None:
        slots = torch.randint(-1, S, (T,), generator=g)
    scales = torch.tensor([0.5, 2.0, 1.25, 1.0][:S])
    return y, x, slots, a, b, scales


@pytest.fixture(scope="module")
def cpu_kernel():
    kernels.load()


def _close(got, want, tol=1e-4):
    assert (got.double() - want).abs().max().item() < tol


def test_reference_matches_naive_loop():
    args = case()
    assert {-1, 0, 1, 2} <= set(args[2].tolist())
    _close(ops.lora_apply_reference(*args), naive(*args, ranks={0: 16, 1: 8, 2: 4}))


@pytest.mark.parametrize("shape", [dict(), dict(T=1, S=1, ranks=(8,)),
                                   dict(T=37, S=4, R=8, K=67, N=13, ranks=(8, 1, 3, 8))])
def test_cpu_kernel_matches_naive_loop(cpu_kernel, shape):
    args = case(**shape)
    y = args[0].clone()
    out = torch.ops.kiln.lora_apply(*args)
    _close(out, naive(*args))
    assert torch.equal(args[0], y)            # y is not written


def test_rows_without_adapter_keep_y_exactly(cpu_kernel):
    y, x, _, a, b, scales = case(T=6)
    slots = torch.tensor([-1, 2, -1, 0, -1, -1])
    out = torch.ops.kiln.lora_apply(y, x, slots, a, b, scales)
    none = slots < 0
    assert torch.equal(out[none], y[none]) and not torch.equal(out[~none], y[~none])
    out = torch.ops.kiln.lora_apply(y, x, torch.full((6,), -1), a, b, scales)
    assert torch.equal(out, y)


def test_int32_slots_and_bf16_activations(cpu_kernel):
    y, x, slots, a, b, scales = case(T=9)
    out = torch.ops.kiln.lora_apply(y.bfloat16(), x.bfloat16(), slots.int(), a, b, scales)
    want = naive(y.bfloat16().float(), x.bfloat16().float(), slots, a, b, scales)
    assert out.dtype == torch.bfloat16 and (out.double() - want).abs().max() < 0.1


@pytest.mark.parametrize("fn", ["kernel", "reference"])
def test_bfloat16_adapters_are_widened_exactly(cpu_kernel, fn):
    # bfloat16 A and B give float32's result on the same (rounded) values, on every row shape
    op = torch.ops.kiln.lora_apply if fn == "kernel" else ops.lora_apply_reference
    for shape in (dict(), dict(T=37, S=4, R=8, K=67, N=13, ranks=(8, 1, 3, 8))):
        y, x, slots, a, b, scales = case(**shape)
        a16, b16 = a.bfloat16(), b.bfloat16()
        out = op(y, x, slots, a16, b16, scales)
        assert out.dtype == torch.float32
        _close(out, naive(y, x, slots, a16.float(), b16.float(), scales))
        assert (out.double() - naive(y, x, slots, a, b, scales)).abs().max() > 1e-4
    with pytest.raises((RuntimeError, ValueError), match="both float32 or both bfloat16"):
        op(y, x, slots, a16, b, scales)


def test_cpu_kernel_is_batch_invariant(cpu_kernel):
    y, x, slots, a, b, scales = case(T=30)
    full = torch.ops.kiln.lora_apply(y, x, slots, a, b, scales)
    for t in (0, 7, 29):
        one = torch.ops.kiln.lora_apply(y[t:t + 1], x[t:t + 1], slots[t:t + 1], a, b, scales)
        assert torch.equal(one[0], full[t])


@pytest.mark.parametrize("fn", ["kernel", "reference"])
def test_refuses_a_slot_out_of_range_and_mismatched_shapes(cpu_kernel, fn):
    op = torch.ops.kiln.lora_apply if fn == "kernel" else ops.lora_apply_reference
    y, x, slots, a, b, scales = case(T=4, S=2, ranks=(4, 4))
    with pytest.raises((RuntimeError, ValueError), match="slot"):
        op(y, x, torch.tensor([0, 2, -1, 1]), a, b, scales)
    with pytest.raises((RuntimeError, ValueError), match="do not fit"):
        op(y, x, slots, a[:, :, :-1], b, scales)


RUN_LEVEL = r"""
import sys, torch
from kiln.plugins import isa
from kiln.plugins.lora import kernels
from tests.unit.test_lora_op import case, naive
lib = kernels.build(isa.level(sys.argv[1]))
kernels.load(lib)
from kiln.plugins.cpp_build import kernel_path
print(kernel_path(lib))
for shape in (dict(), dict(T=37, S=4, R=8, K=67, N=13, ranks=(8, 1, 3, 8))):
    args = case(**shape)
    err = (torch.ops.kiln.lora_apply(*args).double() - naive(*args)).abs().max().item()
    assert err < 1e-4, err
    y, x, slots, a, b, scales = args
    a, b = a.bfloat16(), b.bfloat16()
    err = (torch.ops.kiln.lora_apply(y, x, slots, a, b, scales).double()
           - naive(y, x, slots, a.float(), b.float(), scales)).abs().max().item()
    assert err < 1e-4, ("bfloat16 adapters", err)
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 ISA levels")
@pytest.mark.parametrize("level", [n for n in isa.LEVEL_NAMES if isa.LEVEL_NAMES.index(n)
                                   <= isa.LEVEL_NAMES.index(isa.host_level().name)])
def test_cpu_kernel_at_each_isa_level(level):
    """Each level's library in its own process (two builds register the same op)."""
    r = subprocess.run([sys.executable, "-c", RUN_LEVEL, level], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    bits = isa.level(level).vector_bits
    assert (f"{bits}-bit" in r.stdout) if bits else ("scalar" in r.stdout)
