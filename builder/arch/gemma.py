"""Gemma 2 and Gemma 3 (text): the shared attention (builder/arch/blocks.py) with Gemma's
own norms, MLP and step.

What differs from the plain decoder:

    x = embed(ids) * sqrt(hidden)            (the scale rounded to the model dtype, as HF)
    x = x + post_attention_norm(attn(attention_norm(x)))     four norms per layer
    x = x + post_ffn_norm(w2(gelu_tanh(gate) * up))           (GeGLU)
    norm(x) = x / rms(x) * (1 + w)           in float32, then cast back
    logits  = c * tanh(lm_head(x) / c)       final_logit_softcapping (Gemma 2)

Attention: score scale query_pre_attn_scalar ** -0.5; sliding-window layers alternating
with global ones (Gemma 2: every other one; Gemma 3: `layer_types`, five local to one
global); Gemma 2 soft-caps the scores; Gemma 3 adds per-head q/k norms (1 + w) and gives its
sliding layers a RoPE base of their own (rope_local_base_freq), linear rope scaling
applying to the global layers only.

The norm weights are kept as the checkpoint stores them (w, not 1 + w) and the 1 is added
in float32 at run time: folding it into a bf16 weight would round 1 + w to 8 bits of
mantissa, which HF does not. llama.cpp's converter writes 1 + w into a GGUF; the GGUF
tables subtract it back.

Gemma3ForConditionalGeneration (model_type gemma3, image-text) builds its text model: the
tensors under language_model., the vision tower and projector unread.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from kiln.builder.arch.blocks import (Attention, DecoderModel, GatedMLP, RMSNorm, StepInputs,
                                      rope_inv_freq)
from kiln.builder.arch.config import DecoderConfig, UnsupportedConfig
from kiln.builder.arch.family import Family, hf_common
from kiln.builder.arch.llama import HF_IGNORE
from kiln.builder.arch.weights import Piece, Rule
from kiln.contracts.manifest import LORA_MODULES

ACTIVATIONS = ("gelu_pytorch_tanh",)
LAYER_TYPES = ("sliding_attention", "full_attention")


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by (1 + weight), computed in float32 and cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(dtype)


class GeGLU(GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x)); the same fused w13/w2 linears (and LoRA terms) as
    SwiGLU."""

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")


class GemmaBlock(nn.Module):
    """One Gemma layer: norm -> attention -> norm -> residual, norm -> MLP -> norm ->
    residual. `local`: the layer slides a window (and takes the local RoPE tables)."""

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.local = cfg.window_for(layer) > 0
        self.attention_norm = GemmaRMSNorm(h, eps)
        self.attention = Attention(cfg, layer)
        if cfg.qk_norm:   # Gemma 3: (1 + w) norms too
            self.attention.q_norm = GemmaRMSNorm(cfg.head_dim, eps)
            self.attention.k_norm = GemmaRMSNorm(cfg.head_dim, eps)
        self.post_attention_norm = GemmaRMSNorm(h, eps)
        self.ffn_norm = GemmaRMSNorm(h, eps)
        self.feed_forward = GeGLU(cfg)
        self.post_ffn_norm = GemmaRMSNorm(h, eps)
        self.layer = layer

    def lora_modules(self) -> tuple[str, ...]:
        """Every LoRA target: the shared attention's and the GeGLU's linears."""
        return LORA_MODULES

    def forward(self, x, s: StepInputs, k_cache, v_cache):
        lora = None if s.lora is None else s.lora.layer(self.layer)
        x = x + self.post_attention_norm(self.attention(self.attention_norm(x), s, k_cache,
                                                        v_cache, lora))
        return x + self.post_ffn_norm(self.feed_forward(self.ffn_norm(x), lora))


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor):
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]      # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]                 # [T, 1, D]
    return emb.cos(), emb.sin()


