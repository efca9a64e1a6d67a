"""Sampling parameters (validated once, at submission) and the batched sampler.

The sampler turns the step's logits [B, vocab] into one token per row, each row under its
own request's parameters, with tensor ops over the whole batch; only rows that need a
per-row step (a seeded generator, min_tokens, bad words) get one. Order, as in vLLM/HF:

    penalties (repetition on prompt+output; presence/frequency on output)
    -> masks (stop tokens before min_tokens; bad words; grammar bitmasks, runtime/guided.py)
    -> greedy rows: argmax
    -> temperature -> top-k -> top-p -> softmax -> min-p -> draw

Drawing takes one uniform number a row (inverse of the cumulative distribution), from the
request's own torch.Generator when it is seeded: the same seed and prompt give the same
tokens whatever else shares the batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

import torch

from kiln.contracts import FieldError
from kiln.runtime.guided import GuidedDecoding, apply_bitmask

MAX_LOGPROBS = 20   # top alternatives per token a request may ask for
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1   # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability under the model (the raw logits, before penalties,
    masks and temperature) and the most likely alternatives, most likely first."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()      # (token id, logprob) x params.logprobs


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops. Raises ValueError naming a bad field."""
    max_tokens: int = 16                 # output tokens at most
    min_tokens: int = 0                  # stop tokens are masked until this many are out
    temperature: float = 1.0             # 0 = greedy
    top_k: int = 0                       # 0 = off
    top_p: float = 1.0                   # nucleus mass, 1 = off
    min_p: float = 0.0                   # drop tokens below min_p * p(max); 0 = off
    repetition_penalty: float = 1.0      # HF style, on prompt and output tokens; 1 = off
    presence_penalty: float = 0.0        # OpenAI style, on output tokens
    frequency_penalty: float = 0.0       # OpenAI style, on output tokens
    seed: Optional[int] = None           # per-request generator; None = engine's randomness
    stop: tuple[str, ...] = ()           # stop strings, cut from the output text
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens (besides eos)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False             # do not stop at eos
    bad_words: tuple[str, ...] = ()      # never generate these words (as token sequences)
    bad_token_ids: tuple[int, ...] = ()  # never generate these tokens
    skip_special_tokens: bool = True     # in the output text
    logprobs: Optional[int] = None       # per output token: its logprob and the top-N
    #                                      alternatives (0: the chosen token only); None: off
    guided: Optional[GuidedDecoding] = None  # constrain the output (JSON schema, regex, ...)
    max_draft_tokens: Optional[int] = None   # speculative drafts a step at most (0: none);
    #                                          None: the plan's speculative.max_draft_tokens
    adapter: Optional[str] = None        # the loaded LoRA adapter to run with (None: base)

    def __post_init__(self):
        for name in ("stop", "bad_words"):
            v = getattr(self, name)
            object.__setattr__(self, name, (v,) if isinstance(v, str) else tuple(v or ()))
        for name in ("stop_token_ids", "bad_token_ids"):
            object.__setattr__(self, name, tuple(getattr(self, name) or ()))
        self._validate()

    def _validate(self) -> None:
        def bad(name, allowed):   # FieldError: each API names the field in its own terms
            problem = f"= {getattr(self, name)!r}: {allowed}"
            raise FieldError(name, problem, f"SamplingParams.{name} {problem}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if not _is_num(self.temperature) or not 0 <= self.temperature <= 100:
            bad("temperature", "must be in [0, 100] (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an integer >= 0 (0 or -1 = off)")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_num(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(name, "must be in [-2, 2]")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            bad("seed", f"must be None or an integer in [{SEED_MIN}, {SEED_MAX}]")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be non-empty strings")
        for name in ("stop_token_ids", "bad_token_ids"):
            if not all(_is_int(t) and t >= 0 for t in getattr(self, name)):
                bad(name, "must be non-negative integers")
        if not all(isinstance(s, str) and s for s in self.bad_words):
            bad("bad_words", "must be non-empty strings")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            bad("adapter", "must be None or a loaded adapter's name")
        if self.max_draft_tokens is not None and (not _is_int(self.max_draft_tokens)
                                                  or self.max_draft_tokens < 0):
            bad("max_draft_tokens", "must be None or an integer >= 0 (0 = no speculation)")
        if self.guided is not None and not isinstance(self.guided, GuidedDecoding):
            bad("guided", "must be None or a runtime.guided.GuidedDecoding")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """A repetition, presence or frequency penalty changes the logits."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """From a dict of field values; an unknown key is a ValueError naming it."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"SamplingParams has no field {unknown[0]!r}; fields: "
                             f"{', '.join(sorted(names))}")
        return cls(**d)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    """A finite int or float (NaN and infinities are refused everywhere)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class SamplingState:
    """A request's sampling state, kept by the engine across steps."""
    params: SamplingParams
    generator: Optional[torch.Generator] = None     # seeded requests only
    bad_words_ids: list[list[int]] = field(default_factory=list)  # token sequences to avoid
    min_tokens_mask: tuple[int, ...] = ()          # stop ids masked before min_tokens
    guide: Optional[object] = None                 # runtime.guided.Guide of a constrained request

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits but the min_tokens mask: the token is
        the raw argmax unless that is a masked stop id (Sampler's fast path: after a decode
        step's weights have streamed through the caches, the general path's logits copy and
        indexed writes cost ~0.2 ms of cold-cache Python a step, the argmax alone ~20 us)."""
        return (self.params.greedy and not self.params.penalized and not self.bad_words_ids
                and self.guide is None)

    def masks_stops(self, generated: int) -> bool:
        """The min_tokens mask still holds the stop ids back after `generated` tokens."""
        return bool(self.min_tokens_mask) and generated < self.params.min_tokens

    @classmethod
    def create(cls, params: SamplingParams, stop_ids: Sequence[int] = (),
               bad_words_ids: Sequence[Sequence[int]] = ()) -> "SamplingState":
        gen = None
        if params.seed is not None:
            gen = torch.Generator().manual_seed(params.seed)
        bad = [list(w) for w in bad_words_ids if w] + [[t] for t in params.bad_token_ids]
        return cls(params, gen, bad, tuple(stop_ids) if params.min_tokens else ())


def _argmax(x: torch.Tensor) -> list[int]:
    """Row-wise argmax of [B, vocab] -> ids (the first maximum; NaN counts as the maximum,
    as in torch). On CPU through numpy: ATen's argmax over a 49k vocabulary takes 30 us,
    numpy's 4 us, once per decode step."""
    if x.device.type == "cpu":
        return x.detach().numpy().argmax(axis=-1).tolist()
    return x.argmax(dim=-1).tolist()


class Sampler:
    """Samples one token per row of a logits batch; rows are (SamplingState, token history)."""

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState],
                 token_ids: Sequence[Sequence[int]], num_prompt_tokens: Sequence[int],
                 guided: Optional[tuple[list[int], torch.Tensor]] = None) -> list[int]:
        """logits [B, vocab] float32; token_ids[i] = row i's prompt + output so far;
        guided: (rows, bitmask [len(rows), ceil(vocab/32)]) of the constrained rows."""
        if guided is None and all(s.plain_greedy for s in states):
            toks = _argmax(logits.float())
            if not any(t in s.min_tokens_mask and s.masks_stops(len(h) - n)
                       for s, t, h, n in zip(states, toks, token_ids, num_prompt_tokens)):
                return toks
        P = [s.params for s in states]
        logits = self._processed(logits, states, token_ids, num_prompt_tokens, guided)
        greedy = [p.greedy for p in P]
        if all(greedy):
            return _argmax(logits)
        argmaxes = _argmax(logits) if any(greedy) else None
        probs, bad, fallback = self._weights(logits, P)
        tokens = self._draw(probs, states)
        for i, t in zip(bad, fallback):
            tokens[i] = t
        if argmaxes is not None:
            tokens = [a if g else t for a, t, g in zip(argmaxes, tokens, greedy)]
        return tokens

    def probs(self, logits: torch.Tensor, states: Sequence[SamplingState],
              token_ids: Sequence[Sequence[int]], num_prompt_tokens: Sequence[int]
              ) -> torch.Tensor:
        """The distribution each row's token is drawn from, as __call__ draws it: [B, vocab]
        float32, each row summing to 1 (one-hot on the argmax for greedy rows, and for rows
        whose logits are all masked or not finite)."""
        P = [s.params for s in states]
        x = self._processed(logits, states, token_ids, num_prompt_tokens, None)
        one_hot = [i for i, p in enumerate(P) if p.greedy]
        hot = _argmax(x[one_hot]) if one_hot else []
        probs, bad, fallback = self._weights(x, P)
        probs.div_(probs.sum(dim=-1, keepdim=True))
        for i, t in zip(one_hot + bad, hot + fallback):
            probs[i] = 0.0
            probs[i, t] = 1.0
        return probs

    def _processed(self, logits: torch.Tensor, states: Sequence[SamplingState],
                   token_ids: Sequence[Sequence[int]], num_prompt_tokens: Sequence[int],
                   guided: Optional[tuple[list[int], torch.Tensor]]) -> torch.Tensor:
        """A float32 copy of logits with penalties, masks and grammar bitmasks applied."""
        logits = logits.float().clone()
        self._penalize(logits, [s.params for s in states], token_ids, num_prompt_tokens)
        self._mask(logits, states, token_ids, num_prompt_tokens)
        if guided is not None:     # grammar masks: one vectorized masked_fill over the rows
            apply_bitmask(logits, *guided)
        return logits

    def _weights(self, x: torch.Tensor, P: Sequence[SamplingParams]
                 ) -> tuple[torch.Tensor, list[int], list[int]]:
        """Processed logits (consumed) -> (unnormalized probabilities after temperature,
        top-k, top-p and min-p; the rows with no finite maximum, and each one's argmax)."""
        V = x.shape[1]
        temps = [p.temperature for p in P]
        # from here on in place on x (the caller's own copy): at 32 rows each new
        # [B, vocab] tensor costs as much again as the pass that fills it
        x = x.div_(torch.tensor([t if t > 0 else 1.0 for t in temps])[:, None])
        mx = x.amax(dim=-1, keepdim=True)
        bad = ~torch.isfinite(mx[:, 0])      # all masked, or NaN / +inf: that row's argmax
        fallback = _argmax(x[bad]) if bool(bad.any()) else []
        probs = x.sub_(mx).exp_()            # unnormalized: 1 at the max, 0 where masked
        ks = [p.top_k if p.top_k > 0 else V for p in P]
        if min(ks) < V:                  # keep each row's k most likely (and ties of the k-th)
            kmax = max(k for k in ks if k < V)
            kth = probs.topk(kmax, dim=-1).values                             # [B, kmax]
            thresh = kth.gather(1, torch.tensor([min(k, kmax) - 1 for k in ks])[:, None])
            thresh[torch.tensor([k >= V for k in ks])] = 0.0
            probs.mul_(probs >= thresh)
        tops = [p.top_p for p in P]
        if min(tops) < 1.0:
            self._top_p(probs, tops)
        min_ps = [p.min_p for p in P]
        if max(min_ps) > 0:
            cut = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_ps)[:, None]
            probs.mul_(probs >= cut)
        return probs, bad.nonzero()[:, 0].tolist(), fallback

    @staticmethod
    def _top_p(probs: torch.Tensor, tops: Sequence[float], candidates: int = 256) -> None:
        """In place on probs (unnormalized): zero, in each row whose top_p < 1, every token
        the mass of the more likely tokens (after top-k) already reaches top_p of. The rows'
        most likely `candidates` tokens come from one topk; a row whose mass is not reached
        within them is sorted whole (a full sort of a 49k vocabulary: 2.5 ms, topk(256)
        0.14)."""
        V = probs.shape[1]
        rows = [i for i, t in enumerate(tops) if t < 1.0]
        sub = probs[rows]
        mass = sub.sum(dim=-1, keepdim=True) * torch.tensor([tops[i] for i in rows])[:, None]
        sv, si = sub.topk(min(candidates, V), dim=-1)                       # descending
        before = sv.cumsum(dim=-1) - sv
        keep = torch.zeros_like(sub).scatter_(1, si, (before < mass).float())
        short = (before[:, -1] + sv[:, -1] < mass[:, 0])     # mass not reached in the topk
        if bool(short.any()):
            sv, si = sub[short].sort(dim=-1, descending=True)
            keep[short] = torch.zeros_like(sv).scatter_(
                1, si, (sv.cumsum(dim=-1) - sv < mass[short]).float())
        probs[rows] = sub.mul_(keep)

    @staticmethod
    def _draw(probs: torch.Tensor, states: Sequence[SamplingState]) -> list[int]:
        """One token per row from its unnormalized probabilities (consumed): the first token
        whose cumulative probability exceeds u times the row's total, u uniform in [0, 1)
        from the request's own generator when it is seeded. One random number a row: the
        exponential race this replaces drew one per vocabulary entry (its cost: docs/JOURNAL.md,
        "Figures moved out of code comments")."""
        B, V = probs.shape
        u = torch.rand(B, 1)
        for i, s in enumerate(states):
            if s.generator is not None:
                u[i] = torch.rand(1, generator=s.generator)
        cdf = probs.cumsum_(dim=-1)
        total = cdf[:, -1:]
        tok = torch.searchsorted(cdf, u * total, right=True)[:, 0]
        over = tok >= V                   # u * total rounded up to the total (or NaN rows)
        if bool(over.any()):
            tok[over] = torch.searchsorted(cdf[over], total[over])[:, 0].clamp_(max=V - 1)
        return tok.tolist()

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: Sequence[int], top_n: Sequence[int]
                 ) -> list[TokenLogprobs]:
        """logits [R, vocab] (raw) of the rows that asked, their sampled tokens and how many
        alternatives each wants -> one TokenLogprobs per row."""
        lsm = torch.log_softmax(logits.float(), dim=-1)                       # [R, vocab]
        chosen = lsm.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        k = max(top_n)
        top_v, top_i = (lsm.topk(k, dim=-1) if k else (lsm[:, :0], lsm[:, :0].long()))
        top_v, top_i = top_v.tolist(), top_i.tolist()
        return [TokenLogprobs(t, lp, tuple(zip(top_i[r][:n], top_v[r][:n])))
                for r, (t, lp, n) in enumerate(zip(tokens, chosen, top_n))]

    @staticmethod
    def _penalize(logits, P, token_ids, num_prompt_tokens) -> None:
        rows = [i for i, p in enumerate(P) if p.penalized]
        if not rows:
            return
        V = logits.shape[1]
        for i in rows:  # one scatter per penalized row; O(history) tensor work, no Python per token
            p, toks, n_p = P[i], token_ids[i], num_prompt_tokens[i]
            row = logits[i]
            if p.repetition_penalty != 1.0 and toks:
                seen = torch.zeros(V, dtype=torch.bool)
                seen[torch.tensor(toks, dtype=torch.long)] = True
                pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row.copy_(torch.where(seen, pen, row))
            out = toks[n_p:]
            if out and (p.presence_penalty or p.frequency_penalty):
                counts = torch.zeros(V).index_add_(0, torch.tensor(out, dtype=torch.long),
                                                   torch.ones(len(out)))
                row.sub_(counts * p.frequency_penalty + (counts > 0).float() * p.presence_penalty)

    @staticmethod
    def _mask(logits, states, token_ids, num_prompt_tokens) -> None:
        for i, s in enumerate(states):
            if s.masks_stops(len(token_ids[i]) - num_prompt_tokens[i]):
                logits[i, list(s.min_tokens_mask)] = float("-inf")
            if s.bad_words_ids:
                out = token_ids[i][num_prompt_tokens[i]:]
                banned = [w[-1] for w in s.bad_words_ids
                          if len(w) == 1 or (len(out) >= len(w) - 1
                                             and list(out[len(out) - len(w) + 1:]) == w[:-1])]
                if banned:
                    logits[i, banned] = float("-inf")
