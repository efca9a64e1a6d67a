"""The engine: requests in, streamed tokens out.

    submit() --inbox--> [engine thread: step() = schedule -> execute -> update] --> streams

`Engine.step()` is the whole serving loop: the scheduler (plugins.inflight_batching) picks
sequences and token counts, the model runner packs them into one ModelInput, runs the
compiled step and samples, and the update appends tokens, detokenizes, applies stop rules
and delivers a RequestOutput to each request's stream. Callers on any thread (or an asyncio
loop) submit requests and read their RequestStream; only the engine thread touches the
scheduler, the block pool and the KV pools.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence as Seq, Union

import numpy as np
import torch

from plugins.inflight_batching import (RequestRefused, Scheduler, SchedulerConfig,
                                       SchedulerOutput, Sequence, SequenceStatus, StepOutput)
from runtime.compute import enter_engine_thread
from runtime.executor import Executor, ModelInput
from runtime.guided import GrammarCache, Masker
from runtime.plan import Plan, load_plan
from runtime.sampling import Sampler, SamplingParams, SamplingState, TokenLogprobs
from runtime.tokenizer import Tokenizer

log = logging.getLogger("kiln.runtime")

Prompt = Union[str, Seq[int], Seq[dict]]   # text, token ids, or chat messages
LIMITS = ("max_batch_size", "max_num_tokens", "max_seq_len", "max_input_len")


class QueueFullError(RuntimeError):
    """The waiting queue is at max_queue; retry later (gRPC: RESOURCE_EXHAUSTED)."""


class EngineError(RuntimeError):
    """The engine is shut down or failed."""


@dataclass(frozen=True)
class EngineConfig(SchedulerConfig):
    """The engine's limits and scheduler settings (fields: see SchedulerConfig)."""

    @classmethod
    def from_plan(cls, plan: Plan, **overrides) -> "EngineConfig":
        """The plan's limits and scheduler section; limits may be lowered, never raised."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown engine setting {unknown[0]!r}; settings: "
                             f"{', '.join(sorted(names))}")
        lim = plan.limits
        planned = {k: lim[k] for k in ("max_batch_size", "max_num_tokens", "max_seq_len")}
        planned["max_input_len"] = lim.get("max_input_len") or lim["max_seq_len"] - 1
        values = dict(planned)
        values["tokens_per_block"] = plan.manifest["kv_cache"]["tokens_per_block"]
        for k, v in (plan.manifest.get("scheduler") or {}).items():
            if k in names:
                values[k] = v
        for k, v in overrides.items():
            if v is None:
                continue
            if k in planned and v > planned[k]:
                raise ValueError(f"{k}={v} exceeds the plan's {k} ({planned[k]}): limits may "
                                 f"be lowered at load, never raised. Rebuild the plan with a "
                                 f"higher limits.{k}")
            if k == "tokens_per_block" and v != values[k]:
                raise ValueError(f"tokens_per_block={v}: the plan's KV layout has "
                                 f"{values[k]}; it is fixed at build time")
            values[k] = v
        if "max_input_len" not in overrides:   # follows a lowered max_seq_len
            values["max_input_len"] = min(values["max_input_len"], values["max_seq_len"] - 1)
        return cls(**values)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int       # prompt tokens served from the prefix cache
    completion_tokens: int


@dataclass(frozen=True)
class Timings:
    """Seconds; None until known."""
    queue_time: Optional[float] = None   # submit -> first scheduled
    ttft: Optional[float] = None         # submit -> first output token
    tpot: Optional[float] = None         # mean time per output token after the first
    e2e: Optional[float] = None          # submit -> finished


@dataclass(frozen=True)
class RequestOutput:
    """One delivery on a RequestStream: the tokens and text new since the previous one."""
    request_id: str
    token_ids: list[int]                 # new token ids
    text: str                            # new text (never splits a UTF-8 character)
    finished: bool
    finish_reason: Optional[str]         # stop | length | cancelled | error (when finished)
    usage: Usage
    timings: Timings
    stop_reason: Any = None              # the stop token id or stop string, if any
    error: Optional[str] = None          # what went wrong (finish_reason == "error")
    logprobs: Optional[list[TokenLogprobs]] = None  # one per token_ids entry, when asked for


@dataclass
class RequestResult:
    """A whole request, gathered from its stream."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: Optional[str]
    usage: Usage
    timings: Timings
    stop_reason: Any = None
    error: Optional[str] = None
    logprobs: Optional[list[TokenLogprobs]] = None


