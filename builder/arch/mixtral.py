"""Mixtral: the Llama decoder with every layer's MLP a top-k mixture of SwiGLU experts
(builder/arch/moe.py), routed by softmax over all experts then the top k renormalized.

Weight tables: the Llama family's attention and norms, and per layer

    feed_forward.gate.weight  <- block_sparse_moe.gate.weight                 [E, hidden]
    feed_forward.experts.w13  <- [experts.{e}.w1; experts.{e}.w3] for each e   [E*2I, hidden]
    feed_forward.experts.w2   <- experts.{e}.w2 for each e                    [E*hidden, I]

(HF checkpoints on the hub and transformers' save_pretrained both write one tensor per
expert.) A checkpoint with more or fewer experts than config.json says is refused naming
the expert tensors missing or left over. A Mixtral GGUF is llama.cpp's `llama` architecture
with experts: the llama family reads it (builder/arch/moe.gguf_moe_rules).
"""
from __future__ import annotations

from kiln.builder.arch.blocks import DecoderModel
from kiln.builder.arch.config import DecoderConfig
from kiln.builder.arch.family import Family, hf_common
from kiln.builder.arch.llama import HF_IGNORE, hf_rules
from kiln.builder.arch.moe import dense_only, moe_rules


def config_from_hf(cfg: dict) -> DecoderConfig:
    """From a HF config.json of MixtralForCausalLM."""
    common = hf_common(cfg, "mixtral")
    experts = int(cfg["num_local_experts"])
    return DecoderConfig(**common, num_experts=experts,
                         experts_per_token=int(cfg["num_experts_per_tok"]),
                         moe_intermediate_size=cfg["intermediate_size"], normalize_topk=True,
                         sparse_layers=tuple(range(cfg["num_hidden_layers"])),
                         sliding_window=cfg.get("sliding_window") or None)   # as Mistral


HF_RULES = dense_only(hf_rules()) + moe_rules(
    "block_sparse_moe", "gate.weight", "experts.{e}.w1.weight", "experts.{e}.w3.weight",
    "experts.{e}.w2.weight")

FAMILY = Family(
    name="mixtral", hf_model_types=("mixtral",), gguf_archs=(),
    config_from_hf=config_from_hf,
    gguf_options=lambda arch, names: {},
    hf_rules=HF_RULES, hf_ignore=HF_IGNORE,
    gguf_rules=lambda arch: (),
    model=DecoderModel)
