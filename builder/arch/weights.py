"""Weight loading as a declared name mapping (STYLE.md item 6): the machinery every family's
table uses.

A family (builder/arch/families.py) declares, for every parameter of the decoder, its source
tensors in a Hugging Face checkpoint and in a GGUF file and the transform that turns them
into ours. Several sources are concatenated along dim 0 (rows), in the order listed.
`expand_rules` expands a family's tables for a config and checks them against the names a
checkpoint holds: a missing source or a source nobody consumes (and that is not on the
explicit ignore list) is an error naming it. Nothing here reads files.

llama.cpp stores the q and k rows of some architectures permuted for its rope layout
(interleaved pairs instead of HF's rotate_half halves); `unpermute_q`/`unpermute_k` undo it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kiln.builder.arch.config import DecoderConfig

PieceTransform = Callable[[torch.Tensor, DecoderConfig], torch.Tensor]

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


def unpermute_q(w: torch.Tensor, cfg: DecoderConfig) -> torch.Tensor:
    return unpermute_rope(w, cfg.num_heads)


def unpermute_k(w: torch.Tensor, cfg: DecoderConfig) -> torch.Tensor:
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
    when: str = "always"          # always | untied | or a bool field of the config
                                  # (attention_bias, qk_norm): mapped only when it is set
                                  # | sparse_layer | dense_layer (LAYER_WHEN)
    stacked: bool = False         # pieces are 3-D expert stacks [E, rows, K]: joined per
                                  # expert (dim 1), then flattened to [E * rows, K]


def pieces(*names: str) -> tuple[Piece, ...]:
    return tuple(Piece(n) for n in names)


@dataclass(frozen=True)
class Mapped:
    """One parameter of ours and the concrete source tensors it is made from."""
    target: str
    pieces: tuple[Piece, ...]     # names with the layer index filled in
    stacked: bool = False         # Rule.stacked

    def build(self, read: Callable[[str], torch.Tensor], cfg: DecoderConfig) -> torch.Tensor:
        """Read, transform and concatenate the pieces; ValueError naming them if they do
        not fit together (a misshapen source tensor)."""
        raw = [read(p.name) for p in self.pieces]
        try:
            parts = [p.transform(t, cfg) if p.transform else t for p, t in zip(self.pieces, raw)]
            if self.stacked:
                for p, t in zip(self.pieces, parts):
                    if t.dim() != 3 or t.shape[0] != cfg.num_experts:
                        raise ValueError(f"{p.name} {list(t.shape)} is not a stack of "
                                         f"{cfg.num_experts} experts (the config's count)")
                return torch.cat(parts, dim=1).flatten(0, 1)
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


# Rule.when values that select layers: the sparse (experts) ones or the dense ones.
LAYER_WHEN = {"sparse_layer": lambda cfg, i: i in cfg.sparse_layers,
              "dense_layer": lambda cfg, i: i not in cfg.sparse_layers}


def _per_expert(ps: tuple[Piece, ...], cfg: DecoderConfig) -> tuple[Piece, ...]:
    """Pieces naming `{e}` repeated for each expert e (all of one expert's pieces, then the
    next expert's): the experts' matrices stacked along dim 0."""
    if not any("{e}" in p.name for p in ps):
        return ps
    return tuple(Piece(p.name.replace("{e}", str(e)), p.transform)
                 for e in range(cfg.num_experts) for p in ps)


def expand_rules(cfg: DecoderConfig, rules: tuple[Rule, ...], ignore: tuple[str, ...],
                 available: set[str] | list[str]) -> list[Mapped]:
    """Expand `rules` for `cfg` and check them against the source names `available`
    (`ignore`: regexes of names nobody needs). families.plan_mapping picks the rules.

    Raises MappingError naming every missing source and every unused, unignored one.
    """
    available = set(available)
    plan: list[Mapped] = []
    for rule in rules:
        if rule.when == "untied":
            if cfg.tie_word_embeddings:
                continue
        elif rule.when not in ("always", *LAYER_WHEN) and not getattr(cfg, rule.when):
            continue
        layers = range(cfg.num_layers) if "{i}" in rule.target else [None]
        if rule.when in LAYER_WHEN:
            layers = [i for i in layers if LAYER_WHEN[rule.when](cfg, i)]
        for i in layers:
            fill = (lambda s: s.format(i=i)) if i is not None else (lambda s: s)
            plan.append(Mapped(fill(rule.target), tuple(
                Piece(fill(p.name), p.transform) for p in _per_expert(rule.pieces, cfg)),
                rule.stacked))
    used = {p.name for m in plan for p in m.pieces}
    missing = [(m.target, p.name) for m in plan for p in m.pieces if p.name not in available]
    ign = [re.compile(pat) for pat in ignore]
    unused = sorted(n for n in available - used if not any(r.fullmatch(n) for r in ign))
    if missing or unused:
        raise MappingError(missing, unused)
    return plan
