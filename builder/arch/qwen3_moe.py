"""Qwen3-MoE: the Qwen3 decoder (per-head q/k RMSNorm) with a top-k mixture of many small
SwiGLU experts (builder/arch/moe.py) in its sparse layers.

config.json: num_experts experts of moe_intermediate_size each, num_experts_per_tok of them
per token, renormalized when norm_topk_prob; layer i is sparse when it is not listed in
mlp_only_layers and (i + 1) % decoder_sparse_step == 0; the other layers are the dense MLP
of intermediate_size. Weight tables: Qwen3's, and for the sparse layers

    feed_forward.gate.weight  <- mlp.gate.weight
    feed_forward.experts.w13  <- [mlp.experts.{e}.gate_proj; mlp.experts.{e}.up_proj] per e
    feed_forward.experts.w2   <- mlp.experts.{e}.down_proj for each e

GGUF (architecture `qwen3moe`): Qwen3's table, and the sparse layers from llama.cpp's
stacked experts (builder/arch/moe.gguf_moe_rules); the config from its expert_* keys.
"""
from __future__ import annotations

import dataclasses

from kiln.builder.arch.blocks import DecoderModel
from kiln.builder.arch.config import DecoderConfig
from kiln.builder.arch.family import Family
from kiln.builder.arch.llama import HF_IGNORE, gguf_rules_for, hf_rules
from kiln.builder.arch.moe import dense_only, gguf_moe_rules, moe_rules
from kiln.builder.arch.qwen3 import _GGUF_QK, _HF_QK
from kiln.builder.arch.qwen3 import config_from_hf as qwen3_config


def num_experts(cfg: dict) -> int:
    """config.json num_experts (transformers also writes it as num_local_experts)."""
    n = cfg.get("num_experts", cfg.get("num_local_experts"))
    if n is None:
        raise ValueError("config.json has neither num_experts nor num_local_experts")
    return int(n)


def sparse_layers(cfg: dict) -> tuple[int, ...]:
    """The layers whose MLP is the experts (transformers' Qwen3MoeDecoderLayer rule)."""
    step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
    if num_experts(cfg) <= 0 or step <= 0:
        return ()
    return tuple(i for i in range(cfg["num_hidden_layers"])
                 if i not in dense and (i + 1) % step == 0)


def config_from_hf(cfg: dict) -> DecoderConfig:
    """From a HF config.json of Qwen3MoeForCausalLM."""
    base = qwen3_config(dict(cfg, model_type="qwen3"))
    return dataclasses.replace(
        base, family="qwen3_moe", num_experts=num_experts(cfg),
        experts_per_token=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        normalize_topk=bool(cfg.get("norm_topk_prob", False)), sparse_layers=sparse_layers(cfg))


HF_RULES = dense_only(hf_rules(_HF_QK)) + moe_rules(
    "mlp", "gate.weight", "experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight",
    "experts.{e}.down_proj.weight")

FAMILY = Family(
    name="qwen3_moe", hf_model_types=("qwen3_moe",), gguf_archs=("qwen3moe",),
    config_from_hf=config_from_hf,
    gguf_options=lambda arch, names: {"qk_norm": True},
    hf_rules=HF_RULES, hf_ignore=HF_IGNORE,
    gguf_rules=lambda arch: dense_only(gguf_rules_for(False, _GGUF_QK)) + gguf_moe_rules(),
    model=DecoderModel)
