"""The experts of a mixture-of-experts layer as nn.Modules: float (`Experts`) and packed
(`QuantExperts`, the quant plugin's formats); forward calls a kiln::moe_* op.

Both hold each projection of every expert stacked along rows, 2-D:

    w13  [E * 2I, H]   expert e's rows [e*2I, (e+1)*2I): its gate rows then its up rows
    w2   [E * H, I]    expert e's rows [e*H, (e+1)*H): its down projection

so a per-row (int8, fp8) or per-row-group (int4) quantization of the stack is exactly the
per-expert one (plugins/quant/formats.py), and forward views them [E, rows, ...] for the op.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kiln.plugins.moe import ops  # noqa: F401  (registers the kiln::moe_* ops)
from kiln.plugins.quant import formats

SCHEMES = ("int8", "int4", "fp8", "bf16")   # the packed formats the experts ops read


class Experts(nn.Module):
    """E SwiGLU experts with float32 weights (Parameters, filled by the weight tables)."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.w13 = nn.Parameter(torch.empty(num_experts * 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts * hidden, inter))

    def forward(self, x, topk_ids, topk_weights):
        e, i, h = self.num_experts, self.inter, self.hidden
        return float_experts_op(x.device)(x, topk_ids, topk_weights, self.w13.view(e, 2 * i, h),
                                          self.w2.view(e, h, i))


def float_experts_op(device: torch.device):
    """The experts pass over float experts for x's device: on CUDA the Triton kernels
    (kiln::moe_experts_triton, which AOTInductor compiles into the plan), elsewhere
    kiln::moe_experts (the CPU kernel once loaded). Chosen when the model is traced."""
    if device.type == "cuda":
        from kiln.plugins.moe import triton_experts  # noqa: F401  (imports triton)

        return torch.ops.kiln.moe_experts_triton
    return torch.ops.kiln.moe_experts


def _view(t: Optional[torch.Tensor], e: int):
    return None if t is None else t.view(e, t.shape[0] // e, *t.shape[1:])


class QuantExperts(nn.Module):
    """Experts with packed weights (buffers): int8 / fp8 per row, int4 per group of rows'
    columns, or bf16 (kiln::moe_experts on bfloat16 weights)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, w13: formats.QuantizedWeight,
                 w2: formats.QuantizedWeight, activations: str = "float"):
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.scheme, self.group_size = w13.scheme, w13.group_size or 0
        if activations == "int8" and not (self.scheme == "int8" or (
                self.scheme == "int4" and self.group_size == 32)):
            raise ValueError(f"int8 activations need int8 experts (W8A8) or int4 experts at "
                             f"group_size 32 (W4A8), not {self.scheme} {self.group_size or ''}")
        self.activations = activations
        for name, qw in (("w13", w13), ("w2", w2)):
            self.register_buffer(f"{name}_qweight", qw.qweight)
            self.register_buffer(f"{name}_scales", qw.scales)
            self.register_buffer(f"{name}_zeros", qw.zeros)

    @classmethod
    def from_experts(cls, experts: Experts, scheme: str, group_size: Optional[int] = None,
                     activations: str = "float") -> "QuantExperts":
        """Quantize float experts (round to nearest) to one of SCHEMES; activations "int8":
        W8A8 (int8) or W4A8 (int4 at group 32)."""
        if scheme not in SCHEMES:
            raise ValueError(f"experts cannot be stored {scheme!r}; allowed: {SCHEMES}")
        q = [formats.quantize(w.detach().float(), scheme, group_size)
             for w in (experts.w13, experts.w2)]
        return cls(experts.num_experts, experts.hidden, experts.inter, *q, activations)

    def forward(self, x, topk_ids, topk_weights):
        e = self.num_experts
        w13, w2 = _view(self.w13_qweight, e), _view(self.w2_qweight, e)
        if self.scheme == "bf16":
            return float_experts_op(x.device)(x, topk_ids, topk_weights, w13, w2)
        op = (torch.ops.kiln.moe_experts_a8 if self.activations == "int8"
              else torch.ops.kiln.moe_experts_quant)
        return op(
            x, topk_ids, topk_weights, w13, _view(self.w13_scales, e), _view(self.w13_zeros, e),
            w2, _view(self.w2_scales, e), _view(self.w2_zeros, e), self.group_size)

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        a = ", int8 activations" if self.activations == "int8" else ""
        return f"{self.num_experts} experts, {self.hidden} <-> {self.inter}, {self.scheme}{g}{a}"
