"""The in-flight batching scheduler: which sequences run this step, and how many tokens each.

There is no prefill phase and no decode phase: a sequence has `num_tokens` known tokens
(prompt + generated) of which `num_computed_tokens` have K/V in the pool, and each step
lets the computed tokens catch up by up to the token budget:

    known:     | p0 p1 p2 p3 p4 p5 p6 p7 | g0 g1 |
    computed:  |<----------- 9 -------------->|       -> 1 token to schedule (a decode)
    a prompt of 900 tokens with max_num_tokens 256 runs as chunks 256, 256, 256, 132.

Each step: running decodes first (oldest first), then running prefill chunks, then new
admissions from the waiting queue (FIFO), under `max_batch_size` sequences and
`max_num_tokens` tokens. A step that runs decodes adds at most
`max_prefill_tokens_with_decodes` prefill tokens (chunks and admissions; unset: whatever the
budget leaves): the throughput/latency trade of mixing prompts into decode steps. A large
prefill chunk makes that step, and so every running stream's next token, wait for it; a
small one spreads the same prompts over more steps, each of which reads all the weights again,
and delays the new requests' first tokens. Steps without decodes always take the whole budget. Speculative decoding (a DraftPolicy)
adds drafts behind the decodes' tokens only in steps of decodes alone, at most its max_batch
of them: a step with prefill work, or a larger batch, costs the drafter nothing.
Policies decide admission when blocks are scarce:

- guaranteed_no_evict: admit only when the prompt and all of max_tokens fit in blocks not
  promised to anyone else; a started sequence always finishes.
- max_utilization: admit when the prompt fits; when a running sequence needs a block and
  none is free, preempt the most recently admitted one (free its blocks, recompute later).
  Its generated tokens stay in `token_ids`, so nothing is lost or emitted twice.

The scheduler holds no tensors: the block pool (plugins.paged_kv.block_pool) counts blocks,
the executor side turns a SchedulerOutput into tensors and hands back a StepOutput.
"""
from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from kiln.contracts import FieldError, default_input_len
from kiln.plugins.paged_kv.block_pool import BlockPool

POLICIES = ("guaranteed_no_evict", "max_utilization")


class RequestRefused(ValueError):
    """A request that can never be served under this engine's limits."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and policies of the scheduler (from the plan, possibly lowered at load)."""
    max_batch_size: int = 32          # sequences per step
    max_num_tokens: int = 512         # tokens per step (the chunked-prefill budget)
    max_seq_len: int = 2048           # prompt + output tokens of one sequence
    max_input_len: Optional[int] = None  # prompt tokens; None: max_seq_len - 1
    tokens_per_block: int = 16
    policy: str = "max_utilization"   # guaranteed_no_evict | max_utilization
    chunked_prefill: bool = True
    prefix_caching: bool = True
    max_queue: int = 1024             # bound of the waiting queue
    # prefill tokens (chunks and admissions) a step that runs decodes may add; None: what
    # max_num_tokens leaves. Lower: steadier inter-token latency while prompts arrive, later
    # first tokens and more steps for the same prompts (the module docstring)
    max_prefill_tokens_with_decodes: Optional[int] = None

    def __post_init__(self):
        """The one check of the engine's limits (FieldError names the setting)."""
        if self.policy not in POLICIES:
            raise FieldError("policy", f"{self.policy!r} is not known; allowed: "
                             f"{', '.join(POLICIES)}",
                             f"policy {self.policy!r} is not known; allowed: {', '.join(POLICIES)}")
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len", "tokens_per_block",
                     "max_queue"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"must be >= 1 (got {getattr(self, name)})")
        cap = self.max_prefill_tokens_with_decodes
        if cap is not None and cap < 1:
            raise FieldError("max_prefill_tokens_with_decodes",
                             f"must be >= 1 (got {cap}): with 0, a prompt would wait for every "
                             "running sequence to finish")
        if self.max_input_len is not None and not 1 <= self.max_input_len < self.max_seq_len:
            problem = (f"({self.max_input_len}) must be in [1, max_seq_len ({self.max_seq_len})): "
                       "a request needs room for one output token")
            raise FieldError("max_input_len", problem)

    @property
    def input_len(self) -> int:
        return (self.max_input_len if self.max_input_len is not None
                else default_input_len(self.max_seq_len))


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"             # waiting again, to be recomputed
    FINISHED_STOPPED = "stop"           # stop token / stop string
    FINISHED_LENGTH = "length"          # max_tokens or max_seq_len
    FINISHED_ABORTED = "cancelled"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "cancelled", "error")