class GemmaModel(DecoderModel):
    """The packed-token engine step of DecoderModel (same inputs, same parameter names for
    the embedding, layers, final norm and lm_head) with Gemma's layers and scalings."""

    def __init__(self, cfg: DecoderConfig):
        nn.Module.__init__(self)          # DecoderModel's layers are not Gemma's
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaBlock(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)
        with torch.device("cpu"):        # real values even when the model is built on meta
            self.register_buffer("embed_scale", torch.tensor(math.sqrt(cfg.hidden_size)),
                                 persistent=False)
            glob = rope_inv_freq(cfg) / cfg.rope_global_factor
            local = rope_inv_freq(replace(cfg, rope_theta=cfg.rope_local_theta or cfg.rope_theta))
            self.register_buffer("rope_global", glob, persistent=False)
            self.register_buffer("rope_local", local, persistent=False)
        self.lora_targets: tuple[str, ...] = ()   # enable_lora

    def forward(self, input_ids, positions, slot_mapping, block_tables, context_lens,
                query_start_loc, logits_indices, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor], lora_slots=None, lora_scales=None,
                lora_a=None, lora_b=None) -> torch.Tensor:
        """-> logits [N, vocab] float32 for the N rows in logits_indices; a plan with lora
        also takes the adapters, as DecoderModel.forward."""
        s_global = StepInputs(positions, slot_mapping, block_tables, context_lens,
                              query_start_loc, *_cos_sin(positions, self.rope_global),
                              lora=self.lora_step(lora_slots, lora_scales, lora_a, lora_b))
        s_local = replace(s_global, **dict(zip(("cos", "sin"),
                                               _cos_sin(positions, self.rope_local))))
        x = self.tok_embeddings(input_ids)                              # [T, hidden]
        x = x * self.embed_scale.to(x.dtype)
        for layer, kc, vc in zip(self.layers, k_caches, v_caches):
            x = layer(x, s_local if layer.local else s_global, kc, vc)
        x = self.norm(x[logits_indices])                                # [N, hidden]
        logits = self.lm_head(x).float()
        c = self.cfg.final_logit_softcap
        return logits if not c else c * torch.tanh(logits / c)


# --- config.json ----------------------------------------------------------------------------

def _layer_types(cfg: dict, mtype: str) -> list[str]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:   # older config.json: a pattern (Gemma 2: every other layer)
        every = 2 if mtype == "gemma2" else int(cfg.get("sliding_window_pattern",
                                                        cfg.get("_sliding_window_pattern", 6)))
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad or len(types) != n:
        raise UnsupportedConfig("layer_types", types, f"{n} of {', '.join(LAYER_TYPES)}", mtype)
    return types


def _rope_params(cfg: dict, mtype: str) -> tuple[dict, dict]:
    """(global, local) RoPE parameters, each with rope_theta and rope_type."""
    rp = cfg.get("rope_parameters") or {}
    if "full_attention" in rp:          # transformers 5: one set per layer type
        glob, local = dict(rp["full_attention"]), dict(rp.get("sliding_attention") or {})
    elif mtype == "gemma2":
        glob = {"rope_theta": cfg.get("rope_theta", rp.get("rope_theta", 10000.0)),
                **(cfg.get("rope_scaling") or rp)}
        local = dict(glob)
    else:                               # older Gemma 3 config.json
        glob = {"rope_theta": cfg.get("rope_theta", 1_000_000.0), **(cfg.get("rope_scaling") or {})}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    local.setdefault("rope_theta", 10000.0)
    return glob, local


def _rope(cfg: dict, mtype: str) -> dict:
    glob, local = _rope_params(cfg, mtype)
    gtype = glob.get("rope_type", glob.get("type", "default"))
    allowed = ("default",) if mtype == "gemma2" else ("default", "linear")
    if gtype not in allowed:   # Gemma 3 scales its global layers only
        key = "rope_parameters.full_attention" if mtype != "gemma2" else "rope_parameters"
        raise UnsupportedConfig(f"{key}.rope_type", gtype, ", ".join(allowed), mtype)
    ltype = local.get("rope_type", local.get("type", "default"))
    if ltype != "default":
        raise UnsupportedConfig("rope_parameters.sliding_attention.rope_type", ltype,
                                "default", mtype)
    return dict(rope_theta=float(glob["rope_theta"]),
                rope_local_theta=None if mtype == "gemma2" else float(local["rope_theta"]),
                rope_global_factor=float(glob["factor"]) if gtype == "linear" else 1.0)


