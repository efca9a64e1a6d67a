"""Phi-3 / Phi-4 (HF model_type and GGUF architecture `phi3`): the plain decoder with q/k/v
and gate/up each stored fused, LongRoPE scaling and partial rotary embeddings.

Weight tables: the Llama family's, with the fused sources taken as they are:

    wqkv = qkv_proj      [(H + 2*KVH) * D, hidden]    GGUF: blk.N.attn_qkv
    w13  = gate_up_proj  [2 * inter, hidden]          GGUF: blk.N.ffn_up (gate rows first)

A PEFT adapter of a Phi-3 changes these fused linears (qkv_proj, gate_up_proj); it is read
onto the plan's parts, q/k/v and gate/up, at load (runtime/lora_peft.py FUSED).

llama.cpp runs phi3 with the NeoX rope, so its q/k rows are not permuted; it stores the
LongRoPE factors as the tensors rope_factors_long / rope_factors_short (read into the
config, not weights) and the cos/sin scale as rope.scaling.attn_factor.

LongRoPE (config.LongRope): transformers picks the short or the long factors at each
forward by the sequence's current length. A compiled plan cannot (the K it has cached keep
the rotation they were written with), so one set serves every position of a plan: the long
factors when the plan's limits.max_seq_len exceeds original_max_position_embeddings, the
short ones otherwise (DecoderConfig.for_max_seq_len; llama.cpp decides the same way by its
context size). A plan of at most original_max_position_embeddings tokens equals
transformers for every sequence; a longer plan equals it for every sequence longer than
original_max_position_embeddings and differs (long factors) on shorter ones.

partial_rotary_factor (Phi-4-mini: 0.75): RoPE rotates the first rotary_dim of each head
and passes the rest through.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

import torch

from kiln.builder.arch.blocks import DecoderModel
from kiln.builder.arch.config import DecoderConfig, LongRope, UnsupportedConfig
from kiln.builder.arch.family import Family, hf_common
from kiln.builder.arch.llama import HF_IGNORE, gguf_rules_for, hf_rules
from kiln.builder.arch.weights import pieces

ROPE_TYPES = ("default", "longrope", "su")   # su: LongRoPE's older name
# rope_scaling / rope_parameters keys read here; any other is refused
ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "short_factor",
             "long_factor", "factor", "attention_factor", "original_max_position_embeddings"}
ORIGINAL_MAX_DEFAULT = 4096   # transformers' Phi3Config default


def _longrope(rs: dict, cfg: dict, rotary_dim: int) -> LongRope:
    """LongRoPE from rope_scaling/rope_parameters, as transformers computes it."""
    orig = int(rs.get("original_max_position_embeddings")
               or cfg.get("original_max_position_embeddings", ORIGINAL_MAX_DEFAULT))
    factor = rs.get("factor")
    if factor is None:
        factor = cfg.get("max_position_embeddings", 4096) / orig
    att = rs.get("attention_factor")
    if att is None:
        att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    short, long = rs.get("short_factor"), rs.get("long_factor")
    for key, val in (("short_factor", short), ("long_factor", long)):
        if not isinstance(val, list) or len(val) != rotary_dim // 2:
            raise ValueError(f"rope_scaling.{key} must be a list of rotary_dim/2 = "
                             f"{rotary_dim // 2} numbers, got {val!r}")
    return LongRope(tuple(float(x) for x in short), tuple(float(x) for x in long), orig,
                    float(att))


def config_from_hf(cfg: dict) -> DecoderConfig:
    """From a HF config.json of Phi3ForCausalLM (Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini)."""
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rs = cfg.get(key) or {}
    rtype = rs.get("rope_type", rs.get("type")) or "default"
    if rtype not in ROPE_TYPES:
        raise UnsupportedConfig(f"{key}.rope_type", rtype, ", ".join(ROPE_TYPES), "phi3")
    unknown = sorted(set(rs) - ROPE_KEYS)
    if unknown:
        raise UnsupportedConfig(f"{key}.{unknown[0]}", rs[unknown[0]],
                                f"the keys {', '.join(sorted(ROPE_KEYS))}", "phi3")
    prf = float(rs.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    # the rope settings are read here; hf_common reads (and refuses) the rest
    rest = {k: v for k, v in cfg.items()
            if k not in ("rope_scaling", "rope_parameters", "partial_rotary_factor")}
    rest["rope_theta"] = cfg.get("rope_theta", rs.get("rope_theta", 10000.0))
    common = hf_common(rest, "phi3")
    rotary = int(common["head_dim"] * prf)
    if not 0.0 < prf <= 1.0 or rotary % 2:
        raise UnsupportedConfig("partial_rotary_factor", prf, "a factor in (0, 1] giving an "
                                f"even number of rotary dims of head_dim {common['head_dim']}",
                                "phi3")
    longrope = _longrope(rs, cfg, rotary) if rtype != "default" else None
    return DecoderConfig(**common, longrope=longrope, partial_rotary_factor=prf,
                         sliding_window=cfg.get("sliding_window") or None)


def gguf_config(meta: dict, read: Callable[[str], torch.Tensor]) -> dict:
    """DecoderConfig fields of a llama.cpp phi3 GGUF that come from metadata and tensors:
    head_dim (rope.dimension_count is the rotary part), LongRoPE, the sliding window."""
    hidden, heads = int(meta["phi3.embedding_length"]), int(meta["phi3.attention.head_count"])
    head_dim = int(meta.get("phi3.attention.key_length") or hidden // heads)
    rotary = int(meta.get("phi3.rope.dimension_count") or head_dim)
    out = dict(head_dim=head_dim, partial_rotary_factor=rotary / head_dim,
               sliding_window=int(meta.get("phi3.attention.sliding_window") or 0) or None)
    try:
        long, short = read("rope_factors_long.weight"), read("rope_factors_short.weight")
    except KeyError:
        return out
    orig = int(meta["phi3.rope.scaling.original_context_length"])
    rs = {"short_factor": short.tolist(), "long_factor": long.tolist(),
          "original_max_position_embeddings": orig,
          "attention_factor": meta.get("phi3.rope.scaling.attn_factor")}
    ctx = {"max_position_embeddings": int(meta.get("phi3.context_length", orig))}
    return dict(out, longrope=_longrope(rs, ctx, rotary))


_HF_FUSED = {
    "layers.{i}.attention.wqkv.weight": pieces("model.layers.{i}.self_attn.qkv_proj.weight"),
    "layers.{i}.feed_forward.w13.weight": pieces("model.layers.{i}.mlp.gate_up_proj.weight")}
_GGUF_FUSED = {"layers.{i}.attention.wqkv.weight": pieces("blk.{i}.attn_qkv.weight"),
               "layers.{i}.feed_forward.w13.weight": pieces("blk.{i}.ffn_up.weight")}


def _fused(rules, fused: dict):
    """The plain decoder's table with the fused parameters taken from one source each."""
    return tuple(replace(r, pieces=fused[r.target]) if r.target in fused else r
                 for r in rules)


FAMILY = Family(
    name="phi3", hf_model_types=("phi3",), gguf_archs=("phi3",),
    config_from_hf=config_from_hf,
    gguf_options=lambda arch, names: {},
    hf_rules=_fused(hf_rules(), _HF_FUSED), hf_ignore=HF_IGNORE,
    gguf_rules=lambda arch: _fused(gguf_rules_for(False), _GGUF_FUSED),
    model=DecoderModel,
    gguf_ignore=(r"rope_factors_(long|short)\.weight",),
    gguf_config=gguf_config)
