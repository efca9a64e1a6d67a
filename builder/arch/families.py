"""The registry of model families, keyed by HF `model_type` and GGUF `general.architecture`.

Adding a family: a module beside this one that declares its `Family` (config reading,
weight tables, the model composed from builder/arch/blocks.py), listed in FAMILIES.
"""
from __future__ import annotations

from kiln.builder.arch import gemma, llama, qwen3
from kiln.builder.arch import phi3
from kiln.builder.arch import mixtral, qwen3_moe
from kiln.builder.arch.config import DecoderConfig
from kiln.builder.arch.family import Family
from kiln.builder.arch.weights import Mapped, expand_rules

FAMILIES: tuple[Family, ...] = (llama.FAMILY, qwen3.FAMILY, mixtral.FAMILY, qwen3_moe.FAMILY,
                                phi3.FAMILY, gemma.FAMILY, gemma.IMAGE_TEXT)
BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.hf_model_types}
BY_GGUF_ARCH = {a: f for f in FAMILIES for a in f.gguf_archs}


def family_for_hf(model_type: str) -> Family:
    """The family for a config.json model_type; ValueError naming the supported ones."""
    if model_type not in BY_MODEL_TYPE:
        raise ValueError(f"config.json model_type {model_type!r} is not supported; "
                         f"supported: {', '.join(BY_MODEL_TYPE)}")
    return BY_MODEL_TYPE[model_type]


def family_for_gguf(arch: str) -> Family:
    """The family for a GGUF general.architecture; ValueError naming the supported ones."""
    if arch not in BY_GGUF_ARCH:
        raise ValueError(f"general.architecture {arch!r} is not supported; "
                         f"supported: {', '.join(BY_GGUF_ARCH)}")
    return BY_GGUF_ARCH[arch]


def config_from_hf(cfg: dict) -> DecoderConfig:
    """A HF config.json read by the family registered for its model_type (ValueError, or
    UnsupportedConfig naming a setting that family refuses)."""
    return family_for_hf(cfg.get("model_type", "llama")).config_from_hf(cfg)


# A tied HF checkpoint may still carry lm_head.weight (a copy of the embedding).
HF_IGNORE_TIED = (r"lm_head\.weight",)


def plan_mapping(cfg: DecoderConfig, fmt: str, available) -> list[Mapped]:
    """The family's weight table for a source format ('hf' | 'gguf'), expanded for cfg and
    checked against the source's tensor names (weights.MappingError names what differs)."""
    rules, ignore = family_for_config(cfg).rules(fmt, cfg.family)
    if fmt == "hf" and cfg.tie_word_embeddings:
        ignore = ignore + HF_IGNORE_TIED
    return expand_rules(cfg, rules, ignore, available)


def family_for_config(cfg: DecoderConfig) -> Family:
    """The family a config was read for (cfg.family is its model_type or GGUF arch)."""
    return BY_MODEL_TYPE.get(cfg.family) or family_for_gguf(cfg.family)


def build_model(cfg: DecoderConfig):
    """The family's model for cfg, with its parameters allocated (uninitialized values)."""
    return family_for_config(cfg).model(cfg)


def param_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the family's model for cfg with its shape, without allocating it."""
    import torch

    with torch.device("meta"):
        m = build_model(cfg)
    return {n: tuple(p.shape) for n, p in m.named_parameters()}