class RequestStream:
    """The outputs of one request, iterable with `for` or `async for`; `cancel()` ends it."""

    def __init__(self, engine: "Engine", request_id: str, prompt_token_ids: list[int]):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._engine = engine
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._aq: Optional[asyncio.Queue] = None
        self._done = False
        try:   # submitted from a coroutine: deliver straight to its loop
            self._bind(asyncio.get_running_loop())
        except RuntimeError:
            pass

    def cancel(self) -> None:
        """Stop the request; its blocks are free before the next step. Idempotent."""
        self._engine._abort(self.request_id)

    @property
    def finished(self) -> bool:
        return self._done

    def __iter__(self):
        return self

    def __next__(self) -> RequestOutput:
        if self._done:
            raise StopIteration
        if self._aq is not None:
            raise RuntimeError("this stream is bound to an asyncio loop; use `async for`")
        out = self._q.get()
        self._done = out.finished
        return out

    def __aiter__(self):
        self._bind(asyncio.get_running_loop())
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        out = await self._aq.get()
        self._done = out.finished
        return out

    def result(self) -> RequestResult:
        """Block until the request ends; everything it produced."""
        return _gather(self, list(self))

    async def aresult(self) -> RequestResult:
        return _gather(self, [o async for o in self])

    # engine side ---------------------------------------------------------------------------
    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            if self._loop is loop:
                return
            if self._loop is not None:
                raise RuntimeError("a stream can be read from one asyncio loop only")
            self._loop, self._aq = loop, asyncio.Queue()
            while True:     # move what arrived before binding
                try:
                    self._aq.put_nowait(self._q.get_nowait())
                except queue.Empty:
                    break

    def _put(self, out: RequestOutput) -> None:
        with self._lock:
            if self._loop is None:
                self._q.put(out)
                return
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, out)
            except RuntimeError:   # the loop is closed: nobody is listening any more
                pass


def _gather(stream: RequestStream, outs: list[RequestOutput]) -> RequestResult:
    last = outs[-1]
    return RequestResult(stream.request_id, stream.prompt_token_ids,
                         [t for o in outs for t in o.token_ids], "".join(o.text for o in outs),
                         last.finish_reason, last.usage, last.timings, last.stop_reason,
                         last.error, [lp for o in outs for lp in o.logprobs or ()]
                         if any(o.logprobs for o in outs) else None)


class _Request:
    """Engine-thread bookkeeping of one request."""
    __slots__ = ("seq", "stream", "detok", "arrival", "first_token", "last_token")

    def __init__(self, seq: Sequence, stream: RequestStream, detok):
        self.seq, self.stream, self.detok = seq, stream, detok
        self.arrival = seq.arrival_time
        self.first_token: Optional[float] = None
        self.last_token: Optional[float] = None


@dataclass
class SampledOutput(StepOutput):
    """StepOutput plus the logprobs of the sampled tokens of requests that asked for them, and
    the requests whose sampling failed (their token is None; the engine fails them alone)."""
    logprobs: dict[str, TokenLogprobs] = dataclasses.field(default_factory=dict)  # request_id ->
    errors: dict[str, str] = dataclasses.field(default_factory=dict)  # request_id -> what failed