def _refuse(cfg: dict, mtype: str) -> None:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise UnsupportedConfig("hidden_activation", act, ", ".join(ACTIVATIONS), mtype)
    for key in ("attention_bias", "use_bidirectional_attention", "mlp_bias"):
        if cfg.get(key):
            raise UnsupportedConfig(key, cfg[key], "false", mtype)


# keys hf_common must not see: Gemma reads them here (hf_common refuses them for the
# families that do not have them)
_OWN_KEYS = ("hidden_act", "hidden_activation", "attn_logit_softcapping",
             "final_logit_softcapping", "rope_parameters", "rope_scaling", "rope_theta")


# Gemma3TextConfig's defaults: the text_config of an image-text config.json names only
# what differs from them
GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
    max_position_embeddings=131_072, query_pre_attn_scalar=256, sliding_window=4096,
    bos_token_id=2, eos_token_id=1)


def config_from_hf(cfg: dict) -> DecoderConfig:
    """From a HF config.json of Gemma2ForCausalLM, Gemma3ForCausalLM (gemma3_text), or
    Gemma3ForConditionalGeneration (gemma3: its text model; the vision tower is not read)."""
    mtype = cfg.get("model_type", "gemma2")
    if mtype == "gemma3":
        text = {**GEMMA3_TEXT_DEFAULTS, **(cfg.get("text_config") or {}),
                "model_type": "gemma3_text"}
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
        return replace(config_from_hf(text), family="gemma3")
    _refuse(cfg, mtype)
    common = hf_common({k: v for k, v in cfg.items() if k not in _OWN_KEYS}, mtype, 1e-6)
    common.update(_rope(cfg, mtype), tie_word_embeddings=cfg.get("tie_word_embeddings", True))
    types = _layer_types(cfg, mtype)
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = (cfg.get("sliding_window") or None) if sliding else None
    return DecoderConfig(
        **common, qk_norm=mtype == "gemma3_text", post_norms=True,
        sliding_window=window, sliding_layers=sliding if window else (),
        attn_logit_softcap=cfg.get("attn_logit_softcapping"),
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        query_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5)


# --- GGUF metadata (llama.cpp's gemma2 / gemma3) -----------------------------------------

# llama.cpp has no key for query_pre_attn_scalar: it scales by head_dim ** -0.5, except for
# the 27B models (hidden / heads), which it knows by their layer count.
_GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gguf_sliding(meta: dict, arch: str, n: int) -> tuple[int, ...]:
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern",
                       2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):       # one bool per layer
        return tuple(i for i, swa in enumerate(pattern) if swa)
    return tuple(i for i in range(n) if i % int(pattern) < int(pattern) - 1)


def gguf_config(meta: dict, read) -> dict:
    """The DecoderConfig fields of a llama.cpp gemma2 / gemma3 GGUF that the shared reader
    does not know (llama.cpp's defaults where a key is absent)."""
    arch = meta["general.architecture"]
    n = int(meta[f"{arch}.block_count"])
    heads, hidden = int(meta[f"{arch}.attention.head_count"]), int(meta[f"{arch}.embedding_length"])
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    scale_dim = hidden // heads if n == _GGUF_27B_LAYERS[arch] else head_dim
    gemma2 = arch == "gemma2"
    return dict(
        qk_norm=not gemma2, post_norms=True,
        sliding_window=int(meta.get(f"{arch}.attention.sliding_window", 4096 if gemma2 else 0))
        or None,
        sliding_layers=_gguf_sliding(meta, arch, n),
        attn_logit_softcap=meta.get(f"{arch}.attn_logit_softcapping", 50.0) if gemma2 else None,
        final_logit_softcap=meta.get(f"{arch}.final_logit_softcapping", 30.0 if gemma2 else None),
        query_scale=float(scale_dim) ** -0.5,
        rope_local_theta=None if gemma2 else float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)),
        rope_global_factor=_gguf_linear_factor(meta, arch))


def _gguf_linear_factor(meta: dict, arch: str) -> float:
    """llama.cpp applies a gemma3 GGUF's linear rope scaling to the global layers only."""
    if meta.get(f"{arch}.rope.scaling.type", "none") != "linear":
        return 1.0
    if arch != "gemma3":
        raise ValueError(f"{arch}.rope.scaling.type linear: only gemma3 scales (its global "
                         "layers)")
    return float(meta[f"{arch}.rope.scaling.factor"])


