"""Speculative decoding: n-gram (prompt-lookup) drafts, verified exactly by the target plan.

Per step, a sequence's row is [last token, d1..dm] with logits at all m+1 positions. At each
position the target's token is drawn as a plain step would draw it (same sampler, the
history as if the drafts before were kept); the drafts are kept while each equals the
target's token at its position, then the target's own token follows, so a step emits 1..m+1
tokens. The scheduler (plugins.inflight_batching) asks for drafts and rolls the KV of
rejected positions back; the model runner verifies.

    tokens:  a b c d x y a b c [?]      suffix "a b c" occurred at 0: propose "d x y"

Greedy requests: the output is the one greedy decoding gives, token for token. Sampled
requests: a draft is a point mass q, so rejection sampling accepts d with probability
min(1, p(d)/q(d)) = p(d) and on rejection draws from p with d removed; drawing t ~ p and
keeping d iff t == d does exactly that (P(keep) = p(d); a rejected t is p restricted to
t != d, renormalized), and all m kept means the bonus token is the draw at the last position.
Each position takes one uniform number; a seeded request's generator is left one draw past
each emitted token (model_runner), so its tokens are the ones it gets without speculation.

Which requests speculate: any without an output constraint or logprobs (guided and logprobs
requests decode one token a step). Which steps: those with at most `max_batch` decoding
sequences and no prefill work; a larger batch is closer to compute-bound, where the extra
positions cost about what they save, and a step with a prompt chunk or an admission is larger
anyway (any other step costs a draft model nothing: plugins.inflight_batching). How many: up to max_draft_tokens; a draft model's, fewer for a request
whose recent drafts were rejected (DraftRecord: each of its drafts costs a draft-plan step);
n-gram's, at most twice the length of the suffix that matched (a lookup costs nothing, a
rejected draft one position of the verify step, so the match is the evidence, not the
request's history: on the input-grounded prompts of bench/speculative.py this drafts past
one changed word at once, where backing off after it left the copied text undrafted).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

METHODS = ("ngram", "draft")   # draft: runtime/draft_model.py
SERVING = ("plan", "off")     # `kiln serve --speculative`: the plan's section, or none


@dataclass(frozen=True)
class SpeculativeConfig:
    """The plan's speculative section, as the engine uses it."""
    method: str = "ngram"
    max_draft_tokens: int = 4     # k: drafts per sequence per step
    ngram_min: int = 1            # shortest suffix looked up
    ngram_max: int = 4            # longest suffix looked up (tried first)
    max_batch: int = 4            # speculate only in steps with at most this many decodes

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative.method {self.method!r} is not known; allowed: "
                             f"{', '.join(METHODS)}")
        if self.max_draft_tokens < 1 or self.max_batch < 1:
            raise ValueError("speculative.max_draft_tokens and max_batch must be >= 1 (got "
                             f"{self.max_draft_tokens}, {self.max_batch})")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"speculative: need 1 <= ngram_min ({self.ngram_min}) <= "
                             f"ngram_max ({self.ngram_max})")


def serving_choice(value: Union[bool, str, SpeculativeConfig]
                   ) -> Union[bool, SpeculativeConfig]:
    """Engine.from_plan's `speculative`: "plan" (or True) = the plan's section, "off" (or
    False) = none, or a configuration of its own. ValueError naming the choices otherwise."""
    if isinstance(value, (bool, SpeculativeConfig)):
        return value
    if value not in SERVING:
        raise ValueError(f"speculative={value!r}: the choices are {', '.join(SERVING)} (the "
                         "plan's speculative section, or none)")
    return value == "plan"


@dataclass
class DraftRecord:
    """One request's speculation: its totals, and how many drafts its recent acceptance
    allows. A step that keeps none halves the allowance; at 0 the request drafts nothing
    for `cooling` of its steps (doubling each time, up to 64), then tries one draft again;
    a step that keeps all its drafts doubles the allowance (up to `max_k`) and resets the
    cooling. On text that does not repeat, speculation then costs a draft every few dozen
    steps. adapt=False (n-gram drafts) keeps the allowance at max_k and only counts."""
    max_k: int                  # the request's ceiling (the plan's, or lower if it asked)
    k: int = -1                 # drafts allowed now (-1: max_k)
    cooling: int = 4            # steps without drafts the next time k reaches 0
    rest: int = 0               # steps left without drafts
    drafted: int = 0            # draft tokens verified for the request
    accepted: int = 0           # of those, kept
    adapt: bool = True          # back off on rejection (a draft model's drafts cost steps)

    def __post_init__(self):
        if self.k < 0:
            self.k = self.max_k

    def limit(self) -> int:
        """Drafts allowed this step (a step of the request that may speculate)."""
        if self.rest:
            self.rest -= 1
            return 0
        return self.k

    def record(self, drafted: int, accepted: int) -> None:
        """A verified step: `accepted` of `drafted` drafts kept."""
        self.drafted += drafted
        self.accepted += accepted
        if not self.adapt:
            return
        if drafted and accepted == drafted:
            self.k, self.cooling = min(self.max_k, max(1, 2 * self.k)), 4
        elif drafted and accepted == 0:
            self.k //= 2
            if self.k == 0:
                self.rest, self.cooling, self.k = self.cooling, min(64, 2 * self.cooling), 1


class NgramIndex:
    """One sequence's n-grams (n in [n_min, n_max]) -> the latest position each started at,
    among those followed by at least one token. Grows with the sequence: each call indexes
    only the tokens added since the last."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self._last: dict[tuple[int, ...], int] = {}
        self._indexed = 0     # n-grams ending before this position are in _last

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        of `tokens` (n_max down to n_min tokens; see _copy), at most 2n for a suffix of n
        tokens (a lone token's match proposes two) -> [] when no suffix occurred before."""
        L = len(tokens)
        if k < 1 or L < 2:
            return []
        self._extend(tokens, L - 1)   # n-grams ending before the last token have a follower
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            start = self._last.get(tuple(tokens[L - n:]))
            if start is not None:
                return _copy(tokens, start + n, min(k, 2 * n))
        return []

    def _extend(self, tokens: Sequence[int], end: int) -> None:
        """Index every n-gram ending at a position in [_indexed, end)."""
        last = self._last
        for e in range(self._indexed, end):
            for n in range(self.n_min, min(self.n_max, e + 1) + 1):
                last[tuple(tokens[e + 1 - n:e + 1])] = e + 1 - n
        self._indexed = max(self._indexed, end)


def num_kept(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """Drafts kept: the length of the common prefix of drafts and the target's tokens at the
    same positions (targets has one more: the token after the last draft)."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


def _copy(tokens: Sequence[int], src: int, k: int) -> list[int]:
    """k tokens continuing `tokens` the way they went on after `src`, copied with overlap
    (as LZ77 does): where the copy reaches the end of `tokens` it goes on from its own start,
    so a pattern repeating every p tokens proposes k tokens, not just p."""
    L = len(tokens)
    out: list[int] = []
    for i in range(k):
        j = src + i
        out.append(tokens[j] if j < L else out[j - L])
    return out
