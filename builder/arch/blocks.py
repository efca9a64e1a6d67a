"""The shared blocks of kiln's decoder models: norms, RoPE, attention, MLP, the layer and
the packed-token engine step, each with the options families switch on (STYLE.md item 5).

The model computes the packed-token engine step of DESIGN.md: no padding, sequences
concatenated along one token axis T; K/V written in place into per-layer paged pools by
`kiln::paged_attention`. It knows nothing of checkpoints (see builder/sources) or of
quantization (see builder/quantize): both are transforms applied around it. Parameter names
are part of the contract with the weight mappings and the quantizer (which swaps the
nn.Linear modules): an option adds modules, it never renames one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kiln.builder.arch.config import DecoderConfig
from kiln.builder.arch.lora import ATTENTION_MODULES, LoraLayer, LoraStep
from kiln.builder.arch.moe import MoE
from kiln.contracts.manifest import LORA_MODULES
from kiln.plugins.paged_kv import ops as paged_kv_ops  # registers kiln::paged_attention


def rope_inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    """[rotary_dim/2] float32 inverse frequencies, with Llama 3 scaling or LongRoPE's
    factors (the set cfg.longrope.long picks) applied if configured."""
    d = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.longrope is not None:
        return inv / torch.tensor(cfg.longrope.factors, dtype=torch.float32)
    s = cfg.rope_scaling
    if s is None:
        return inv
    low_wl = s.original_max_position_embeddings / s.low_freq_factor
    high_wl = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wl, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return torch.where(medium, smoothed, scaled)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, 1, R] float32 -> x with its first R dims rotated (HF's
    rotate_half layout) and the other D - R passed through (partial rotary)."""
    r = cos.shape[-1]
    xf = x.float()
    out = xf[..., :r] * cos + _rotate_half(xf[..., :r]) * sin
    if r < x.shape[-1]:
        out = torch.cat((out, xf[..., r:]), dim=-1)
    return out.to(x.dtype)


@dataclass
class StepInputs:
    """The engine step's batch metadata (DESIGN.md, 'The engine step'); shared by layers."""
    positions: torch.Tensor        # [T]   position of each token in its sequence
    slot_mapping: torch.Tensor     # [T]   flat KV slot each token's K/V is written to
    block_tables: torch.Tensor     # [B, max_blocks]
    context_lens: torch.Tensor     # [B]   tokens in each sequence's KV after this step
    query_start_loc: torch.Tensor  # [B+1] offsets of each sequence's tokens along T
    cos: torch.Tensor = field(default=None)  # [T, 1, D]
    sin: torch.Tensor = field(default=None)
    lora: Optional[LoraStep] = None           # the step's adapters (a plan with lora)


class Attention(nn.Module):
    """GQA self-attention over the paged KV pools. Options: q/k/v bias (cfg.attention_bias),
    per-head q and k RMSNorm before RoPE (cfg.qk_norm), the layer's sliding window
    (cfg.window_for), score soft-capping (cfg.attn_logit_softcap), the score scale
    (cfg.query_scale)."""

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.query_scale or 1.0 / math.sqrt(self.d)
        self.window = cfg.window_for(layer)
        self.softcap = cfg.attn_logit_softcap or 0.0
        # q, k, v fused along the output dim: [(H + 2*KVH) * D, hidden]
        self.wqkv = nn.Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.d,
                              bias=cfg.attention_bias)
        self.wo = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:   # one [D] weight shared by every head
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, s: StepInputs, k_cache, v_cache, lora: Optional[LoraLayer] = None):
        T = x.shape[0]
        qkv = self.wqkv(x)
        q, k, v = qkv.split([self.h * self.d, self.kvh * self.d, self.kvh * self.d], dim=-1)
        if lora is not None:
            q, k, v = (lora.apply("q_proj", q, x), lora.apply("k_proj", k, x),
                       lora.apply("v_proj", v, x))
        q, k = q.view(T, self.h, self.d), k.view(T, self.kvh, self.d)  # [T, H|KVH, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, s.cos, s.sin)
        k = apply_rope(k, s.cos, s.sin)
        v = v.reshape(T, self.kvh, self.d)
        o = paged_kv_ops.paged_attention(q, k, v, k_cache, v_cache, s.slot_mapping,
                                         s.block_tables, s.context_lens, s.query_start_loc,
                                         self.scale, window=self.window, softcap=self.softcap)
        # kiln::paged_attention (kiln::paged_attention_triton on CUDA)
        o = o.reshape(T, self.h * self.d)
        return self.wo(o) if lora is None else lora.apply("o_proj", self.wo(o), o)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused in one linear. A subclass
    changes the gate's activation (`act`)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # gate|up
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)        # down

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate)

    def forward(self, x, lora: Optional[LoraLayer] = None):
        gate, up = self.w13(x).split([self.inter, self.inter], dim=-1)
        if lora is None:
            return self.w2(self.act(gate) * up)
        h = self.act(lora.apply("gate_proj", gate, x)) * lora.apply("up_proj", up, x)
        return lora.apply("down_proj", self.w2(h), h)


