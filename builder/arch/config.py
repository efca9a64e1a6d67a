"""The decoder's model config: one frozen dataclass every family fills from its source.

Families (builder/arch/families.py `config_from_hf`, the GGUF source) read a HF config.json or GGUF metadata into it; the
shared blocks (builder/arch/blocks.py) read their options from it. A setting the blocks
cannot honour is refused while reading (builder/arch/family.py), never dropped.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency-dependent RoPE scaling."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LongRope:
    """LongRoPE (Phi-3 / Phi-4): each inverse frequency divided by its own factor, one set
    for contexts up to original_max_position_embeddings and one beyond; cos and sin are
    multiplied by attention_factor. A compiled step cannot switch sets by the length of a
    sequence (the K already cached keep their rotation), so one set serves every position
    of a plan: `long`, which the builder sets when limits.max_seq_len exceeds
    original_max_position_embeddings (`for_max_seq_len`)."""
    short_factor: tuple[float, ...]       # [rotary_dim / 2]
    long_factor: tuple[float, ...]        # [rotary_dim / 2]
    original_max_position_embeddings: int
    attention_factor: float
    long: bool = False

    @property
    def factors(self) -> tuple[float, ...]:
        return self.long_factor if self.long else self.short_factor


class UnsupportedConfig(ValueError):
    """A config setting that changes the model's math and that kiln does not implement."""

    def __init__(self, key: str, value, supported: str, family: str):
        self.key, self.value = key, value
        super().__init__(f"config.json {key}={value!r} is not supported for model_type "
                         f"{family!r}; supported: {supported}")


@dataclass(frozen=True)
class DecoderConfig:
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
    longrope: Optional[LongRope] = None   # Phi-3 / Phi-4 LongRoPE (not with rope_scaling)
    partial_rotary_factor: float = 1.0    # RoPE rotates the first rotary_dim of each head
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False          # biases on q/k/v (Qwen2)
    qk_norm: bool = False                 # per-head RMSNorm of q and k before RoPE (Qwen3)
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    family: str = "llama"                 # the HF model_type / GGUF architecture read from
    sliding_window: Optional[int] = None  # each token attends to the last this many tokens
                                          # (itself included); None: the whole context
    sliding_layers: tuple[int, ...] = ()  # the layers the window applies to; () with a
                                          # window: every layer (Mistral); others are global
    attn_logit_softcap: Optional[float] = None   # scores -> c * tanh(scores / c) (Gemma 2)
    final_logit_softcap: Optional[float] = None  # logits -> c * tanh(logits / c)
    query_scale: Optional[float] = None   # attention score scale; None: 1 / sqrt(head_dim)
    # Gemma (builder/arch/gemma.py): a norm after attention and after the MLP too (4 a layer);
    # the sliding layers' RoPE base (None: rope_theta); a linear RoPE scaling of the others
    post_norms: bool = False
    rope_local_theta: Optional[float] = None
    rope_global_factor: float = 1.0
    # Mixture of experts (builder/arch/moe.py); num_experts 0: every layer is a dense MLP
    num_experts: int = 0                  # experts per sparse layer
    experts_per_token: int = 0            # top-k experts each token is routed to
    moe_intermediate_size: int = 0        # one expert's hidden width
    normalize_topk: bool = True           # top-k softmax weights renormalized to sum to 1
    sparse_layers: tuple[int, ...] = ()   # the layers whose MLP is the experts

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")

    def window_for(self, layer: int) -> int:
        """The attention window of a layer in tokens; 0: the whole context."""
        if self.sliding_window is None:
            return 0
        if self.sliding_layers and layer not in self.sliding_layers:
            return 0
        return self.sliding_window

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def for_max_seq_len(self, max_seq_len: int) -> "DecoderConfig":
        """This config for a plan of max_seq_len tokens: LongRoPE's long factors when it
        exceeds original_max_position_embeddings, else the short ones."""
        if self.longrope is None:
            return self
        long = max_seq_len > self.longrope.original_max_position_embeddings
        return replace(self, longrope=replace(self.longrope, long=long))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderConfig":
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        if d.get("longrope"):
            lr = d["longrope"]
            d["longrope"] = LongRope(**{**lr, "short_factor": tuple(lr["short_factor"]),
                                        "long_factor": tuple(lr["long_factor"])})
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["sparse_layers"] = tuple(d.get("sparse_layers", ()))
        d["sliding_layers"] = tuple(d.get("sliding_layers", ()))
        return cls(**d)

    @property
    def num_parameters(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        if self.attention_bias:
            attn += (self.num_heads + 2 * self.num_kv_heads) * d
        if self.qk_norm:
            attn += 2 * d
        layer = attn + (4 if self.post_norms else 2) * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        sparse = len(self.sparse_layers)
        experts = self.num_experts * (3 * h * self.moe_intermediate_size) + h * self.num_experts
        return (self.num_layers * layer + (self.num_layers - sparse) * 3 * h * i
                + sparse * experts + emb + h)
