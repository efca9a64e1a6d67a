"""Constrained (guided) decoding: JSON schema, regex, choice and grammar constraints.

A request's constraint (`GuidedDecoding`, in its SamplingParams) is compiled at submission
by the engine's `GrammarCache` into a `Guide`: an llguidance matcher over the plan's
tokenizer. An invalid schema, regex or grammar is refused there (ValueError naming what is
wrong), never mid-stream. Each step, for the rows that sample a token and carry a guide:

    guides --Masker.fill (llguidance, its thread pool)--> bitmask [R, ceil(V/32)] int32
      --Sampler (-inf where a bit is clear, after penalties, before argmax/draw)--> tokens
      --Guide.advance(token)--> the matcher moves on; `done` once the grammar can only end

Requests without a constraint pay nothing: no bitmask, no matcher, no copy. A compiled
grammar is kept per (kind, spec) in an LRU cache bounded in (estimated) bytes; a request gets
a copy of the pristine matcher (microseconds). What constraints may cost is bounded
(`GuidedLimits`, the `kiln serve --guided-*` flags): compiles run on the cache's own small
pool with a deadline (a caller that leaves withdraws its compile), llguidance's parser limits
are passed explicitly, and the masks of one step share a time budget -- rows past it wait a
step (the scheduler computes their last token again). A matcher that hits a limit, or a mask
that allows no token, ends its request with an error, never as a normal stop.

llguidance was chosen over xgrammar (both checked here: README,
"Structured output"): it reads the plan's tokenizer.json as it is, takes Lark grammars (and
GBNF through its converter), and its masks for 32 JSON-schema rows of SmolLM2's 49,152-token
vocabulary take about a millisecond, next to a ~200 ms batch-32 step.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, fields
from typing import Any, Optional, Sequence

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MiB = 2**20


@dataclass(frozen=True)
class GuidedLimits:
    """What constrained decoding may cost the engine (`kiln serve --guided-*`; the caps on
    one request's constraint text are RequestLimits', at the API boundary)."""
    compile_threads: int = 2            # the compile pool (its own: nothing else waits on it)
    max_compiles_waiting: int = 64      # queued compiles; more: refused, retry later
    compile_timeout_s: float = 10.0     # a request waits this long for its compile
    cache_bytes: int = 512 * MiB        # compiled grammars kept, by estimated memory
    step_budget_ms: float = 50.0        # mask time per step; rows past it wait one step
    mask_threads: int = 0               # llguidance's mask threads; 0: 80% of the cores (<= 32)
    # llguidance's LLParserLimits, passed explicitly (its own defaults, but for the lexer's
    # states: each takes 1-2 kB, and 250,000 of them per matcher is too much to allow)
    max_items_in_row: int = 2000        # branching of one grammar row
    initial_lexer_fuel: int = 1_000_000  # building the lexer (~50k a ms)
    step_lexer_fuel: int = 200_000      # one mask's lexer work (~14k a ms)
    step_max_items: int = 50_000        # one mask's Earley items (~20k a ms)
    max_lexer_states: int = 50_000
    max_grammar_size: int = 500_000     # symbols in the grammar's productions

    def __post_init__(self):
        from kiln.contracts import FieldError
        zero_ok = ("step_budget_ms", "mask_threads")
        for f in fields(self):
            v, least = getattr(self, f.name), ">= 0" if f.name in zero_ok else "> 0"
            if v < 0 or (v == 0 and f.name not in zero_ok):
                raise FieldError(f.name, f"must be {least} (got {v})")

    def parser_limits(self):
        import llguidance
        return llguidance.LLParserLimits(
            max_items_in_row=self.max_items_in_row, initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel, step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states, max_grammar_size=self.max_grammar_size,
            verbose_errors=False)     # errors go to clients: no parser state or grammar dump

    def threads_for_masks(self) -> int:
        if self.mask_threads:
            return self.mask_threads
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        return max(1, min(32, int(0.8 * cores)))


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
        try:
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema is an object (got {type(schema).__name__})")
            return cls("json", json.dumps(schema))  # property order is kept: the output's
        except RecursionError:     # json nests one Python frame per level
            raise ValueError("the JSON schema is nested too deeply") from None


class Guide:
    """One request's matcher: the tokens its grammar allows next, and where it stands."""
    __slots__ = ("matcher", "done", "error", "waited")

    def __init__(self, matcher):
        self.matcher = matcher
        self.done = False          # the grammar is complete: nothing may follow
        self.error: Optional[str] = None
        self.waited = 0            # steps in a row its mask was left out by the step budget

    def advance(self, token_id: int) -> None:
        """Feed the sampled token (not a stop token: the request ends on those)."""
        if self.done or self.error:
            return
        if not self.matcher.consume_token(token_id) or self.matcher.is_error():
            self.error = f"the grammar refused token {token_id}: {_error(self.matcher)}"
        elif self.matcher.is_stopped():
            self.done = True

    def check_mask(self, allows_any: bool) -> None:
        """After its mask is computed: a matcher in its error state (a limit hit mid-way; its
        mask then allows only EOS) or a mask that allows no token ends the request."""
        if self.error is None and self.matcher.is_error():
            self.error = f"the constraint hit a limit: {_error(self.matcher)}"
        elif self.error is None and not allows_any:
            self.error = "the constraint allows no token of the model's vocabulary here"


