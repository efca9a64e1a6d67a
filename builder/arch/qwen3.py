"""Qwen3 (dense): the plain decoder with per-head q and k RMSNorm before RoPE, no q/k/v
bias, and a head_dim of its own (config.json head_dim, not hidden_size / heads).

Weight tables: the Llama family's, plus `q_norm`/`k_norm` ([head_dim] each, shared by the
heads). llama.cpp runs Qwen3 with the NeoX rope, so its GGUF q/k rows are not permuted.
"""
from __future__ import annotations

from kiln.builder.arch.blocks import DecoderModel
from kiln.builder.arch.config import DecoderConfig, UnsupportedConfig
from kiln.builder.arch.family import Family, hf_common
from kiln.builder.arch.llama import (HF_IGNORE, gguf_rules_for, gguf_window, hf_rules,
                                    qwen_window)
from kiln.builder.arch.weights import Rule, pieces


def config_from_hf(cfg: dict) -> DecoderConfig:
    """From a HF config.json of Qwen3ForCausalLM."""
    common = hf_common(cfg, "qwen3", default_eps=1e-6)
    if cfg.get("attention_bias"):   # Qwen3's attention_bias also puts a bias on o_proj
        raise UnsupportedConfig("attention_bias", cfg["attention_bias"], "false", "qwen3")
    window, layers = qwen_window(cfg, "qwen3")
    return DecoderConfig(**common, qk_norm=True, sliding_window=window, sliding_layers=layers)


_HF_QK = (
    Rule("layers.{i}.attention.q_norm.weight", pieces("model.layers.{i}.self_attn.q_norm.weight"),
         "qk_norm"),
    Rule("layers.{i}.attention.k_norm.weight", pieces("model.layers.{i}.self_attn.k_norm.weight"),
         "qk_norm"),
)
_GGUF_QK = (
    Rule("layers.{i}.attention.q_norm.weight", pieces("blk.{i}.attn_q_norm.weight"), "qk_norm"),
    Rule("layers.{i}.attention.k_norm.weight", pieces("blk.{i}.attn_k_norm.weight"), "qk_norm"),
)

FAMILY = Family(
    name="qwen3", hf_model_types=("qwen3",), gguf_archs=("qwen3",),
    config_from_hf=config_from_hf,
    gguf_options=lambda arch, names: {"qk_norm": True},
    hf_rules=hf_rules(_HF_QK), hf_ignore=HF_IGNORE,
    gguf_rules=lambda arch: gguf_rules_for(False, _GGUF_QK), gguf_config=gguf_window,
    model=DecoderModel)
