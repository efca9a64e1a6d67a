"""nn.Modules that stand in for nn.Linear with quantized weights; forward calls a kiln op.

The packed tensors are buffers (they are not trained), so torch.export lifts them as
constants of the graph and AOTInductor embeds or loads them like any weight. An optional
`input_scale` [K] (from AWQ-style calibration) multiplies x before the op; Inductor fuses
that multiply into whatever produced x.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kiln.plugins.quant import formats, ops


class QuantLinear(nn.Module):
    """y = x @ dequant(W).T + bias, with W in one of formats.SCHEMES."""

    def __init__(self, qw: formats.QuantizedWeight, bias: Optional[torch.Tensor] = None,
                 input_scale: Optional[torch.Tensor] = None, activations: str = "float"):
        super().__init__()
        int8_schemes = ("int8", "int4_a8")      # what W8A8 / W4A8 multiply int8 x with
        if activations not in ops.ACTIVATIONS or (
                activations == "int8" and qw.scheme not in int8_schemes):
            raise ValueError(f"activations={activations!r} with {qw.scheme} weights; allowed: "
                             "float, or int8 with int8 (W8A8) or int4_a8 (W4A8) weights")
        self.activations = activations
        self.scheme = qw.scheme
        self.group_size = qw.group_size
        self.out_features, self.in_features = qw.shape
        self.register_buffer("qweight", qw.qweight)
        self.register_buffer("scales", qw.scales)
        self.register_buffer("zeros", qw.zeros)                       # int4 only, else None
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.register_buffer("input_scale", input_scale)              # [K] or None

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str, group_size: int | None = None,
                    input_scale: Optional[torch.Tensor] = None, activations: str = "float"
                    ) -> "QuantLinear":
        """Quantize an nn.Linear. With input_scale s (AWQ), W*diag(1/s) is what is quantized
        and x*s what is multiplied, so the product is unchanged before rounding."""
        w = linear.weight.detach()          # float32, or bf16 (quantize widens it by rows)
        if input_scale is not None:
            w = w.float() / input_scale[None, :]
        qw = formats.quantize(w, scheme, group_size)
        return cls(qw, linear.bias, input_scale, activations)

    def quantized_weight(self) -> formats.QuantizedWeight:
        return formats.QuantizedWeight(self.scheme, self.qweight, self.scales, self.zeros,
                                       self.group_size, (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.input_scale is not None:
            x2 = x2 * self.input_scale.to(x2.dtype)
        y = ops.quant_linear(x2, self.quantized_weight(), self.bias, self.activations)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        a = ", awq" if self.input_scale is not None else ""
        a += ", int8 activations" if self.activations == "int8" else ""
        return f"{self.in_features} -> {self.out_features}, {self.scheme}{g}{a}"


class QuantEmbedding(nn.Module):
    """nn.Embedding with an int8 per-row table, out[t] = qweight[ids[t]] * scales[ids[t]], or
    a bf16 / fp32 table (scales None), out[t] = float(qweight[ids[t]]).

    Each is the linear format (int8 / bf16 / fp32) of the same [vocab, hidden] matrix, so a
    tied lm_head can run linear_int8 / linear_bf16 / linear_fp32 on these very buffers."""

    def __init__(self, qweight: torch.Tensor, scales: Optional[torch.Tensor]):
        super().__init__()
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.scheme = {torch.int8: "int8", torch.bfloat16: "bf16", torch.float32: "fp32"}[
            qweight.dtype]
        self.register_buffer("qweight", qweight)                      # int8/bf16/fp32 [V, H]
        self.register_buffer("scales", scales)                        # float32 [V] or None

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, scheme: str = "int8") -> "QuantEmbedding":
        qw = formats.quantize(emb.weight, scheme)
        return cls(qw.qweight, qw.scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.scales is None:
            return self.qweight[ids].float()                                 # [T, H] float32
        return self.qweight[ids].float() * self.scales[ids].unsqueeze(-1)   # [T, H] float32

    def extra_repr(self) -> str:
        what = "int8 per row" if self.scheme == "int8" else self.scheme
        return f"{self.num_embeddings}, {self.embedding_dim}, {what}"


__all__ = ["QuantEmbedding", "QuantLinear", "ops"]