class ModelRunner:
    """SchedulerOutput -> ModelInput -> executor -> sampler -> StepOutput."""

    def __init__(self, executor: Executor, sampler: Sampler):
        self.executor = executor
        self.sampler = sampler
        self.masker: Optional[Masker] = None     # made by the first constrained request
        self.tokens_per_block = executor.layout.tokens_per_block

    def prepare(self, out: SchedulerOutput) -> ModelInput:
        """Pack the scheduled tokens (numpy; Python work is per sequence, not per token)."""
        seqs, n = out.seqs, out.num_scheduled_tokens
        B, bs = len(seqs), self.tokens_per_block
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, B)
        counts = np.asarray(n, dtype=np.int64)
        ids: list[int] = []
        for s, st, k in zip(seqs, starts.tolist(), n):
            ids.extend(s.token_ids[st:st + k])
        qsl = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        seq_idx = np.repeat(np.arange(B), counts)
        positions = np.arange(qsl[-1], dtype=np.int64) - qsl[seq_idx] + starts[seq_idx]
        width = max(1, max(len(s.block_table) for s in seqs))
        bt = np.zeros((B, width), dtype=np.int32)
        for i, s in enumerate(seqs):
            bt[i, :len(s.block_table)] = s.block_table
        slots = bt[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs
        return ModelInput(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.from_numpy(positions),
            slot_mapping=torch.from_numpy(slots),
            block_tables=torch.from_numpy(bt),
            context_lens=torch.from_numpy((starts + counts).astype(np.int32)),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
            logits_indices=torch.from_numpy(qsl[1:] - 1),
        )

    def execute(self, out: SchedulerOutput) -> StepOutput:
        if out.is_empty:
            return SampledOutput([])
        logits = self.executor.execute(self.prepare(out))            # [B, vocab]
        rows = [i for i, s in enumerate(out.sample) if s]
        sampled: list[Optional[int]] = [None] * len(out.seqs)
        if rows:
            seqs = [out.seqs[i] for i in rows]
            rl = logits[rows] if len(rows) < len(out.seqs) else logits
            errors: dict[str, str] = {}
            guided = self._masks(seqs, rl.shape[1])
            try:
                toks = self.sampler(rl, [s.params for s in seqs], [s.token_ids for s in seqs],
                                    [s.num_prompt_tokens for s in seqs], guided)
            except Exception:   # pin it on its request(s): sample row by row
                toks = self._sample_rows(rl, seqs, errors, guided)
            if guided is not None:
                self._advance(seqs, guided[0], toks, errors)
            for i, t in zip(rows, toks):
                sampled[i] = t
            asked = [j for j, s in enumerate(seqs)
                     if s.params.params.logprobs is not None and toks[j] is not None]
            if asked:   # only requests that ask pay for a log_softmax
                lps = self.sampler.logprobs(rl[asked], [toks[j] for j in asked],
                                            [seqs[j].params.params.logprobs for j in asked])
                return SampledOutput(sampled, {seqs[j].request_id: lp
                                               for j, lp in zip(asked, lps)}, errors)
            return SampledOutput(sampled, {}, errors)
        return SampledOutput(sampled)

    def _masks(self, seqs: list[Sequence], vocab: int
               ) -> Optional[tuple[list[int], torch.Tensor]]:
        """(rows, bitmask) of the constrained requests among seqs; None when there are none
        (unconstrained requests pay nothing)."""
        rows = [j for j, s in enumerate(seqs) if s.params.guide is not None]
        if not rows:
            return None
        if self.masker is None or self.masker.vocab_size != vocab:
            self.masker = Masker(vocab, len(seqs))
        return rows, self.masker.fill([seqs[j].params.guide for j in rows])

    @staticmethod
    def _advance(seqs: list[Sequence], rows: list[int], toks: list[Optional[int]],
                 errors: dict[str, str]) -> None:
        """Feed each constrained request its sampled token (a stop token ends it instead)."""
        for j in rows:
            s, t = seqs[j], toks[j]
            if t is None or t in s.stop_token_ids:
                continue
            guide = s.params.guide
            guide.advance(t)
            if guide.error is not None:
                errors[s.request_id] = guide.error

    def _sample_rows(self, logits: torch.Tensor, seqs: list[Sequence],
                     errors: dict[str, str],
                     guided: Optional[tuple[list[int], torch.Tensor]] = None
                     ) -> list[Optional[int]]:
        """The batch sampler raised: sample each row alone (the same tokens: rows never
        interact, a seeded row draws from its own generator) -> tokens, None where a row
        raises; errors[request_id] says why."""
        toks: list[Optional[int]] = []
        for j, s in enumerate(seqs):
            try:
                g = None
                if guided is not None and j in guided[0]:
                    g = ([0], guided[1][guided[0].index(j)][None])
                toks.append(self.sampler(logits[j:j + 1], [s.params], [s.token_ids],
                                         [s.num_prompt_tokens], g)[0])
            except Exception as e:
                log.exception("sampling failed for request %s", s.request_id)
                errors[s.request_id] = f"sampling failed: {type(e).__name__}: {e}"
                toks.append(None)
        return toks


class Engine:
    """Serves one model: submit() from any thread, a background thread runs steps."""

    def __init__(self, executor: Executor, tokenizer: Tokenizer, config: EngineConfig,
                 start: bool = True, vocab_size: Optional[int] = None,
                 num_threads: Optional[int] = None):
        """vocab_size: the model's (the logits' width; default the tokenizer's). num_threads:
        the engine thread's compute threads (runtime/compute.py; default: torch's)."""
        self.num_threads = num_threads
        if config.tokens_per_block != executor.layout.tokens_per_block:
            raise ValueError(f"tokens_per_block={config.tokens_per_block} but the KV pools have "
                             f"{executor.layout.tokens_per_block}")
        self.config = config
        self.tokenizer = tokenizer
        self.executor = executor
        self.scheduler = Scheduler(config, executor.layout.num_blocks)
        self.model_runner = ModelRunner(executor, Sampler())
        self._requests: dict[str, _Request] = {}
        self._inbox: list[tuple[str, Any]] = []   # ("add", _Request) | ("abort", request_id)
        self._pending_adds = 0
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._closed = False
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self._grammar_cache: Optional[GrammarCache] = None
        self._grammar_lock = threading.Lock()
        self.failure: Optional[str] = None      # why the engine loop died (None: it did not)
        self._failure_callbacks: list[Callable[[str], None]] = []
        self.peak_blocks_used = 0
        self.num_finished = 0
        layout = executor.layout
        per_seq = self.scheduler.pool.blocks_for(config.max_seq_len)
        self.kv_report = {"blocks": layout.num_blocks, "tokens_per_block": layout.tokens_per_block,
                          "bytes": layout.total_bytes,
                          "max_concurrent_full_length_seqs": layout.num_blocks // per_seq}
        log.info("KV cache: %d blocks of %d tokens, %.1f MiB; %d sequences of max_seq_len %d "
                 "fit at once", layout.num_blocks, layout.tokens_per_block,
                 layout.total_bytes / 2**20, layout.num_blocks // per_seq, config.max_seq_len)
        self._thread: Optional[threading.Thread] = None
        if start:
            self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
            self._thread.start()

    @classmethod
    def from_plan(cls, plan: Union[str, Path, Plan], kv_budget_bytes: Optional[int] = None,
                  start: bool = True, num_threads: Optional[int] = None,
                  **overrides) -> "Engine":
        """Load a built plan. `overrides`: EngineConfig fields; limits only lowered."""
        plan = plan if isinstance(plan, Plan) else load_plan(plan)
        config = EngineConfig.from_plan(plan, **overrides)
        return cls(Executor.from_plan(plan, kv_budget_bytes), Tokenizer.from_plan(plan),
                   config, start=start, vocab_size=plan.model_config.get("vocab_size"),
                   num_threads=num_threads)

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, execute, update."""
        scheduler_output = self.scheduler.schedule()
        step_output = self.model_runner.execute(scheduler_output)
        return self.update(scheduler_output, step_output)

    def update(self, sched: SchedulerOutput, step: StepOutput) -> list[RequestOutput]:
        """Apply a step's tokens; deliver one output per request that advanced."""
        self.peak_blocks_used = max(self.peak_blocks_used, self.scheduler.pool.num_blocks
                                    - self.scheduler.pool.num_free_blocks)
        now = time.monotonic()
        lps = getattr(step, "logprobs", None) or {}
        for rid, error in (getattr(step, "errors", None) or {}).items():
            self._fail(self._requests[rid], error)    # before update: it skips finished seqs
        outs = []
        for seq in self.scheduler.update(sched, step):
            req = self._requests[seq.request_id]
            try:
                outs.append(self._emit(req, now, lps.get(seq.request_id)))
            except Exception as e:     # detokenizer, stop strings: this request's alone
                log.exception("request %s failed", seq.request_id)
                self._fail(req, f"{type(e).__name__}: {e}")
        return outs

    def _fail(self, req: _Request, error: str) -> None:
        """End one request with finish_reason 'error'; its blocks are freed at once."""
        self.scheduler.finish(req.seq, SequenceStatus.FINISHED_ERROR)
        self._finish(req, "error", error)

    def run_pending(self) -> None:
        """Apply submissions and cancellations (engine thread, between steps)."""
        with self._cv:
            events, self._inbox, self._pending_adds = self._inbox, [], 0
        for kind, x in events:
            if kind == "add":
                self._requests[x.seq.request_id] = x
                try:
                    self.scheduler.add(x.seq)
                except Exception as e:    # refused late (e.g. a duplicate id): this one fails
                    self._finish(x, "error", f"{type(e).__name__}: {e}")
            else:
                req = self._requests.get(x)
                if req is not None:
                    self.scheduler.abort(x)
                    self._finish(req, "cancelled")

    def _loop(self) -> None:
        """The engine thread, supervised. A step that raises fails the requests it can be
        pinned on -- a request whose sampling or detokenizing raised (see update), otherwise
        the running batch -- and the loop goes on. Anything that escapes that (a fault in
        the bookkeeping itself) ends the engine: every request fails, submit() refuses and
        the failure callbacks run (the server reports NOT_SERVING)."""
        try:
            enter_engine_thread(self.num_threads)
            while self._run_once():
                pass
        except BaseException as e:
            self._die(e)

    def _run_once(self) -> bool:
        with self._cv:
            while not self._inbox and not self.scheduler.has_work() and not self._closed:
                self._cv.wait()
            if self._closed:
                return False
        self.run_pending()
        if self.scheduler.has_work():
            try:
                self.step()
            except Exception as e:  # a failed step fails its batch, not the engine
                log.exception("engine step failed")
                for seq in list(self.scheduler.running):
                    self._fail(self._requests[seq.request_id], f"{type(e).__name__}: {e}")
        return True

    def _die(self, exc: BaseException) -> None:
        log.critical("the engine loop died; failing every request", exc_info=exc)
        with self._cv:
            self.failure = f"{type(exc).__name__}: {exc}"
            self._closed = True
            events, self._inbox, self._pending_adds = self._inbox, [], 0
        # the scheduler may be inconsistent: end the streams without touching it
        for req in list(self._requests.values()) + [x for k, x in events if k == "add"]:
            self._finish(req, "error", f"the engine failed: {self.failure}")
        for fn in list(self._failure_callbacks):
            try:
                fn(self.failure)
            except Exception:
                log.exception("an engine failure callback raised")

    def on_failure(self, fn: Callable[[str], None]) -> None:
        """Call fn(reason) (on the engine thread) if the engine loop dies; at once if it has."""
        with self._cv:
            self._failure_callbacks.append(fn)
            failure = self.failure
        if failure is not None:
            fn(failure)

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: Optional[SamplingParams] = None,
               request_id: Optional[str] = None) -> RequestStream:
        """Queue a request -> its stream. Raises RequestRefused (a ValueError) for a request
        that can never fit, QueueFullError when the waiting queue is full."""
        params = params or SamplingParams()
        for name in ("stop_token_ids", "bad_token_ids"):
            bad = [t for t in getattr(params, name) if t >= self.vocab_size]
            if bad:
                raise RequestRefused(f"{name}: token id {bad[0]} is outside the model's "
                                     f"vocabulary [0, {self.vocab_size})")
        ids = self._prompt_ids(prompt)
        self.scheduler.check(len(ids), params.max_tokens)
        tok = self.tokenizer
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(tok.eos_token_ids)
        bad = []
        for w in params.bad_words:
            for variant in (w, " " + w):
                enc = tok.encode(variant, add_special_tokens=False)
                if enc and enc not in bad:
                    bad.append(enc)
        state = SamplingState.create(params, sorted(stop_ids), bad)
        if params.guided is not None:   # compiled here: a bad schema is refused, not streamed
            if params.min_tokens:
                raise RequestRefused("min_tokens cannot be combined with an output constraint: "
                                     "the constraint decides where the output ends")
            try:
                state.guide = self._grammars().guide(params.guided)
            except ValueError as e:
                raise RequestRefused(str(e)) from None
        with self._cv:
            if self._closed:
                raise EngineError(f"the engine failed ({self.failure})" if self.failure
                                  else "the engine is shut down")
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if len(self.scheduler.waiting) + self._pending_adds >= self.config.max_queue:
                raise QueueFullError(f"the waiting queue is full ({self.config.max_queue} "
                                     "requests); retry later")
            if rid in self._requests or any(k == "add" and r.seq.request_id == rid
                                              for k, r in self._inbox):
                raise ValueError(f"request id {rid!r} is already in flight")
            seq = Sequence(rid, ids, params.max_tokens, params.min_tokens, stop_ids, state)
            stream = RequestStream(self, rid, ids)
            detok = tok.detokenizer(ids, params.stop, params.include_stop_str_in_output,
                                    params.skip_special_tokens)
            self._inbox.append(("add", _Request(seq, stream, detok)))
            self._pending_adds += 1
            self._cv.notify()
        return stream

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif len(prompt) and isinstance(prompt[0], dict):
            ids = self.tokenizer.apply_chat_template(list(prompt), tokenize=True)
        else:
            ids = [int(t) for t in prompt]
            vocab = min(self.vocab_size, self.tokenizer.vocab_size)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestRefused(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return ids

    def _grammars(self) -> GrammarCache:
        """The compiler of constraints over this tokenizer, made by the first that needs it."""
        with self._grammar_lock:
            if self._grammar_cache is None:
                tok = self.tokenizer
                self._grammar_cache = GrammarCache(
                    tok.to_json(), tok.eos_token_ids[0] if tok.eos_token_ids else None,
                    max(self.vocab_size, tok.vocab_size))
            return self._grammar_cache

    def _abort(self, request_id: str) -> None:
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify()

    def generate(self, prompts: Seq[Prompt], params: Union[SamplingParams, Seq[SamplingParams],
                                                          None] = None) -> list[RequestResult]:
        """Run prompts to completion (waits for room when the queue is full)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        streams: list[RequestStream] = []
        results: dict[int, RequestResult] = {}
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            while True:
                try:
                    streams.append(self.submit(p, sp))
                    break
                except QueueFullError:
                    j = min(set(range(len(streams))) - set(results))
                    results[j] = streams[j].result()
        return [results[i] if i in results else s.result() for i, s in enumerate(streams)]

    # ---- outputs ------------------------------------------------------------------------------
    def _emit(self, req: _Request, now: float,
              logprobs: Optional[TokenLogprobs] = None) -> RequestOutput:
        seq = req.seq
        if req.first_token is None:
            req.first_token = now
        req.last_token = now
        tok = seq.token_ids[-1]
        text, stop = req.detok.step([tok])
        if stop is not None and not seq.is_finished:
            seq.stop_reason = stop
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        guide = seq.params.guide
        if guide is not None and guide.done and not seq.is_finished:   # the grammar is complete
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        if not seq.is_finished:
            out = self._output(req, [tok], text, None)
        else:
            out = self._output(req, [tok], text + req.detok.flush(), seq.status.value)
            self._retire(req)
        if logprobs is not None:
            out = dataclasses.replace(out, logprobs=[logprobs])
        req.stream._put(out)
        return out

    def _finish(self, req: _Request, reason: str, error: Optional[str] = None) -> None:
        """End a request outside the token path (cancelled, error, shutdown)."""
        out = self._output(req, [], "", reason, error)
        self._retire(req)
        req.stream._put(out)

    def _retire(self, req: _Request) -> None:
        if self._requests.pop(req.seq.request_id, None) is not None:
            self.num_finished += 1

    def _output(self, req: _Request, toks: list[int], text: str, reason: Optional[str],
                error: Optional[str] = None) -> RequestOutput:
        seq = req.seq
        n = seq.num_output_tokens
        fst = seq.first_scheduled_time
        timings = Timings(
            queue_time=None if fst is None else fst - req.arrival,
            ttft=None if req.first_token is None else req.first_token - req.arrival,
            tpot=(req.last_token - req.first_token) / (n - 1) if n > 1 else None,
            e2e=time.monotonic() - req.arrival if reason else None)
        return RequestOutput(seq.request_id, toks, text, reason is not None, reason,
                             Usage(seq.num_prompt_tokens, seq.num_cached_tokens, n), timings,
                             seq.stop_reason, error)

    # ---- lifecycle -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """A snapshot of the KV pool and the queues."""
        s = self.scheduler.pool.stats()
        return {"kv_blocks_total": s.num_blocks, "kv_blocks_used": s.used_blocks,
                "kv_blocks_free": s.free_blocks, "kv_blocks_cached": s.cached_blocks,
                "kv_blocks_peak": self.peak_blocks_used,
                "running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting,
                "prefix_cache_hit_rate": s.prefix_hit_rate,
                "prefix_cache_queried_tokens": s.prefix_queried_tokens,
                "prefix_cache_hit_tokens": s.prefix_hit_tokens,
                "preemptions": self.scheduler.num_preemptions,
                "tokens_generated": self.scheduler.num_generated_tokens,
                "requests_finished": self.num_finished}

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop (waiting at most `timeout` s for the step in progress); requests
        still in flight end with finish_reason 'error'."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():   # a hung step: end the streams, leave the thread
                log.error("the engine thread did not stop within %.0fs", timeout)
                with self._cv:
                    events, self._inbox, self._pending_adds = self._inbox, [], 0
                for req in (list(self._requests.values())
                            + [x for kind, x in events if kind == "add"]):
                    self._finish(req, "error", "the engine shut down")
                return
        if self.failure is not None:      # _die already ended every request
            return
        self.run_pending()
        for req in list(self._requests.values()):
            self.scheduler.finish(req.seq, SequenceStatus.FINISHED_ERROR)
            self._finish(req, "error", "the engine shut down")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
