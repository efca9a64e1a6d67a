"""The Llama family (Llama 2/3, Mistral without sliding window, Qwen2, SmolLM), written once.

The module computes the packed-token engine step of DESIGN.md: no padding, sequences
concatenated along one token axis T; K/V written in place into per-layer paged pools by
`kiln::paged_attention`. It knows nothing of checkpoints (see builder/sources) or of
quantization (see builder/quantize): both are transforms applied around it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kiln.plugins.paged_kv import ops as paged_kv_ops  # registers kiln::paged_attention


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency-dependent RoPE scaling."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False          # Qwen2: biases on q/k/v
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    family: str = "llama"                 # llama | mistral | qwen2 (same module)
    sliding_window: Optional[int] = None  # Mistral: each token attends to the last this many
                                          # tokens; None: the whole context. The paged
                                          # attention op has no window: the builder refuses a
                                          # max_seq_len above it (build.check_spec_against_model)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaConfig":
        """From a Hugging Face config.json (LlamaForCausalLM, MistralForCausalLM, Qwen2...)."""
        mtype = cfg.get("model_type", "llama")
        if mtype not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"config.json model_type {mtype!r} is not supported; "
                             "supported: llama, mistral, qwen2")
        heads = cfg["num_attention_heads"]
        rs = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
        rope_theta = cfg.get("rope_theta", rs.get("rope_theta", 10000.0))
        scaling = None
        rtype = rs.get("rope_type", rs.get("type"))
        if rtype == "llama3":
            scaling = RopeScaling(float(rs["factor"]), float(rs["low_freq_factor"]),
                                  float(rs["high_freq_factor"]),
                                  int(rs["original_max_position_embeddings"]))
        elif rtype not in (None, "default"):
            raise ValueError(f"rope_scaling type {rtype!r} is not supported; supported: "
                             "default, llama3")
        window = None   # Qwen2 declares a window it uses only with use_sliding_window
        if mtype == "mistral" or cfg.get("use_sliding_window"):
            window = cfg.get("sliding_window") or None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6 if mtype == "qwen2" else 1e-5),
            rope_theta=float(rope_theta), rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", mtype == "qwen2"),
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids, family=mtype,
            sliding_window=window)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    @property
    def num_parameters(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        if self.attention_bias:
            attn += (self.num_heads + 2 * self.num_kv_heads) * d
        layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """[head_dim/2] float32 inverse frequencies, with Llama 3 scaling applied if configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
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
    """x [T, heads, D]; cos/sin [T, 1, D] float32 -> x rotated (HF's rotate_half layout)."""
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


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


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = 1.0 / math.sqrt(self.d)
        # q, k, v fused along the output dim: [(H + 2*KVH) * D, hidden]
        self.wqkv = nn.Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.d,
                              bias=cfg.attention_bias)
        self.wo = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)

    def forward(self, x, s: StepInputs, k_cache, v_cache):
        T = x.shape[0]
        qkv = self.wqkv(x)
        q, k, v = qkv.split([self.h * self.d, self.kvh * self.d, self.kvh * self.d], dim=-1)
        q = apply_rope(q.view(T, self.h, self.d), s.cos, s.sin)        # [T, H, D]
        k = apply_rope(k.view(T, self.kvh, self.d), s.cos, s.sin)      # [T, KVH, D]
        v = v.reshape(T, self.kvh, self.d)
        o = paged_kv_ops.paged_attention(q, k, v, k_cache, v_cache, s.slot_mapping,
                                         s.block_tables, s.context_lens, s.query_start_loc,
                                         self.scale)   # kiln::paged_attention(_triton on CUDA)
        return self.wo(o.reshape(T, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # gate|up
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)        # down

    def forward(self, x):
        gate, up = self.w13(x).split([self.inter, self.inter], dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    """One decoder layer: pre-norm attention then pre-norm MLP, each with its residual."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = MLP(cfg)

    def forward(self, x, s: StepInputs, k_cache, v_cache):
        x = x + self.attention(self.attention_norm(x), s, k_cache, v_cache)
        return x + self.feed_forward(self.ffn_norm(x))


class LlamaModel(nn.Module):
    """The packed-token engine step. forward() inputs follow DESIGN.md exactly."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        if self.output is not None:
            return self.output(h)
        return F.linear(h, self.tok_embeddings.weight)

    def forward(self, input_ids, positions, slot_mapping, block_tables, context_lens,
                query_start_loc, logits_indices, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor]) -> torch.Tensor:
        """-> logits [N, vocab] float32 for the N rows in logits_indices."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]     # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]             # [T, 1, D]
        s = StepInputs(positions, slot_mapping, block_tables, context_lens, query_start_loc,
                       emb.cos(), emb.sin())
        x = self.tok_embeddings(input_ids)                              # [T, hidden]
        for layer, kc, vc in zip(self.layers, k_caches, v_caches):
            x = layer(x, s, kc, vc)
        x = self.norm(x[logits_indices])                                # [N, hidden]
        return self.lm_head(x).float()


def param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of LlamaModel(cfg) with its shape, without allocating it."""
    with torch.device("meta"):
        m = LlamaModel(cfg)
    return {n: tuple(p.shape) for n, p in m.named_parameters()}