def _error(matcher, cap: int = 500) -> str:
    """llguidance's error text, at most `cap` characters (it may quote the whole spec)."""
    text = matcher.get_error().strip() or "unknown error"
    return text if len(text) <= cap else text[:cap] + "..."


class CompileBusy(RuntimeError):
    """The compile pool's queue is full (GuidedLimits.max_compiles_waiting): retry later."""


class CompileTimeout(ValueError):
    """A constraint did not compile within GuidedLimits.compile_timeout_s."""


class _Job:
    """One compile on the pool, shared by every caller waiting for the same constraint."""
    __slots__ = ("key", "g", "waiters", "started", "future")

    def __init__(self, key: bytes, g: GuidedDecoding):
        self.key, self.g = key, g
        self.waiters: list[Future] = []    # one per caller; a cancelled one withdraws
        self.started = False
        self.future: Optional[Future] = None


class GrammarCache:
    """Compiles constraints for one tokenizer on its own pool of `compile_threads`; pristine
    matchers are cached per constraint (keyed by a digest, bounded by estimated bytes).
    Thread-safe."""

    def __init__(self, tokenizer_json: str, eos_token_id: Optional[int], vocab_size: int,
                 limits: Optional[GuidedLimits] = None):
        import llguidance
        self._llg = llguidance
        self.limits = limits or GuidedLimits()
        self._parser_limits = self.limits.parser_limits()
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=eos_token_id)
        self.vocab_size = vocab_size
        self._cache: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()  # -> (matcher, bytes)
        self.cached_bytes = 0
        self._jobs: dict[bytes, _Job] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.limits.compile_threads,
                                        thread_name_prefix="kiln-grammar")

    def submit(self, g: GuidedDecoding) -> "Future[Guide]":
        """A future fresh Guide for `g`: done at once from the cache, else when the pool has
        compiled it (ValueError saying why when it does not compile). Cancelling the future
        withdraws this caller: a compile nobody waits for is dropped before it starts.
        Raises CompileBusy when max_compiles_waiting compiles are queued already."""
        key = hashlib.sha256(json.dumps([g.kind, g.spec, g.choices]).encode()).digest()
        waiter: Future = Future()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            else:
                job = self._jobs.get(key)
                if job is None:
                    queued = sum(not j.started for j in self._jobs.values())
                    if queued >= self.limits.max_compiles_waiting:
                        raise CompileBusy(f"{queued} constraints are waiting to compile; "
                                          "retry later")
                    job = self._jobs[key] = _Job(key, g)
                    job.future = self._pool.submit(self._run, job)
                job.waiters.append(waiter)
        if hit is not None:
            waiter.set_result(Guide(hit[0].deep_copy()))
        else:
            waiter.add_done_callback(lambda f: f.cancelled() and self._withdraw(job, f))
        return waiter

    def guide(self, g: GuidedDecoding) -> Guide:
        """A fresh Guide for `g`, waiting at most compile_timeout_s (CompileTimeout); ValueError
        saying why when it does not compile."""
        fut = self.submit(g)
        try:
            return fut.result(self.limits.compile_timeout_s)
        except FutureTimeout:
            if fut.cancel():
                raise self.timeout(g) from None
            return fut.result()        # it was being delivered as the time ran out

    def timeout(self, g: GuidedDecoding) -> CompileTimeout:
        return CompileTimeout(
            f"the {_WHAT[g.kind]} did not compile within {self.limits.compile_timeout_s:g} s "
            "(kiln serve --guided-compile-timeout): simplify it, or retry if the server is busy")

    def close(self) -> None:
        """Stop the pool: queued compiles fail their callers, running ones finish on their
        own."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            queued = [j for j in self._jobs.values() if not j.started]
            for job in queued:
                del self._jobs[job.key]
        for job in queued:
            for w in job.waiters:
                if w.set_running_or_notify_cancel():
                    w.set_exception(RuntimeError("the engine is shut down"))

    def _withdraw(self, job: _Job, waiter: Future) -> None:
        with self._lock:
            if waiter in job.waiters:
                job.waiters.remove(waiter)
            if not job.waiters and not job.started:
                job.future.cancel()
                if self._jobs.get(job.key) is job:
                    del self._jobs[job.key]

    def _run(self, job: _Job) -> None:
        """On the pool: compile, cache, hand each waiting caller its own copy."""
        with self._lock:
            if not job.waiters:        # every caller left before it started
                if self._jobs.get(job.key) is job:
                    del self._jobs[job.key]
                return
            job.started = True
        try:
            pristine, size = self._compile(job.g)
            error = None
        except Exception as e:         # ValueError with the reason; anything else as is
            pristine, error = None, e
        with self._lock:
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            waiters, job.waiters = job.waiters, []
            if pristine is not None:
                self._put(job.key, pristine, size)
        for w in waiters:
            if w.set_running_or_notify_cancel():
                if error is not None:
                    w.set_exception(error)
                else:
                    w.set_result(Guide(pristine.deep_copy()))

    def _put(self, key: bytes, matcher, size: int) -> None:
        """Cache under the byte bound, least recently used out first (lock held). A grammar
        larger than the whole bound is not kept."""
        if size > self.limits.cache_bytes or key in self._cache:
            return
        self._cache[key] = (matcher, size)
        self.cached_bytes += size
        while self.cached_bytes > self.limits.cache_bytes:
            _, (_, dropped) = self._cache.popitem(last=False)
            self.cached_bytes -= dropped

    def _compile(self, g: GuidedDecoding) -> tuple[Any, int]:
        """-> (a pristine matcher, its estimated bytes); ValueError saying why it is bad."""
        M = self._llg.LLMatcher
        what = _WHAT[g.kind]
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
            matcher = M(self.tokenizer, grammar, log_level=0, limits=self._parser_limits)
        except RecursionError:
            raise ValueError(f"invalid {what}: nested too deeply") from None
        except Exception as e:     # llguidance raises ValueError/RuntimeError with the reason
            raise ValueError(f"invalid {what}: {str(e)[:500]}") from None
        if matcher.is_error():
            raise ValueError(f"invalid {what}: {_error(matcher)}")
        return matcher, _MATCHER_BYTES + _BYTES_PER_GRAMMAR_BYTE * len(grammar)


# A compiled matcher's memory, estimated from the size of llguidance's grammar text. Measured
# (RSS per matcher, 20 JSON schemas of 10 to 1,000 properties, on a byte-level tokenizer and on
# SmolLM2's 49k one): about 0.2-0.3 MiB each plus 90-110 bytes per byte of grammar text.
_MATCHER_BYTES = 256 * 2**10
_BYTES_PER_GRAMMAR_BYTE = 128
_WHAT = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
         "choice": "choice", "grammar": "grammar"}


def _lark(text: str) -> str:
    """Lark as is; GBNF (rules written `name ::= ...`) through llguidance's converter."""
    if "::=" in text:
        from llguidance.gbnf_to_lark import gbnf_to_lark
        return gbnf_to_lark(text)
    return text