# --- weight tables ----------------------------------------------------------------------------

_L, _B = "model.layers.{i}.", "blk.{i}."
# (our parameter, HF sources, GGUF sources, when); several sources concatenate along dim 0
_TABLE = (
    ("tok_embeddings.weight", ("model.embed_tokens.weight",), ("token_embd.weight",), "always"),
    ("layers.{i}.attention_norm.weight", (_L + "input_layernorm.weight",),
     (_B + "attn_norm.weight",), "always"),
    ("layers.{i}.attention.wqkv.weight",
     tuple(_L + f"self_attn.{p}_proj.weight" for p in "qkv"),
     tuple(_B + f"attn_{p}.weight" for p in "qkv"), "always"),
    ("layers.{i}.attention.wo.weight", (_L + "self_attn.o_proj.weight",),
     (_B + "attn_output.weight",), "always"),
    ("layers.{i}.attention.q_norm.weight", (_L + "self_attn.q_norm.weight",),
     (_B + "attn_q_norm.weight",), "qk_norm"),
    ("layers.{i}.attention.k_norm.weight", (_L + "self_attn.k_norm.weight",),
     (_B + "attn_k_norm.weight",), "qk_norm"),
    ("layers.{i}.post_attention_norm.weight", (_L + "post_attention_layernorm.weight",),
     (_B + "post_attention_norm.weight",), "always"),
    ("layers.{i}.ffn_norm.weight", (_L + "pre_feedforward_layernorm.weight",),
     (_B + "ffn_norm.weight",), "always"),
    ("layers.{i}.feed_forward.w13.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
     (_B + "ffn_gate.weight", _B + "ffn_up.weight"), "always"),
    ("layers.{i}.feed_forward.w2.weight", (_L + "mlp.down_proj.weight",),
     (_B + "ffn_down.weight",), "always"),
    ("layers.{i}.post_ffn_norm.weight", (_L + "post_feedforward_layernorm.weight",),
     (_B + "post_ffw_norm.weight",), "always"),
    ("norm.weight", ("model.norm.weight",), ("output_norm.weight",), "always"),
    ("output.weight", ("lm_head.weight",), ("output.weight",), "untied"),
)


def _unshift_norm(w: torch.Tensor, cfg: DecoderConfig) -> torch.Tensor:
    """llama.cpp stores a Gemma norm weight as 1 + w; ours is w."""
    return w - 1.0


def _rules(fmt: str, prefix: str = "") -> tuple[Rule, ...]:
    col = 1 if fmt == "hf" else 2
    shift = _unshift_norm if fmt == "gguf" else None
    return tuple(Rule(row[0], tuple(Piece(prefix + n, shift if row[0].endswith("norm.weight")
                                          else None) for n in row[col]), row[3])
                 for row in _TABLE)


HF_RULES, GGUF_RULES = _rules("hf"), _rules("gguf")
# Gemma3ForConditionalGeneration: the text model under language_model., beside the vision
# tower and its projector (not read)
IMAGE_TEXT_RULES = _rules("hf", "language_model.")
IMAGE_TEXT_IGNORE = HF_IGNORE + (r"vision_tower\..*", r"multi_modal_projector\..*",
                                 r"language_model\.lm_head\.weight")

FAMILY = Family(
    name="gemma", hf_model_types=("gemma2", "gemma3_text"),
    gguf_archs=("gemma2", "gemma3"),
    config_from_hf=config_from_hf,
    gguf_options=lambda arch, names: {},
    hf_rules=HF_RULES, hf_ignore=HF_IGNORE,
    gguf_rules=lambda arch: GGUF_RULES,
    model=GemmaModel, gguf_config=gguf_config, gguf_rope_scaling=("linear",))

# Registered by model_type gemma3 only; a GGUF `gemma3` config (family "gemma3") finds it by
# that name too, hence the same GGUF tables and model.
IMAGE_TEXT = replace(FAMILY, name="gemma3 (text of image-text)", hf_model_types=("gemma3",),
                     gguf_archs=(), hf_rules=IMAGE_TEXT_RULES, hf_ignore=IMAGE_TEXT_IGNORE)