class TokenSequence:
    """One request's tokens (prompt + output) and its scheduling state, owned by the
    scheduler."""

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int,
                 min_tokens: int = 0, stop_token_ids: Iterable[int] = (), sampling: Any = None,
                 arrival_time: Optional[float] = None, adapter: Optional[str] = None):
        self.request_id = request_id
        self.adapter = adapter           # the LoRA adapter it runs with (None: the base model)
        self.token_ids: list[int] = list(prompt_token_ids)   # prompt + generated
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0     # tokens whose K/V is in the pool
        self.num_cached_tokens = 0       # prompt tokens served by the prefix cache (first run)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []   # chained hashes of full blocks of token_ids
        self.status = SequenceStatus.WAITING
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.sampling = sampling         # the caller's sampling state, opaque to the scheduler
        self.num_preemptions = 0
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: Optional[float] = None
        self.stop_reason: Any = None     # the stop token id or stop string that ended it

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (f"TokenSequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")


@dataclass
class SchedulerOutput:
    """What runs this step; the only object the scheduler hands the executor side."""
    seqs: list[TokenSequence] = field(default_factory=list)    # scheduled, in packing order
    num_scheduled_tokens: list[int] = field(default_factory=list)  # seqs[i] -> tokens this step
    # seqs[i] samples a token this step iff its computed tokens reach its known tokens
    sample: list[bool] = field(default_factory=list)
    preempted: list[TokenSequence] = field(default_factory=list)  # preempted while scheduling
    total_num_tokens: int = 0                             # sum(num_scheduled_tokens)
    # seqs[i] -> the draft tokens appended to its row (speculative decoding; counted in
    # num_scheduled_tokens); only the sequences that draft this step
    drafts: dict[int, list[int]] = field(default_factory=dict)

    @classmethod
    def make_empty(cls) -> "SchedulerOutput":
        return cls()

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class StepOutput:
    """What the executor side hands back: one entry per scheduled sequence."""
    # seqs[i] -> its new token. None: mid-prefill; or, where seqs[i] was to sample, deferred
    # (no token this step: its last scheduled token is computed again next step)
    sampled_token_ids: list[Optional[int]]
    # seqs[i] -> how many of its drafts were kept (the target's token follows them)
    num_accepted: dict[int, int] = field(default_factory=dict, kw_only=True)


@dataclass(frozen=True)
class DraftPolicy:
    """Speculative decoding as the scheduler sees it: `propose(seqs, limits)` -> for each
    decoding sequence of a step, up to limits[i] draft tokens ([] for one that does not
    speculate; limits[i] may be 0), asked once per step and only in steps of at most
    `max_batch` decoding sequences and no prefill work."""
    max_batch: int
    propose: Callable[[list["TokenSequence"], list[int]], list[list[int]]]