class Masker:
    """Token bitmasks for the guided rows of a step, filled in parallel by llguidance within
    the step's mask budget."""

    def __init__(self, vocab_size: int, max_rows: int, limits: Optional[GuidedLimits] = None):
        import llguidance
        import llguidance.torch as lgt
        limits = limits or GuidedLimits()
        self._lgt = lgt
        self.chunk = limits.threads_for_masks()     # rows filled at once
        self._executor = llguidance.LLExecutor(self.chunk)
        self.budget_s = limits.step_budget_ms / 1e3
        self.vocab_size = vocab_size
        self.num_deferred = 0      # rows the budget left for a later step, ever
        self._bitmask = lgt.allocate_token_bitmask(max_rows, vocab_size)   # int32 [N, V/32]

    def fill(self, guides: Sequence[Guide]):
        """-> bitmask [len(guides), ceil(V/32)] int32: bit t of row i set iff token t is
        allowed next for guides[i] (every row; no budget, no checks)."""
        bm = self._rows(len(guides))
        self._fill(guides, range(len(guides)), bm)
        return bm

    def fill_step(self, guides: Sequence[Guide], vocab: int):
        """One engine step's masks -> (bitmask as fill's, the indices of the guides whose row
        was filled). Rows are filled the longest-waiting first, `chunk` at a time, until the
        step's budget is spent (the first chunk always); the rest wait for the next step.
        Each filled guide is checked (Guide.check_mask) against the first `vocab` token ids,
        the logits' width."""
        n = len(guides)
        bm = self._rows(n)
        order = sorted(range(n), key=lambda i: -guides[i].waited)
        filled: list[int] = []
        t0 = time.perf_counter()
        for k in range(0, n, self.chunk):
            if filled and time.perf_counter() - t0 >= self.budget_s:
                break
            self._fill(guides, order[k:k + self.chunk], bm)
            filled.extend(order[k:k + self.chunk])
        filled.sort()
        for i, ok in zip(filled, _allows_any(bm[filled], vocab)):
            guides[i].waited = 0
            guides[i].check_mask(ok)
        for i in set(range(n)).difference(filled):
            guides[i].waited += 1
        self.num_deferred += n - len(filled)
        return bm, filled

    def _rows(self, n: int):
        if n > self._bitmask.shape[0]:
            self._bitmask = self._lgt.allocate_token_bitmask(n, self.vocab_size)
        return self._bitmask[:n]

    def _fill(self, guides: Sequence[Guide], rows, bm) -> None:
        self._lgt.fill_next_token_bitmask_par(
            self._executor, [(guides[i].matcher, i) for i in rows], bm)


def _allows_any(bitmask, vocab: int) -> list[bool]:
    """Per row of bitmask [R, W] int32: does it allow any token id below `vocab`?"""
    words, rem = divmod(min(vocab, 32 * bitmask.shape[1]), 32)
    any_ = (bitmask[:, :words] != 0).any(dim=1)
    if rem:
        any_ |= (bitmask[:, words] & ((1 << rem) - 1)) != 0
    return any_.tolist()


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
