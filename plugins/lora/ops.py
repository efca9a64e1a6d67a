"""The `kiln::lora_apply` custom op: schema, fake (for export), pure-torch reference, and the
per-device choice of kernel.

One call adds the low-rank deltas of every token's adapter to a linear's output:

    y [T, N] (the base linear's output); x [T, K] (its input); slots [T] int64
    lora_a [S, R, K]; lora_b [S, N, R] (float32, or bfloat16 for both); scales [S] float32
    out[t] = y[t] + scales[s] * lora_b[s] @ (lora_a[s] @ x[t])   with s = slots[t] >= 0
    out[t] = y[t]                                                where slots[t] == -1

S adapter slots of one step, each of rank R = the plan's max_rank (an adapter of a lower rank
is zero-padded: its extra rows of A and columns of B are 0). Kernels group the tokens by slot
and make one pass over each active slot's A and B, never one per token. Each token's delta is
computed the same way whatever other tokens share the step (batch-invariant).

The reference is registered for CompositeExplicitAutograd (any device); the compiled CPU
kernel (csrc/lora_cpu.cpp, plugins.lora.kernels) is registered for CPU and takes precedence
once loaded; on CUDA models call kiln::lora_apply_triton (plugins/lora/triton_lora.py).
All compute in float32; the output has y's dtype.
"""
from __future__ import annotations

import torch

SCHEMA = ("lora_apply(Tensor y, Tensor x, Tensor slots, Tensor lora_a, Tensor lora_b, "
          "Tensor scales) -> Tensor")

_lib = torch.library.Library("kiln", "FRAGMENT")
_lib.define(SCHEMA)


def check_args(y, x, slots, lora_a, lora_b, scales) -> None:
    """ValueError naming the argument whose shape does not fit the others."""
    if x.dim() != 2 or y.dim() != 2 or lora_a.dim() != 3 or lora_b.dim() != 3:
        raise ValueError(f"kiln::lora_apply: y [T, N], x [T, K], lora_a [S, R, K], "
                         f"lora_b [S, N, R] expected; got {list(y.shape)}, {list(x.shape)}, "
                         f"{list(lora_a.shape)}, {list(lora_b.shape)}")
    s, r, k = lora_a.shape
    if x.shape[0] != y.shape[0] or tuple(slots.shape) != (x.shape[0],):
        raise ValueError(f"kiln::lora_apply: x {list(x.shape)}, y {list(y.shape)} and slots "
                         f"{list(slots.shape)} must have the same T rows")
    if k != x.shape[1] or tuple(lora_b.shape) != (s, y.shape[1], r):
        raise ValueError(f"kiln::lora_apply: lora_a {list(lora_a.shape)} and lora_b "
                         f"{list(lora_b.shape)} do not fit x {list(x.shape)} -> y "
                         f"{list(y.shape)}")
    if tuple(scales.shape) != (s,):
        raise ValueError(f"kiln::lora_apply: scales {list(scales.shape)}, [{s}] expected")
    if lora_a.dtype not in (torch.float32, torch.bfloat16) or lora_b.dtype != lora_a.dtype:
        raise ValueError(f"kiln::lora_apply: lora_a and lora_b both float32 or both bfloat16; "
                         f"got {lora_a.dtype} and {lora_b.dtype}")
    if slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"kiln::lora_apply: slots of dtype {slots.dtype}; int64 or int32")


def check_slots(slots: torch.Tensor, num_slots: int) -> None:
    """ValueError when a slot is neither -1 nor a slot of the stack."""
    if slots.numel() and (slots.min() < -1 or slots.max() >= num_slots):
        raise ValueError(f"kiln::lora_apply: slots must be -1 (no adapter) or in "
                         f"[0, {num_slots}); got min {int(slots.min())}, max {int(slots.max())}")


def lora_apply_reference(y, x, slots, lora_a, lora_b, scales) -> torch.Tensor:
    """Pure-torch pass: the tokens of each active slot gathered, its A and B applied once."""
    check_args(y, x, slots, lora_a, lora_b, scales)
    check_slots(slots, lora_a.shape[0])
    out = y.float().clone()
    xf = x.float()
    for s in torch.unique(slots[slots >= 0]).tolist():
        rows = (slots == s).nonzero().squeeze(1)
        h = xf[rows] @ lora_a[s].float().T                             # [n, R]
        out[rows] += scales[s].float() * (h @ lora_b[s].float().T)     # [n, N]
    return out.to(y.dtype)


_lib.impl("lora_apply", lora_apply_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("kiln::lora_apply")
def _lora_apply_fake(y, x, slots, lora_a, lora_b, scales):
    torch._check(lora_a.shape[2] == x.shape[1], lambda: "lora_apply: lora_a / x mismatch")
    torch._check(lora_b.shape[1] == y.shape[1], lambda: "lora_apply: lora_b / y mismatch")
    return torch.empty_like(y)

