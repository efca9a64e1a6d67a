"""The mixture-of-experts MLP block: a router and stacked SwiGLU experts (kiln::moe_experts).

    gate         Router(hidden, E)           router logits, softmax -> top-k (plugins/moe/ops.route)
    experts.w13  [E * 2 * inter, hidden]     expert e's rows [e*2I, (e+1)*2I): its gate then up
    experts.w2   [E * hidden, inter]         expert e's rows [e*H, (e+1)*H): its down projection

The experts (plugins/moe/modules.Experts) are stored stacked along rows as 2-D matrices: the
weight tables concatenate the per-expert HF tensors along dim 0, and the quantizer swaps
them for QuantExperts as it swaps nn.Linear for QuantLinear. Used by TransformerBlock for the layers in
cfg.sparse_layers (Mixtral: every layer; Qwen3-MoE: decoder_sparse_step, mlp_only_layers).
"""
from __future__ import annotations

import torch
from torch import nn

from kiln.builder.arch.config import DecoderConfig
from kiln.builder.arch.weights import Rule, pieces
from kiln.plugins.moe import ops as moe_ops  # registers kiln::moe_experts
from kiln.plugins.moe.modules import Experts


class Router(nn.Linear):
    """The router's linear. The quantizer leaves it in the model's float dtype (`quantize`
    False): it is E x hidden, a sliver of the layer, its argmax picks the experts, and its
    E outputs (8 on Mixtral) do not fit every packed format's tiles. vLLM and llama.cpp
    keep it unquantized too."""
    quantize = False


class MoE(nn.Module):
    """Top-k routed SwiGLU experts behind a float router."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.experts_per_token
        self.inter, self.hidden = cfg.moe_intermediate_size, cfg.hidden_size
        self.normalize = cfg.normalize_topk
        self.gate = Router(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(self.num_experts, self.hidden, self.inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = moe_ops.route(self.gate(x), self.top_k, self.normalize)  # [T, k]
        return self.experts(x, ids, weights)


def moe_rules(prefix: str, gate: str, w1: str, w3: str, w2: str) -> tuple[Rule, ...]:
    """The HF table of the sparse layers' router and stacked experts, from per-expert
    tensors under `prefix` (`{e}` is the expert index)."""
    p = f"model.layers.{{i}}.{prefix}."
    return (
        Rule("layers.{i}.feed_forward.gate.weight", pieces(p + gate), "sparse_layer"),
        Rule("layers.{i}.feed_forward.experts.w13", pieces(p + w1, p + w3), "sparse_layer"),
        Rule("layers.{i}.feed_forward.experts.w2", pieces(p + w2), "sparse_layer"),
    )


def dense_only(rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """A table with its MLP rules (feed_forward.*) restricted to the dense layers."""
    return tuple(Rule(r.target, r.pieces, "dense_layer") if ".feed_forward." in r.target else r
                 for r in rules)


def gguf_moe_rules() -> tuple[Rule, ...]:
    """The GGUF table of the sparse layers (llama.cpp's names): the router and the experts
    stored stacked, ffn_gate_exps / ffn_up_exps [E, I, H] and ffn_down_exps [E, H, I]."""
    b = "blk.{i}."
    return (
        Rule("layers.{i}.feed_forward.gate.weight", pieces(b + "ffn_gate_inp.weight"),
             "sparse_layer"),
        Rule("layers.{i}.feed_forward.experts.w13",
             pieces(b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight"), "sparse_layer",
             stacked=True),
        Rule("layers.{i}.feed_forward.experts.w2", pieces(b + "ffn_down_exps.weight"),
             "sparse_layer", stacked=True),
    )
