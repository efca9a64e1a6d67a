"""The Llama family (Llama 2/3, Mistral with its sliding window, Qwen2, SmolLM): the plain
decoder of builder/arch/blocks.py, with q/k/v biases for Qwen2.

Weight tables, HF and GGUF (concatenated along dim 0 in the order listed):

    wqkv = [q; k; v]          [(H + 2*KVH) * D, hidden]   (and the bias, Qwen2)
    w13  = [gate; up]         [2 * inter, hidden]

llama.cpp stores q and k permuted for the architectures it runs with the "normal" (GPT-J
style) rope (llama, mistral); Qwen2 GGUFs use the NeoX layout and are stored unpermuted.
"""
from __future__ import annotations

from typing import Optional

from kiln.builder.arch.blocks import DecoderModel, param_shapes, rope_inv_freq  # noqa: F401
from kiln.builder.arch.config import DecoderConfig, RopeScaling, UnsupportedConfig  # noqa: F401
from kiln.builder.arch.family import Family, hf_common
from kiln.builder.arch.moe import dense_only, gguf_moe_rules
from kiln.builder.arch.weights import Piece, Rule, pieces, unpermute_k, unpermute_q

# The names the rest of kiln has always used for the decoder and its config.
LlamaConfig = DecoderConfig
LlamaModel = DecoderModel

MODEL_TYPES = ("llama", "mistral", "qwen2")


def config_from_hf(cfg: dict) -> DecoderConfig:
    """From a HF config.json of LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM."""
    mtype = cfg.get("model_type", "llama")
    common = hf_common(cfg, mtype, default_eps=1e-6 if mtype == "qwen2" else 1e-5)
    # Qwen2 always has q/k/v biases; Llama's attention_bias also puts one on o_proj
    bias = cfg.get("attention_bias", mtype == "qwen2")
    if bias and mtype != "qwen2":
        raise UnsupportedConfig("attention_bias", bias, "false", mtype)
    if mtype == "mistral":   # every layer (transformers' Mistral ignores layer_types)
        window, layers = cfg.get("sliding_window") or None, ()
    else:
        window, layers = qwen_window(cfg, mtype)
    return DecoderConfig(**common, attention_bias=bool(bias), sliding_window=window,
                         sliding_layers=layers)


def qwen_window(cfg: dict, family: str) -> tuple[Optional[int], tuple[int, ...]]:
    """Qwen2/Qwen3's window and the layers it applies to, as transformers decides them: no
    window without use_sliding_window; else the layers config.json's layer_types marks
    "sliding_attention", or without layer_types those from max_window_layers (default 28) on."""
    window = cfg.get("sliding_window") or None
    if not cfg.get("use_sliding_window") or window is None:
        return None, ()
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        layers = tuple(range(cfg.get("max_window_layers", 28), n))
    else:
        if len(types) != n or set(types) - {"full_attention", "sliding_attention"}:
            raise UnsupportedConfig("layer_types", types, f"{n} entries, each "
                                    "'full_attention' or 'sliding_attention'", family)
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return (int(window), layers) if layers else (None, ())


def hf_rules(extra_attention: tuple[Rule, ...] = ()) -> tuple[Rule, ...]:
    """The HF table of the plain decoder; `extra_attention` adds per-layer attention rules."""
    att, mlp = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    return (
        Rule("tok_embeddings.weight", pieces("model.embed_tokens.weight")),
        Rule("layers.{i}.attention_norm.weight", pieces("model.layers.{i}.input_layernorm.weight")),
        Rule("layers.{i}.attention.wqkv.weight",
             pieces(att + "q_proj.weight", att + "k_proj.weight", att + "v_proj.weight")),
        Rule("layers.{i}.attention.wqkv.bias",
             pieces(att + "q_proj.bias", att + "k_proj.bias", att + "v_proj.bias"),
             "attention_bias"),
        Rule("layers.{i}.attention.wo.weight", pieces(att + "o_proj.weight")),
        *extra_attention,
        Rule("layers.{i}.ffn_norm.weight",
             pieces("model.layers.{i}.post_attention_layernorm.weight")),
        Rule("layers.{i}.feed_forward.w13.weight",
             pieces(mlp + "gate_proj.weight", mlp + "up_proj.weight")),
        Rule("layers.{i}.feed_forward.w2.weight", pieces(mlp + "down_proj.weight")),
        Rule("norm.weight", pieces("model.norm.weight")),
        Rule("output.weight", pieces("lm_head.weight"), "untied"),
    )


# Present in some checkpoints, never needed: rope tables we recompute.
HF_IGNORE = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"model\.rotary_emb\.inv_freq")


def gguf_rules_for(permuted: bool, extra_attention: tuple[Rule, ...] = ()) -> tuple[Rule, ...]:
    """The GGUF table of the plain decoder (llama.cpp's tensor names)."""
    q = unpermute_q if permuted else None
    k = unpermute_k if permuted else None
    b = "blk.{i}."
    return (
        Rule("tok_embeddings.weight", pieces("token_embd.weight")),
        Rule("layers.{i}.attention_norm.weight", pieces(b + "attn_norm.weight")),
        Rule("layers.{i}.attention.wqkv.weight",
             (Piece(b + "attn_q.weight", q), Piece(b + "attn_k.weight", k),
              Piece(b + "attn_v.weight"))),
        Rule("layers.{i}.attention.wqkv.bias",
             (Piece(b + "attn_q.bias", q), Piece(b + "attn_k.bias", k),
              Piece(b + "attn_v.bias")), "attention_bias"),
        Rule("layers.{i}.attention.wo.weight", pieces(b + "attn_output.weight")),
        *extra_attention,
        Rule("layers.{i}.ffn_norm.weight", pieces(b + "ffn_norm.weight")),
        Rule("layers.{i}.feed_forward.w13.weight",
             pieces(b + "ffn_gate.weight", b + "ffn_up.weight")),
        Rule("layers.{i}.feed_forward.w2.weight", pieces(b + "ffn_down.weight")),
        Rule("norm.weight", pieces("output_norm.weight")),
        Rule("output.weight", pieces("output.weight"), "untied"),
    )


def gguf_window(meta: dict, read=None) -> dict:
    """A GGUF's `{arch}.attention.sliding_window`: on every layer for llama and mistral (as
    transformers' Mistral); refused for Qwen, whose GGUF does not say which layers it covers."""
    arch = meta.get("general.architecture")
    window = meta.get(f"{arch}.attention.sliding_window")
    if not window:
        return {}
    if arch not in ("llama", "mistral"):
        raise UnsupportedConfig(f"{arch}.attention.sliding_window", window, "absent (the GGUF "
                                "does not say which layers are windowed: use the HF checkpoint)",
                                arch)
    return {"sliding_window": int(window)}


# llama.cpp permutes q/k for the architectures it runs with the "normal" (GPT-J style) rope.
GGUF_PERMUTED_ARCHS = ("llama", "mistral")


FAMILY = Family(
    name="llama", hf_model_types=MODEL_TYPES, gguf_archs=MODEL_TYPES,
    config_from_hf=config_from_hf,
    gguf_options=lambda arch, names: {"attention_bias": "blk.0.attn_q.bias" in names},
    hf_rules=hf_rules(), hf_ignore=HF_IGNORE, gguf_config=gguf_window,
    # a llama GGUF with experts (Mixtral): the MLP of the layers that have a router
    gguf_rules=lambda arch: dense_only(gguf_rules_for(arch in GGUF_PERMUTED_ARCHS))
    + gguf_moe_rules(),
    model=DecoderModel)
