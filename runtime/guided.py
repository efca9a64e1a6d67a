"""Constrained (guided) decoding: JSON schema, regex, choice and grammar constraints.

A request's constraint (`GuidedDecoding`, in its SamplingParams) is compiled at submission
by the engine's `GrammarCache` into a `Guide`: an llguidance matcher over the plan's
tokenizer. An invalid schema, regex or grammar is refused there (ValueError naming what is
wrong), never mid-stream. Each step, for the rows that sample a token and carry a guide:

    guides --Masker.fill (llguidance, its thread pool)--> bitmask [R, ceil(V/32)] int32
      --Sampler (-inf where a bit is clear, after penalties, before argmax/draw)--> tokens
      --Guide.advance(token)--> the matcher moves on; `done` once the grammar can only end

Requests without a constraint pay nothing: no bitmask, no matcher, no copy. A compiled
grammar is kept per (kind, spec) in an LRU cache; a request gets a copy of the pristine
matcher (microseconds). llguidance was chosen over xgrammar (both checked here: README,
"Structured output"): it reads the plan's tokenizer.json as it is, takes Lark grammars (and
GBNF through its converter), and its masks for 32 JSON-schema rows of SmolLM2's 49,152-token
vocabulary take about a millisecond, next to a ~200 ms batch-32 step.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

KINDS = ("json", "json_object", "regex", "choice", "grammar")
_CACHE_SIZE = 256


@dataclass(frozen=True)
class GuidedDecoding:
    """One request's output constraint.

    kind: json (spec: a JSON schema, as JSON text) | json_object (any JSON object) |
    regex (spec: the pattern the whole output matches) | choice (choices: one of these
    strings exactly) | grammar (spec: a Lark grammar, or GBNF with `::=` rules).
    """
    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "choices", tuple(self.choices or ()))
        if self.kind not in KINDS:
            raise ValueError(f"guided decoding kind {self.kind!r}: one of {', '.join(KINDS)}")
        if self.kind == "choice":
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise ValueError("guided choice: give a non-empty list of non-empty strings")
        elif self.kind != "json_object" and not (isinstance(self.spec, str) and self.spec):
            raise ValueError(f"guided {self.kind}: the {self.kind} is empty")

    @classmethod
    def json_schema(cls, schema: Any) -> "GuidedDecoding":
        """From a schema given as a dict or as JSON text (ValueError when it is neither)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema is an object (got {type(schema).__name__})")
        return cls("json", json.dumps(schema))   # property order is kept: it is the output's


class Guide:
    """One request's matcher: the tokens its grammar allows next, and where it stands."""
    __slots__ = ("matcher", "done", "error")

    def __init__(self, matcher):
        self.matcher = matcher
        self.done = False          # the grammar is complete: nothing may follow
        self.error: Optional[str] = None

    def advance(self, token_id: int) -> None:
        """Feed the sampled token (not a stop token: the request ends on those)."""
        if self.done or self.error:
            return
        if not self.matcher.consume_token(token_id):
            self.error = f"the grammar refused token {token_id}: {self.matcher.get_error()}"
        elif self.matcher.is_stopped():
            self.done = True


class GrammarCache:
    """Compiles constraints for one tokenizer; pristine matchers are cached per constraint.
    Thread-safe: submissions compile on the caller's thread."""

    def __init__(self, tokenizer_json: str, eos_token_id: Optional[int], vocab_size: int):
        import llguidance
        self._llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=eos_token_id)
        self.vocab_size = vocab_size
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def guide(self, g: GuidedDecoding) -> Guide:
        """A fresh Guide for `g`; ValueError saying why when it does not compile."""
        key = (g.kind, g.spec, g.choices)
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is not None:
                self._cache.move_to_end(key)
        if pristine is None:
            pristine = self._compile(g)
            with self._lock:
                self._cache[key] = pristine
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        return Guide(pristine.deep_copy())

    def _compile(self, g: GuidedDecoding):
        M = self._llg.LLMatcher
        what = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
                "choice": "choice", "grammar": "grammar"}[g.kind]
        try:
            if g.kind in ("json", "json_object"):
                schema = g.spec if g.kind == "json" else '{"type": "object"}'
                grammar = M.grammar_from_json_schema(
                    schema, defaults={"whitespace_flexible": False})
            elif g.kind == "regex":
                grammar = M.grammar_from_regex(g.spec)
            elif g.kind == "choice":
                grammar = M.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in g.choices))
            else:
                grammar = M.grammar_from_lark(_lark(g.spec))
            matcher = M(self.tokenizer, grammar, log_level=0)
        except Exception as e:     # llguidance raises ValueError/RuntimeError with the reason
            raise ValueError(f"invalid {what}: {e}") from None
        if matcher.is_error():
            raise ValueError(f"invalid {what}: {matcher.get_error().strip()}")
        return matcher


def _lark(text: str) -> str:
    """Lark as is; GBNF (rules written `name ::= ...`) through llguidance's converter."""
    if "::=" in text:
        from llguidance.gbnf_to_lark import gbnf_to_lark
        return gbnf_to_lark(text)
    return text


class Masker:
    """Token bitmasks for the guided rows of a step, filled in parallel by llguidance."""

    def __init__(self, vocab_size: int, max_rows: int):
        import llguidance
        import llguidance.torch as lgt
        self._lgt = lgt
        self._executor = llguidance.LLExecutor()
        self.vocab_size = vocab_size
        self._bitmask = lgt.allocate_token_bitmask(max_rows, vocab_size)   # int32 [N, V/32]

    def fill(self, guides: Sequence[Guide]):
        """-> bitmask [len(guides), ceil(V/32)] int32: bit t of row i set iff token t is
        allowed next for guides[i]."""
        n = len(guides)
        if n > self._bitmask.shape[0]:
            self._bitmask = self._lgt.allocate_token_bitmask(n, self.vocab_size)
        bm = self._bitmask[:n]
        self._lgt.fill_next_token_bitmask_par(
            self._executor, [(g.matcher, i) for i, g in enumerate(guides)], bm)
        return bm


_BYTE_MASKS = None   # [256, 8] float32: 0 where bit j of the byte is set, -inf where clear


def apply_bitmask(logits, rows, bitmask) -> None:
    """logits[rows[i], t] = -inf where bit t of bitmask[i] is clear, in place; the rest is
    unchanged (x + 0.0 == x). One table lookup per mask byte and one add over the rows --
    a few times cheaper than unpacking the bits with shifts. Columns past the bitmask's
    vocabulary (a padded lm_head) are masked too."""
    import torch
    global _BYTE_MASKS
    if _BYTE_MASKS is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        _BYTE_MASKS = torch.where(bits.bool(), 0.0, float("-inf"))
    R, V = len(rows), logits.shape[1]
    add = _BYTE_MASKS[bitmask.contiguous().view(torch.uint8).long()].reshape(R, -1)  # [R, W*32]
    if add.shape[1] >= V:
        add = add[:, :V]
    else:
        add = torch.nn.functional.pad(add, (0, V - add.shape[1]), value=float("-inf"))
    if R == logits.shape[0] and list(rows) == list(range(R)):
        logits.add_(add)
    else:
        logits.index_add_(0, torch.as_tensor(rows, dtype=torch.long), add)
