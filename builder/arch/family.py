"""What a model family declares: where its config comes from, its weight tables, its model.

A family composes the shared blocks (builder/arch/blocks.py) through the options of its
DecoderConfig and declares its weight tables (builder/arch/weights.py); families are
registered by HF `model_type` and GGUF `general.architecture` in builder/arch/families.py.
`hf_common` reads the config.json keys every family shares and refuses the settings that
change the math and that no block implements, naming the key, its value and what works.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from kiln.builder.arch.config import DecoderConfig, RopeScaling, UnsupportedConfig
from kiln.builder.arch.weights import Rule


@dataclass(frozen=True)
class Family:
    name: str
    hf_model_types: tuple[str, ...]        # config.json model_type values it reads
    gguf_archs: tuple[str, ...]            # GGUF general.architecture values it reads
    config_from_hf: Callable[[dict], DecoderConfig]
    gguf_options: Callable[[str, set], dict]   # (arch, tensor names) -> DecoderConfig kwargs
    hf_rules: tuple[Rule, ...]
    hf_ignore: tuple[str, ...]                 # regexes of HF tensors that are never needed
    gguf_rules: Callable[[str], tuple[Rule, ...]]   # per GGUF architecture
    model: Callable[[DecoderConfig], nn.Module]
    gguf_ignore: tuple[str, ...] = ()          # GGUF tensors read into the config, not weights
    # (GGUF metadata, read a tensor by name) -> DecoderConfig fields the family reads itself
    gguf_config: Optional[Callable[[dict, Callable[[str], torch.Tensor]], dict]] = None
    gguf_rope_scaling: tuple[str, ...] = ()    # rope.scaling.type values gguf_config reads

    def rules(self, fmt: str, arch: str) -> tuple[tuple[Rule, ...], tuple[str, ...]]:
        """(rules, ignore patterns) for a source format ('hf' | 'gguf')."""
        if fmt == "hf":
            return self.hf_rules, self.hf_ignore
        if fmt == "gguf":
            return self.gguf_rules(arch), self.gguf_ignore
        raise ValueError(f"unknown source format {fmt!r}")


ROPE_TYPES = ("default", "llama3")
ACTIVATIONS = ("silu",)


def _rope(cfg: dict, family: str) -> tuple[float, RopeScaling | None]:
    rs = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
    rope_theta = cfg.get("rope_theta", rs.get("rope_theta", 10000.0))
    rtype = rs.get("rope_type", rs.get("type"))
    if rtype == "llama3":
        return float(rope_theta), RopeScaling(
            float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"]),
            int(rs["original_max_position_embeddings"]))
    if rtype not in (None, "default"):
        key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
        raise UnsupportedConfig(f"{key}.rope_type", rtype, ", ".join(ROPE_TYPES), family)
    return float(rope_theta), None


def refuse_math_changes(cfg: dict, family: str) -> None:
    """Raise UnsupportedConfig for a setting none of the blocks implements."""
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in ACTIVATIONS:
        raise UnsupportedConfig("hidden_act", act, ", ".join(ACTIVATIONS), family)
    if cfg.get("mlp_bias"):
        raise UnsupportedConfig("mlp_bias", cfg["mlp_bias"], "false", family)
    prf = cfg.get("partial_rotary_factor")
    if prf is not None and float(prf) != 1.0:
        raise UnsupportedConfig("partial_rotary_factor", prf, "1.0 (full rotary)", family)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise UnsupportedConfig(key, cfg[key], "null (no soft-capping)", family)


def hf_common(cfg: dict, family: str, default_eps: float = 1e-5) -> dict:
    """The DecoderConfig fields every family reads the same way from a config.json."""
    refuse_math_changes(cfg, family)
    heads = cfg["num_attention_heads"]
    rope_theta, scaling = _rope(cfg, family)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return dict(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", default_eps),
        rope_theta=rope_theta, rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids, family=family)
