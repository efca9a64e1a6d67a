"""Where each LlamaModel parameter comes from, declared once (STYLE.md item 6).

For every parameter of `builder.arch.llama.LlamaModel` the tables below give its source
tensors in a Hugging Face checkpoint and in a GGUF file, and the transform that turns them
into ours. Several sources are concatenated along dim 0 (rows), in the order listed:

    wqkv = [q; k; v]          [(H + 2*KVH) * D, hidden]   (and the bias, Qwen2)
    w13  = [gate; up]         [2 * inter, hidden]

llama.cpp stores the q and k rows of Llama-family models permuted for its rope layout
(interleaved pairs instead of HF's rotate_half halves); `unpermute_rope` undoes that.
Qwen2 GGUFs use the NeoX layout and are stored unpermuted.

`plan_mapping` expands the tables for a config and checks them against the names a
checkpoint holds: a missing source or a source nobody consumes (and that is not on the
explicit ignore list) is an error naming it. Nothing here reads files.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kiln.builder.arch.llama import LlamaConfig

PieceTransform = Callable[[torch.Tensor, LlamaConfig], torch.Tensor]


def unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` (convert_hf_to_gguf.py) on q or k rows (weight or bias).

    llama.cpp: w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)
    inverse:   w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)
    """
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's `permute` (HF layout -> GGUF layout); tests use it to write GGUFs."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _unpermute_q(w: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    return unpermute_rope(w, cfg.num_heads)


def _unpermute_k(w: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    return unpermute_rope(w, cfg.num_kv_heads)


@dataclass(frozen=True)
class Piece:
    """One source tensor of a parameter, with an optional transform applied before concat."""
    name: str                                   # source name; `{i}` is the layer index
    transform: Optional[PieceTransform] = None


@dataclass(frozen=True)
class Rule:
    target: str                   # our parameter name; `{i}` is the layer index
    pieces: tuple[Piece, ...]     # concatenated along dim 0 when more than one
    when: str = "always"          # always | bias (cfg.attention_bias) | untied


def _p(*names: str) -> tuple[Piece, ...]:
    return tuple(Piece(n) for n in names)


_HF_ATT = "model.layers.{i}.self_attn."
_HF_MLP = "model.layers.{i}.mlp."
HF_RULES: tuple[Rule, ...] = (
    Rule("tok_embeddings.weight", _p("model.embed_tokens.weight")),
    Rule("layers.{i}.attention_norm.weight", _p("model.layers.{i}.input_layernorm.weight")),
    Rule("layers.{i}.attention.wqkv.weight",
         _p(_HF_ATT + "q_proj.weight", _HF_ATT + "k_proj.weight", _HF_ATT + "v_proj.weight")),
    Rule("layers.{i}.attention.wqkv.bias",
         _p(_HF_ATT + "q_proj.bias", _HF_ATT + "k_proj.bias", _HF_ATT + "v_proj.bias"), "bias"),
    Rule("layers.{i}.attention.wo.weight", _p(_HF_ATT + "o_proj.weight")),
    Rule("layers.{i}.ffn_norm.weight", _p("model.layers.{i}.post_attention_layernorm.weight")),
    Rule("layers.{i}.feed_forward.w13.weight",
         _p(_HF_MLP + "gate_proj.weight", _HF_MLP + "up_proj.weight")),
    Rule("layers.{i}.feed_forward.w2.weight", _p(_HF_MLP + "down_proj.weight")),
    Rule("norm.weight", _p("model.norm.weight")),
    Rule("output.weight", _p("lm_head.weight"), "untied"),
)
# Present in some checkpoints, never needed: rope tables we recompute.
HF_IGNORE = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"model\.rotary_emb\.inv_freq")
# A tied checkpoint may still carry lm_head.weight (a copy of the embedding).
HF_IGNORE_TIED = (r"lm_head\.weight",)


