"""The mixture-of-experts MLP block: a router and stacked SwiGLU experts (kiln::moe_experts).

    gate  nn.Linear(hidden, E)               router logits, softmax -> top-k (plugins/moe/ops.route)
    w13   [E * 2 * inter, hidden]            expert e's rows [e*2I, (e+1)*2I): its gate then up
    w2    [E * hidden, inter]                expert e's rows [e*H, (e+1)*H): its down projection

The experts are stored stacked along rows as 2-D matrices (the weight tables concatenate the
per-expert HF tensors along dim 0, and a per-row quantization of the stack is the per-expert
one); forward views them [E, rows, K] for the op. Used by TransformerBlock for the layers in
cfg.sparse_layers (Mixtral: every layer; Qwen3-MoE: decoder_sparse_step, mlp_only_layers).
"""
from __future__ import annotations

import torch
from torch import nn

from kiln.builder.arch.config import DecoderConfig
from kiln.plugins.moe import ops as moe_ops  # registers kiln::moe_experts


class MoE(nn.Module):
    """Top-k routed SwiGLU experts; the router stays an nn.Linear (quantized like any)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.experts_per_token
        self.inter, self.hidden = cfg.moe_intermediate_size, cfg.hidden_size
        self.normalize = cfg.normalize_topk
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        e, i, h = self.num_experts, self.inter, self.hidden
        self.w13 = nn.Parameter(torch.empty(e * 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e * h, i))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = moe_ops.route(self.gate(x), self.top_k, self.normalize)  # [T, k]
        e, i, h = self.num_experts, self.inter, self.hidden
        return torch.ops.kiln.moe_experts(x, ids, weights, self.w13.view(e, 2 * i, h),
                                          self.w2.view(e, h, i))
