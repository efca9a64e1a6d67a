"""The engine: requests in, streamed tokens out.

    submit() --inbox--> [engine thread: step() = schedule -> execute -> update] --> streams

`Engine.step()` is the whole serving loop: the scheduler (plugins.inflight_batching) picks
sequences and token counts, the model runner (runtime/model_runner.py) packs them into one
ModelInput, runs the compiled step and samples, and the update appends tokens, detokenizes,
applies stop rules and delivers a RequestOutput (runtime/streams.py) to each request's
stream. Callers on any thread (or an asyncio loop) submit requests and read their
RequestStream; their submissions and cancellations reach the engine thread as typed inbox
messages (AddRequest, AbortRequest). Only the engine thread touches the scheduler, the block
pool and the KV pools.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from kiln.plugins.inflight_batching import (DraftPolicy, RequestRefused, Scheduler,
                                            SchedulerOutput, SequenceStatus, StepOutput,
                                            TokenSequence)
from kiln.runtime.compute import enter_engine_thread
from kiln.runtime.draft_model import DraftModel
from kiln.runtime.engine_config import EngineConfig
from kiln.runtime.executor import Executor
from kiln.runtime.lora import AdapterRegistry
from kiln.runtime.guided import (CompileBusy, GrammarCache, Guide, GuidedDecoding,
                                 GuidedLimits, Masker)
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.plan import Plan, load_plan
from kiln.runtime.sampling import Sampler, SamplingParams, SamplingState, TokenLogprobs
from kiln.runtime.speculative import (DraftRecord, NgramIndex, SpeculativeConfig,
                                      serving_choice)
from kiln.runtime.streams import (RequestOutput, RequestResult, RequestStream, Timings,  # noqa: F401
                             Usage, hold_posts, release_posts)
from kiln.runtime.tokenizer import Tokenizer

log = logging.getLogger("kiln.runtime")

Prompt = Union[str, Sequence[int], Sequence[dict]]   # text, token ids, or chat messages
LIMITS = ("max_batch_size", "max_num_tokens", "max_seq_len", "max_input_len")


class QueueFullError(RuntimeError):
    """The waiting queue is at max_queue; retry later (gRPC: RESOURCE_EXHAUSTED)."""


class EngineError(RuntimeError):
    """The engine is shut down or failed."""


class _Request:
    """Engine-thread bookkeeping of one request."""
    __slots__ = ("seq", "stream", "detok", "arrival", "first_token", "last_token", "sent",
                 "lookup", "drafts")

    def __init__(self, seq: TokenSequence, stream: RequestStream, detok):
        self.seq, self.stream, self.detok = seq, stream, detok
        self.sent = seq.num_tokens       # tokens of seq.token_ids delivered (or the prompt)
        self.lookup: Optional[NgramIndex] = None   # its n-gram drafts' index, once it drafts
        self.drafts: Optional[DraftRecord] = None  # its speculation, once it may draft
        self.arrival = seq.arrival_time
        self.first_token: Optional[float] = None
        self.last_token: Optional[float] = None


@dataclass(frozen=True)
class AddRequest:
    """Inbox message (submit -> engine thread): start serving this request."""
    request: _Request


@dataclass(frozen=True)
class AbortRequest:
    """Inbox message (RequestStream.cancel -> engine thread): end this request."""
    request_id: str


InboxMessage = Union[AddRequest, AbortRequest]


class Engine:
    """Serves one model: submit() from any thread, a background thread runs steps."""

    def __init__(self, executor: Executor, tokenizer: Tokenizer, config: EngineConfig,
                 start: bool = True, vocab_size: Optional[int] = None,
                 num_threads: Optional[int] = None,
                 guided_limits: Optional[GuidedLimits] = None,
                 speculative: Optional[SpeculativeConfig] = None,
                 drafter: Optional[DraftModel] = None,
                 adapters: Optional[AdapterRegistry] = None):
        """vocab_size: the model's (the logits' width; default the tokenizer's). num_threads:
        the engine thread's compute threads (runtime/compute.py; default: torch's).
        guided_limits: what output constraints may cost (runtime/guided.py). speculative:
        n-gram speculative decoding (runtime/speculative.py; None: off). drafter: the draft
        plan's proposer of method draft (runtime/draft_model.py). adapters: a LoRA plan's
        loaded adapters (runtime/lora.py; requests name one in SamplingParams.adapter)."""
        self.num_threads = num_threads
        if config.tokens_per_block != executor.layout.tokens_per_block:
            raise ValueError(f"tokens_per_block={config.tokens_per_block} but the KV pools have "
                             f"{executor.layout.tokens_per_block}")
        self.config = config
        self.tokenizer = tokenizer
        self.executor = executor
        self.speculative = speculative
        self.drafter = DraftModel.attach(drafter, speculative)
        self.scheduler = Scheduler(config, executor.layout.num_blocks, None if speculative is None
                                   else DraftPolicy(speculative.max_batch, self._propose))
        self.model_runner = ModelRunner(executor, Sampler())
        self.adapters = self.model_runner.adapters = adapters
        self.scheduler.max_adapters = adapters.section.max_adapters_per_batch if adapters else 0
        self._requests: dict[str, _Request] = {}
        self._inbox: list[InboxMessage] = []   # from callers, applied between steps
        self._pending_adds = 0                 # AddRequests in the inbox
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._closed = False
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.guided_limits = guided_limits or GuidedLimits()
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
                  guided_limits: Optional[GuidedLimits] = None,
                  speculative: Union[bool, str, SpeculativeConfig] = "plan",
                  draft_plan: Union[str, Path, None] = None,
                  **overrides) -> "Engine":
        """Load a built plan. `overrides`: EngineConfig fields; limits only lowered.
        speculative: "plan" (True) = the plan's speculative section (if any), "off" (False)
        = none, or a configuration of its own (`kiln serve --speculative`). draft_plan: the
        draft plan's directory (method draft; default: the one the plan records), loaded
        beside it."""
        speculative = serving_choice(speculative)
        plan = plan if isinstance(plan, Plan) else load_plan(plan)
        config = EngineConfig.from_plan(plan, **overrides)
        if speculative is True:
            section = plan.manifest.speculative
            speculative = None if section is None else SpeculativeConfig(
                **{k: v for k, v in section.to_json().items() if k != "draft"})
        drafter = DraftModel.for_engine(plan, speculative or None, draft_plan)
        executor = Executor.from_plan(plan, kv_budget_bytes)
        return cls(executor, Tokenizer.from_plan(plan),
                   config, start=start, vocab_size=plan.shape.vocab_size,
                   num_threads=num_threads, guided_limits=guided_limits,
                   speculative=speculative or None, drafter=drafter,
                   adapters=AdapterRegistry.for_plan(plan, executor))

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, execute, update."""
        scheduler_output = self.scheduler.schedule()
        step_output = self.model_runner.execute(scheduler_output)
        return self.update(scheduler_output, step_output)

    def _propose(self, seqs: list[TokenSequence], limits: list[int]) -> list[list[int]]:
        """Drafts for a step's decoding sequences, each at most its limit and what its
        request's DraftRecord allows now; none for a request with a constraint or logprobs
        (they decode one token a step). A draft model drafts them as one batch."""
        spec = self.speculative
        ks = [min(k, spec.max_draft_tokens, self._allowed(s)) if k > 0 else 0
              for s, k in zip(seqs, limits)]
        if self.drafter is not None:
            return self.drafter.propose(seqs, ks)
        out = []
        for seq, k in zip(seqs, ks):
            req = self._requests.get(seq.request_id)
            if k < 1 or req is None:
                out.append([])
                continue
            if req.lookup is None:
                req.lookup = NgramIndex(spec.ngram_min, spec.ngram_max)
            out.append(req.lookup.propose(seq.token_ids, k))
        return out

    def _allowed(self, seq: TokenSequence) -> int:
        """Drafts seq's request may bring this step (its DraftRecord, made on first ask)."""
        state = seq.sampling
        if state is None or state.guide is not None or state.params.logprobs is not None:
            return 0
        req = self._requests.get(seq.request_id)
        if req is None:
            return 0
        if req.drafts is None:
            asked = seq.sampling.params.max_draft_tokens
            req.drafts = DraftRecord(self.speculative.max_draft_tokens if asked is None
                                     else asked, adapt=self.drafter is not None)
        return req.drafts.limit()

    def update(self, sched: SchedulerOutput, step: StepOutput) -> list[RequestOutput]:
        """Apply a step's tokens; deliver one output per request that advanced."""
        self.peak_blocks_used = max(self.peak_blocks_used, self.scheduler.pool.num_blocks
                                    - self.scheduler.pool.num_free_blocks)
        now = time.monotonic()
        lps = getattr(step, "logprobs", None) or {}
        for rid, error in (getattr(step, "errors", None) or {}).items():
            self._fail(self._requests[rid], error)    # before update: it skips finished seqs
        for i, accepted in step.num_accepted.items():   # speculation: each request's record
            req = self._requests.get(sched.seqs[i].request_id)
            if req is not None and req.drafts is not None:
                req.drafts.record(len(sched.drafts[i]), accepted)
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
            messages, self._inbox, self._pending_adds = self._inbox, [], 0
        for msg in messages:
            if isinstance(msg, AddRequest):
                req = msg.request
                self._requests[req.seq.request_id] = req
                try:
                    self.scheduler.add(req.seq)
                except Exception as e:    # refused late (e.g. a duplicate id): this one fails
                    self._finish(req, "error", f"{type(e).__name__}: {e}")
            else:
                req = self._requests.get(msg.request_id)
                if req is not None:
                    self.scheduler.abort(msg.request_id)
                    self._finish(req, "cancelled")

    def _loop(self) -> None:
        """The engine thread, supervised. A step that raises fails the requests it can be
        pinned on -- a request whose sampling or detokenizing raised (see update), otherwise
        the running batch -- and the loop goes on. Anything that escapes that (a fault in
        the bookkeeping itself) ends the engine: every request fails, submit() refuses and
        the failure callbacks run (the server reports NOT_SERVING)."""
        try:
            enter_engine_thread(self.num_threads)
            hold_posts()    # outputs go out as the next step launches (runtime/streams.py)
            self.model_runner.before_launch = release_posts
            while self._run_once():
                pass
        except BaseException as e:
            self._die(e)
        finally:
            release_posts()

    def _run_once(self) -> bool:
        if not self.scheduler.has_work():
            release_posts()    # nothing to launch: hand the held outputs over before waiting
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
            messages, self._inbox, self._pending_adds = self._inbox, [], 0
        # the scheduler may be inconsistent: end the streams without touching it
        for req in list(self._requests.values()) + _added(messages):
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
               request_id: Optional[str] = None, guide: Optional[Guide] = None
               ) -> RequestStream:
        """Queue a request -> its stream. Raises RequestRefused (a ValueError) for a request
        that can never fit, QueueFullError when the waiting queue (or the queue of constraints
        to compile) is full. guide: params.guided compiled already (compile_guided); else it
        is compiled here, waiting at most the compile deadline."""
        params = params or SamplingParams()
        for name in ("stop_token_ids", "bad_token_ids"):
            bad = [t for t in getattr(params, name) if t >= self.vocab_size]
            if bad:
                raise RequestRefused(f"{name}: token id {bad[0]} is outside the model's "
                                     f"vocabulary [0, {self.vocab_size})")
        self._check_drafts(params.max_draft_tokens)
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
                state.guide = guide or self._grammars().guide(params.guided)
            except ValueError as e:
                raise RequestRefused(str(e)) from None
            except CompileBusy as e:
                raise QueueFullError(str(e)) from None
        with self._cv:
            if self._closed:
                raise EngineError(f"the engine failed ({self.failure})" if self.failure
                                  else "the engine is shut down")
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if len(self.scheduler.waiting) + self._pending_adds >= self.config.max_queue:
                raise QueueFullError(f"the waiting queue is full ({self.config.max_queue} "
                                     "requests); retry later")
            if rid in self._requests or any(r.seq.request_id == rid
                                              for r in _added(self._inbox)):
                raise ValueError(f"request id {rid!r} is already in flight")
            seq = TokenSequence(rid, ids, params.max_tokens, params.min_tokens, stop_ids, state,
                                adapter=params.adapter)
            stream = RequestStream(self._abort, rid, ids)
            detok = tok.detokenizer(ids, params.stop, params.include_stop_str_in_output,
                                    params.skip_special_tokens)
            if params.adapter is not None:      # UnknownAdapterError: never the base instead
                AdapterRegistry.acquire_for(self.adapters, params.adapter)   # until retired
            self._inbox.append(AddRequest(_Request(seq, stream, detok)))
            self._pending_adds += 1
            self._cv.notify()
        return stream

    def _check_drafts(self, k: Optional[int]) -> None:
        """RequestRefused for a request asking for more drafts a step than this engine runs."""
        spec = self.speculative
        if k and spec is None:
            raise RequestRefused(f"max_draft_tokens={k}: this engine does not speculate (its "
                                 "plan has no speculative section, or serving turned it off); "
                                 "send 0 or leave it unset")
        if k and k > spec.max_draft_tokens:
            raise RequestRefused(f"max_draft_tokens={k} exceeds the plan's "
                                 f"speculative.max_draft_tokens ({spec.max_draft_tokens})")

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, each checked against the model's and the tokenizer's
        vocabularies (a tokenizer may hold ids the model has no embedding for)."""
        vocab = min(self.vocab_size, self.tokenizer.vocab_size)
        if isinstance(prompt, str):
            ids, what = self.tokenizer.encode(prompt), "the prompt's text tokenizes to"
        elif len(prompt) and isinstance(prompt[0], dict):
            ids = self.tokenizer.apply_chat_template(list(prompt), tokenize=True)
            what = "the rendered chat tokenizes to"
        else:
            ids, what = [int(t) for t in prompt], "the prompt has"
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRefused(f"{what} token id {bad}, outside the vocabulary [0, {vocab}) "
                                 f"(the model has {self.vocab_size} ids, the tokenizer "
                                 f"{self.tokenizer.vocab_size})")
        return ids

    def compile_guided(self, guided: GuidedDecoding) -> "Future[Guide]":
        """Start compiling a constraint -> the future Guide to pass to submit() (ValueError:
        it does not compile). Cancelling the future withdraws the compile. Raises
        QueueFullError when too many compiles wait already."""
        try:
            return self._grammars().submit(guided)
        except CompileBusy as e:
            raise QueueFullError(str(e)) from None

    @property
    def guided_ready(self) -> bool:
        """The constraint compiler exists (building it reads the tokenizer: ~0.3 s for a
        49k vocabulary; callers on an event loop make it on a worker thread first)."""
        return self._grammar_cache is not None

    def prepare_guided(self) -> None:
        """Build the constraint compiler now (idempotent)."""
        self._grammars()

    def compile_timeout(self, guided: GuidedDecoding) -> ValueError:
        """The error of a compile that ran past its deadline."""
        return self._grammars().timeout(guided)

    def _grammars(self) -> GrammarCache:
        """The compiler of constraints over this tokenizer (and the masker of its matchers),
        made by the first that needs it. Masks span the larger of the two vocabularies; the
        sampler cuts them to the logits' width."""
        with self._grammar_lock:
            if self._grammar_cache is None:
                tok = self.tokenizer
                vocab = max(self.vocab_size, tok.vocab_size)
                self.model_runner.masker = Masker(vocab, self.config.max_batch_size,
                                                  self.guided_limits)
                self._grammar_cache = GrammarCache(
                    tok.to_json(), tok.eos_token_ids[0] if tok.eos_token_ids else None,
                    vocab, self.guided_limits)
            return self._grammar_cache

    def _abort(self, request_id: str) -> None:
        with self._cv:
            self._inbox.append(AbortRequest(request_id))
            self._cv.notify()

    def generate(self, prompts: Sequence[Prompt],
                 params: Union[SamplingParams, Sequence[SamplingParams], None] = None
                 ) -> list[RequestResult]:
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
        toks = seq.token_ids[req.sent:]
        if len(toks) == 1:
            text, stop = req.detok.step(toks)
        else:
            text, stop, toks = self._detok_each(req, toks)
        req.sent = seq.num_tokens
        if stop is not None and not seq.is_finished:
            seq.stop_reason = stop
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        guide = seq.sampling.guide
        if guide is not None and guide.done and not seq.is_finished:   # the grammar is complete
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        if not seq.is_finished:
            out = self._output(req, toks, text, None)
        else:
            out = self._output(req, toks, text + req.detok.flush(), seq.status.value)
            self._retire(req)
        if logprobs is not None:
            out = dataclasses.replace(out, logprobs=[logprobs])
        req.stream._put(out)
        return out

    def _detok_each(self, req: _Request, toks: list[int]) -> tuple[str, object, list[int]]:
        """Detokenize the several tokens of one step (accepted drafts) one by one, as that
        many steps would: a stop string matched before the last ends the request there
        and drops the tokens after it. -> (text, stop string or None, the tokens kept)."""
        seq, text = req.seq, ""
        for j, t in enumerate(toks):
            piece, stop = req.detok.step([t])
            text += piece
            if stop is not None:
                if j + 1 < len(toks):
                    self.scheduler.truncate_output(seq, req.sent + j + 1)
                    if seq.is_finished:   # a stop token or max_tokens came later: too late
                        seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
                return text, stop, toks[:j + 1]
        return text, None, toks

    def _finish(self, req: _Request, reason: str, error: Optional[str] = None) -> None:
        """End a request outside the token path (cancelled, error, shutdown)."""
        out = self._output(req, [], "", reason, error)
        self._retire(req)
        req.stream._put(out)

    def _retire(self, req: _Request) -> None:
        if self.drafter is not None:     # its draft blocks, at once
            self.drafter.release(req.seq.request_id)
        if self._requests.pop(req.seq.request_id, None) is not None:
            self.num_finished += 1
            if self.adapters is not None:
                self.adapters.release(req.seq.adapter)

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
        d = req.drafts
        usage = Usage(seq.num_prompt_tokens, seq.num_cached_tokens, n,
                      d.drafted if d else 0, d.accepted if d else 0)
        return RequestOutput(seq.request_id, toks, text, reason is not None, reason, usage,
                             timings, seq.stop_reason, error)

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
                "spec_draft_tokens": self.model_runner.num_drafted,
                "spec_accepted_tokens": self.model_runner.num_accepted,
                "spec_draft_rows": self.model_runner.num_draft_rows,
                "spec_draft_model_steps": self.drafter.num_steps if self.drafter else 0,
                "spec_draft_model_positions": self.drafter.num_positions if self.drafter else 0,
                "requests_finished": self.num_finished}

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop (waiting at most `timeout` s for the step in progress); requests
        still in flight end with finish_reason 'error'."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        with self._grammar_lock:
            if self._grammar_cache is not None:
                self._grammar_cache.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():   # a hung step: end the streams, leave the thread
                log.error("the engine thread did not stop within %.0fs", timeout)
                with self._cv:
                    messages, self._inbox, self._pending_adds = self._inbox, [], 0
                for req in list(self._requests.values()) + _added(messages):
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


def _added(messages: list[InboxMessage]) -> list[_Request]:
    """The requests of the AddRequests among inbox messages."""
    return [m.request for m in messages if isinstance(m, AddRequest)]