def _gguf_rules(permuted: bool) -> tuple[Rule, ...]:
    q = _unpermute_q if permuted else None
    k = _unpermute_k if permuted else None
    b = "blk.{i}."
    return (
        Rule("tok_embeddings.weight", _p("token_embd.weight")),
        Rule("layers.{i}.attention_norm.weight", _p(b + "attn_norm.weight")),
        Rule("layers.{i}.attention.wqkv.weight",
             (Piece(b + "attn_q.weight", q), Piece(b + "attn_k.weight", k),
              Piece(b + "attn_v.weight"))),
        Rule("layers.{i}.attention.wqkv.bias",
             (Piece(b + "attn_q.bias", q), Piece(b + "attn_k.bias", k),
              Piece(b + "attn_v.bias")), "bias"),
        Rule("layers.{i}.attention.wo.weight", _p(b + "attn_output.weight")),
        Rule("layers.{i}.ffn_norm.weight", _p(b + "ffn_norm.weight")),
        Rule("layers.{i}.feed_forward.w13.weight",
             _p(b + "ffn_gate.weight", b + "ffn_up.weight")),
        Rule("layers.{i}.feed_forward.w2.weight", _p(b + "ffn_down.weight")),
        Rule("norm.weight", _p("output_norm.weight")),
        Rule("output.weight", _p("output.weight"), "untied"),
    )


# llama.cpp permutes q/k for the architectures it runs with the "normal" (GPT-J style) rope.
GGUF_PERMUTED_ARCHS = ("llama", "mistral")
GGUF_IGNORE: tuple[str, ...] = ()


def rules_for(fmt: str, family: str) -> tuple[tuple[Rule, ...], tuple[str, ...]]:
    """(rules, ignore patterns) for a source format ('hf' | 'gguf') and model family."""
    if fmt == "hf":
        return HF_RULES, HF_IGNORE
    if fmt == "gguf":
        return _gguf_rules(family in GGUF_PERMUTED_ARCHS), GGUF_IGNORE
    raise ValueError(f"unknown source format {fmt!r}")


@dataclass(frozen=True)
class Mapped:
    """One parameter of ours and the concrete source tensors it is made from."""
    target: str
    pieces: tuple[Piece, ...]     # names with the layer index filled in

    def build(self, read: Callable[[str], torch.Tensor], cfg: LlamaConfig) -> torch.Tensor:
        """Read, transform and concatenate the pieces; ValueError naming them if they do
        not fit together (a misshapen source tensor)."""
        raw = [read(p.name) for p in self.pieces]
        try:
            parts = [p.transform(t, cfg) if p.transform else t for p, t in zip(self.pieces, raw)]
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        except RuntimeError as e:
            shapes = ", ".join(f"{p.name} {list(t.shape)}" for p, t in zip(self.pieces, raw))
            raise ValueError(f"cannot make {self.target} from {shapes}: "
                             f"{str(e).splitlines()[0]}") from None


class MappingError(ValueError):
    """Sources missing or left over; `missing` and `unused` name them."""

    def __init__(self, missing: list[tuple[str, str]], unused: list[str]):
        self.missing, self.unused = missing, unused
        msgs = []
        if missing:
            msgs.append("missing tensors: " + ", ".join(
                f"{src} (for {tgt})" for tgt, src in missing))
        if unused:
            msgs.append("unexpected tensors (not used by the model): " + ", ".join(unused))
        super().__init__("; ".join(msgs))


def plan_mapping(cfg: LlamaConfig, fmt: str, available: set[str] | list[str]) -> list[Mapped]:
    """Expand the rules for `cfg` and check them against the source names `available`.

    Raises MappingError naming every missing source and every unused, unignored one.
    """
    rules, ignore = rules_for(fmt, cfg.family)
    if fmt == "hf" and cfg.tie_word_embeddings:
        ignore = ignore + HF_IGNORE_TIED
    available = set(available)
    plan: list[Mapped] = []
    for rule in rules:
        if rule.when == "bias" and not cfg.attention_bias:
            continue
        if rule.when == "untied" and cfg.tie_word_embeddings:
            continue
        layers = range(cfg.num_layers) if "{i}" in rule.target else [None]
        for i in layers:
            fill = (lambda s: s.format(i=i)) if i is not None else (lambda s: s)
            plan.append(Mapped(fill(rule.target),
                               tuple(Piece(fill(p.name), p.transform) for p in rule.pieces)))
    used = {p.name for m in plan for p in m.pieces}
    missing = [(m.target, p.name) for m in plan for p in m.pieces if p.name not in available]
    ign = [re.compile(pat) for pat in ignore]
    unused = sorted(n for n in available - used if not any(r.fullmatch(n) for r in ign))
    if missing or unused:
        raise MappingError(missing, unused)
    return plan