class TransformerBlock(nn.Module):
    """One decoder layer: pre-norm attention then pre-norm MLP, each with its residual."""

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = MoE(cfg) if layer in cfg.sparse_layers else GatedMLP(cfg)
        self.layer = layer

    def lora_modules(self) -> tuple[str, ...]:
        """The LoRA targets this layer applies: attention's, and the MLP's unless it is
        experts (a mixture of experts takes no LoRA terms)."""
        return LORA_MODULES if isinstance(self.feed_forward, GatedMLP) else ATTENTION_MODULES

    def forward(self, x, s: StepInputs, k_cache, v_cache):
        if s.lora is None:
            x = x + self.attention(self.attention_norm(x), s, k_cache, v_cache)
            return x + self.feed_forward(self.ffn_norm(x))
        lora = s.lora.layer(self.layer)
        x = x + self.attention(self.attention_norm(x), s, k_cache, v_cache, lora)
        if isinstance(self.feed_forward, GatedMLP):
            return x + self.feed_forward(self.ffn_norm(x), lora)
        return x + self.feed_forward(self.ffn_norm(x))


class DecoderModel(nn.Module):
    """The packed-token engine step. forward() inputs follow DESIGN.md exactly."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        # LongRoPE scales cos and sin (so q.k by its square); 1.0 otherwise
        self.rope_scale = cfg.longrope.attention_factor if cfg.longrope else 1.0
        self.lora_targets: tuple[str, ...] = ()   # enable_lora

    def enable_lora(self, targets: tuple[str, ...]) -> None:
        """Make the step take adapters for `targets` (builder/arch/lora.py); ValueError naming
        what the layers cannot take (expert MLPs; a layer that applies no LoRA terms)."""
        bad = [m for m in targets if m not in LORA_MODULES]
        if bad:
            raise ValueError(f"lora.target_modules: {bad[0]!r}; allowed: "
                             f"{', '.join(LORA_MODULES)}")
        family = self.cfg.family
        for layer in self.layers:
            if not hasattr(layer, "lora_modules"):
                raise ValueError(f"lora: the {family} family's layers "
                                 f"({type(layer).__name__}) do not take LoRA adapters")
            missing = [m for m in targets if m not in layer.lora_modules()]
            if missing and isinstance(getattr(layer, "feed_forward", None), MoE):
                raise ValueError(f"lora.target_modules {missing}: this {family} model's MLPs "
                                 "are experts (mixture of experts), which take no LoRA terms; "
                                 f"target attention modules only ({', '.join(ATTENTION_MODULES)})")
            if missing:
                raise ValueError(f"lora.target_modules {missing}: the {family} family's layers "
                                 f"({type(layer).__name__}) take LoRA terms on "
                                 f"{', '.join(layer.lora_modules())} only")
        self.lora_targets = tuple(targets)

    def lora_step(self, slots, scales, lora_a, lora_b) -> Optional[LoraStep]:
        """The step's adapter inputs by target (None: a step without them)."""
        if slots is None:
            return None
        return LoraStep.of(self.lora_targets, slots, scales, lora_a, lora_b)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        if self.output is not None:
            return self.output(h)
        return F.linear(h, self.tok_embeddings.weight)

    def forward(self, input_ids, positions, slot_mapping, block_tables, context_lens,
                query_start_loc, logits_indices, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor], lora_slots=None, lora_scales=None,
                lora_a=None, lora_b=None) -> torch.Tensor:
        """-> logits [N, vocab] float32 for the N rows in logits_indices. A plan with lora
        also takes the adapters (builder/arch/lora.py); without, the step is unchanged."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]     # [T, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]             # [T, 1, R]
        cos, sin = emb.cos(), emb.sin()
        if self.rope_scale != 1.0:
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        s = StepInputs(positions, slot_mapping, block_tables, context_lens, query_start_loc,
                       cos, sin, self.lora_step(lora_slots, lora_scales, lora_a, lora_b))
        x = self.tok_embeddings(input_ids)                              # [T, hidden]
        for layer, kc, vc in zip(self.layers, k_caches, v_caches):
            x = layer(x, s, kc, vc)
        x = self.norm(x[logits_indices])                                # [N, hidden]
        return self.lm_head(x).float()


def param_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of DecoderModel(cfg) with its shape, without allocating it."""
    with torch.device("meta"):
        m = DecoderModel(cfg)
    return {n: tuple(p.shape) for n, p in m.named_parameters()}