class Scheduler:
    """Waiting and running queues over a BlockPool; see the module docstring."""

    def __init__(self, config: SchedulerConfig, num_blocks: int,
                 drafts: Optional[DraftPolicy] = None, max_adapters: int = 0):
        self.config = config
        self.drafts = drafts
        # different LoRA adapters among the running sequences at most (0: no adapters), so a
        # step never has more than the plan's adapter slots
        self.max_adapters = max_adapters
        self.pool = BlockPool(num_blocks, config.tokens_per_block, config.prefix_caching)
        self.waiting: deque[TokenSequence] = deque()
        self.running: list[TokenSequence] = []      # admission order: running[-1] is the newest
        self.by_id: dict[str, TokenSequence] = {}
        self.num_preemptions = 0
        self.num_generated_tokens = 0
        self._guaranteed = config.policy == "guaranteed_no_evict"

    # ---- requests ---------------------------------------------------------------------------
    def check(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestRefused for a request that could never be served."""
        c = self.config
        if num_prompt_tokens < 1:
            raise RequestRefused("the prompt is empty: at least one token is needed")
        if num_prompt_tokens > c.input_len:
            raise RequestRefused(f"the prompt has {num_prompt_tokens} tokens; max_input_len is "
                                 f"{c.input_len}")
        total = num_prompt_tokens + max_tokens
        if total > c.max_seq_len:
            raise RequestRefused(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens})"
                                 f" = {total} exceeds max_seq_len ({c.max_seq_len})")
        if not c.chunked_prefill and num_prompt_tokens > c.max_num_tokens:
            raise RequestRefused(f"the prompt has {num_prompt_tokens} tokens; with chunked "
                                 f"prefill off it must fit max_num_tokens ({c.max_num_tokens})")
        need = self.pool.blocks_for(total)
        if need > self.pool.num_blocks:
            raise RequestRefused(f"prompt + max_tokens = {total} tokens needs {need} KV blocks; "
                                 f"the pool has {self.pool.num_blocks}")

    def add(self, seq: TokenSequence) -> None:
        """Queue a sequence (call check() first)."""
        self.check(seq.num_prompt_tokens, seq.max_tokens)
        if seq.request_id in self.by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in flight")
        self.by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Optional[TokenSequence]:
        """Finish a request as cancelled and free its blocks at once; None if unknown."""
        seq = self.by_id.get(request_id)
        if seq is not None:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seq

    def finish(self, seq: TokenSequence, status: SequenceStatus) -> None:
        """End a sequence (any FINISHED_* status): leave the queues, free the blocks."""
        if seq.is_finished:
            return
        if seq in self.running:   # short lists; a finished sequence leaves once
            self.running.remove(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            self.waiting.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.status = status
        self.by_id.pop(seq.request_id, None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and token counts."""
        out = SchedulerOutput()
        budget = self.config.max_num_tokens
        # 1. running decodes (one token each; drafts join them in 4.), oldest first;
        # preempt the newest if blocks run out
        decodes: list[TokenSequence] = []
        i = 0
        while i < len(self.running) and len(decodes) < budget:
            seq = self.running[i]
            if seq.num_tokens - seq.num_computed_tokens == 1:
                if not self._reserve_slot(seq, out):
                    break                  # seq itself was preempted (it was the newest)
                decodes.append(seq)
            i += 1
        for seq in decodes:
            self._put(out, seq, 1)
        budget -= len(decodes)
        cap = self.config.max_prefill_tokens_with_decodes
        if out.seqs and cap is not None:   # decodes run: prefill work joins them up to the cap
            budget = min(budget, cap)
        # 2. running prefill chunks (their prompt blocks were allocated at admission)
        for seq in self.running:
            if budget <= 0 or len(out.seqs) >= self.config.max_batch_size:
                break
            todo = seq.num_tokens - seq.num_computed_tokens
            if todo > 1:  # (todo == 1 was scheduled above)
                n = min(todo, budget)
                self._put(out, seq, n)
                budget -= n
        # 3. admissions, FIFO (a preempted sequence is at the front); one whose adapter
        # would exceed max_adapters running adapters waits, and those behind it may pass
        adapters = {s.adapter for s in self.running if s.adapter is not None}
        skipped = 0
        while len(self.waiting) > skipped and budget > 0 \
                and len(self.running) < self.config.max_batch_size:
            seq = self.waiting[skipped]
            if seq.adapter is not None and seq.adapter not in adapters \
                    and len(adapters) >= self.max_adapters:
                skipped += 1
                continue
            if not self._admit(seq, budget):
                break
            del self.waiting[skipped]
            if seq.adapter is not None:
                adapters.add(seq.adapter)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            self._put(out, seq, n)
            budget -= n
        # 4. drafts behind the decodes' tokens, in a step of decodes alone
        if len(out.seqs) == len(decodes) and self._speculates(len(decodes)):
            self._add_drafts(out, decodes)
        return out

    def update(self, out: SchedulerOutput, step: StepOutput) -> list[TokenSequence]:
        """Advance the scheduled sequences by this step's results. Appends sampled tokens,
        finishes sequences on stop tokens / max_tokens / max_seq_len and frees their blocks.
        -> the sequences that received a token (finished ones included)."""
        touched = []
        for i, (seq, n, tok, sample) in enumerate(zip(out.seqs, out.num_scheduled_tokens,
                                                      step.sampled_token_ids, out.sample)):
            if seq.is_finished:        # cancelled while the step ran
                continue
            if out.drafts and i in out.drafts:
                if self._advance_drafted(seq, n, tok, out.drafts[i],
                                         step.num_accepted.get(i, 0)):
                    touched.append(seq)
                continue
            if tok is None and sample:   # deferred by the sampler: its last token runs again
                n -= 1
            seq.num_computed_tokens += n
            self.pool.cache_blocks(seq.block_table, seq.token_ids, seq.num_computed_tokens,
                                   seq.adapter)
            if tok is None:
                continue
            seq.token_ids.append(tok)
            self.num_generated_tokens += 1
            touched.append(seq)
            if tok in seq.stop_token_ids and seq.num_output_tokens >= seq.min_tokens:
                seq.stop_reason = tok
                self.finish(seq, SequenceStatus.FINISHED_STOPPED)
            elif (seq.num_output_tokens >= seq.max_tokens
                  or seq.num_tokens >= self.config.max_seq_len):
                self.finish(seq, SequenceStatus.FINISHED_LENGTH)
        return touched

    def truncate_output(self, seq: TokenSequence, num_tokens: int) -> None:
        """Drop a finished sequence's tokens past `num_tokens` (a stop string matched before
        the last of several tokens one step emitted)."""
        dropped = max(0, seq.num_tokens - num_tokens)
        del seq.token_ids[num_tokens:]
        self.num_generated_tokens -= dropped

    def adapter_names(self) -> tuple[list[str], list[str]]:
        """(LoRA adapters of running sequences, of waiting ones), sorted; read from another
        thread (metrics), so over copies of the queues."""
        running = sorted({s.adapter for s in list(self.running) if s.adapter is not None})
        waiting = sorted({s.adapter for s in list(self.waiting) if s.adapter is not None})
        return running, waiting

    # ---- speculative decoding -------------------------------------------------------------
    def _speculates(self, decodes: int) -> bool:
        """Whether a step of `decodes` decoding sequences and no prefill work asks for
        drafts: only with 1..drafts.max_batch of them. (A step with prefill work -- a running
        prompt's chunk, an admission -- never does: it is larger anyway, drafts would take
        its budget, and the draft model would start on sequences about to leave the
        small-batch regime.)"""
        return self.drafts is not None and 0 < decodes <= self.drafts.max_batch

    def _add_drafts(self, out: SchedulerOutput, decodes: list[TokenSequence]) -> None:
        """Append drafts to the decodes' rows (out.seqs[:len(decodes)]): one ask of the policy
        for all of them (a draft model drafts them as one batch), each at most what the token
        budget leaves once every decode has its own token, never past its last possible
        token (prompt + max_tokens, max_seq_len), and only into blocks free now (drafts never
        preempt)."""
        per_seq = (self.config.max_num_tokens - len(decodes)) // len(decodes)
        limits = [max(0, min(per_seq, min(s.num_prompt_tokens + s.max_tokens,
                                          self.config.max_seq_len) - s.num_tokens))
                  for s in decodes]
        if not any(limits):
            return
        for i, (seq, drafts, limit) in enumerate(zip(decodes, self.drafts.propose(decodes,
                                                                                  limits),
                                                     limits)):
            m = min(len(drafts), limit)
            while m and not self.pool.can_append(seq.block_table, seq.num_tokens + m):
                m -= 1
            if m:
                self.pool.may_append(seq.block_table, seq.num_tokens + m)
                out.drafts[i] = list(drafts[:m])
                out.num_scheduled_tokens[i] += m
                out.total_num_tokens += m

    def _advance_drafted(self, seq: TokenSequence, n: int, tok: Optional[int],
                         drafts: list[int], accepted: int) -> bool:
        """update() of a sequence whose row carried drafts: its KV keeps the accepted ones
        (the rejected positions are rolled back by length, and blocks past the new length
        freed); the accepted drafts then the target's token are appended and the stop rules
        run on each in order, dropping whatever follows a finishing token. -> whether
        tokens were appended."""
        m = len(drafts)
        # no token (a failed row): nothing of the row is kept, its last token runs again
        seq.num_computed_tokens += n - m - 1 if tok is None else n - (m - accepted)
        start = seq.num_tokens
        if tok is not None:
            seq.token_ids.extend(drafts[:accepted])
            seq.token_ids.append(tok)
        self.pool.cache_blocks(seq.block_table, seq.token_ids, seq.num_computed_tokens,
                               seq.adapter)
        self.pool.truncate(seq.block_table, max(seq.num_tokens, seq.num_computed_tokens))
        for j in range(start, seq.num_tokens):
            t = seq.token_ids[j]
            self.num_generated_tokens += 1
            out_len = j + 1 - seq.num_prompt_tokens
            if t in seq.stop_token_ids and out_len >= seq.min_tokens:
                seq.stop_reason = t
                status = SequenceStatus.FINISHED_STOPPED
            elif out_len >= seq.max_tokens or j + 1 >= self.config.max_seq_len:
                status = SequenceStatus.FINISHED_LENGTH
            else:
                continue
            del seq.token_ids[j + 1:]
            self.finish(seq, status)
            break
        return tok is not None

    # ---- internals ----------------------------------------------------------------------------
    def _put(self, out: SchedulerOutput, seq: TokenSequence, n: int) -> None:
        out.seqs.append(seq)
        out.sample.append(seq.num_computed_tokens + n == seq.num_tokens)
        out.num_scheduled_tokens.append(n)
        out.total_num_tokens += n
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()

    def _reserve_slot(self, seq: TokenSequence, out: SchedulerOutput) -> bool:
        """Make room for seq's next token, preempting the newest sequences if needed.
        -> False when seq itself had to be preempted."""
        need = seq.num_computed_tokens + 1
        while not self.pool.can_append(seq.block_table, need):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        self.pool.may_append(seq.block_table, need)
        return True

    def _preempt(self, seq: TokenSequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _reserved_blocks(self) -> int:
        """Blocks promised to running sequences for their remaining output (no-evict policy)."""
        pool = self.pool
        return sum(max(0, pool.blocks_for(min(s.num_prompt_tokens + s.max_tokens,
                                              self.config.max_seq_len)) - len(s.block_table))
                   for s in self.running)

    def _admit(self, seq: TokenSequence, budget: int) -> bool:
        """Allocate blocks for a waiting sequence if the policy and the budget allow."""
        pool = self.pool
        if pool.prefix_caching:
            seq.block_hashes = pool.hash_blocks(seq.token_ids, seq.block_hashes, seq.adapter)
        if self._guaranteed:
            final = min(seq.num_prompt_tokens + seq.max_tokens, self.config.max_seq_len)
            reserve = pool.blocks_for(final) - pool.blocks_for(seq.num_tokens)
            reserve += self._reserved_blocks()
        else:
            reserve = 0
        if not pool.can_allocate(seq.token_ids, seq.block_hashes, reserve):
            return False
        if not self.config.chunked_prefill and seq.status is SequenceStatus.WAITING:
            # a first run must fit the step whole (a resumed one may be recomputed in chunks)
            cached = pool.cached_prefix_len(seq.token_ids, seq.block_hashes)
            if seq.num_tokens - cached > budget:
                return False
        first_run = seq.status is SequenceStatus.WAITING
        seq.block_table, cached = pool.allocate(seq.token_ids, seq.block_hashes)
        seq.num_computed_tokens = cached
        if first_run:
            seq.num_cached_tokens = cached
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True
