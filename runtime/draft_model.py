"""Draft-model speculative decoding: a second, cheaper plan of the same tokenizer proposes
the drafts (speculative.method draft), which the target plan verifies exactly (see
runtime/speculative.py).

The draft plan runs beside the target in one process, on its own executor (runtime/executor.py:
its compiled step, its paged KV pools) and its own BlockPool, one draft sequence per target
request. Proposing for the speculating sequences of a step:

    target tokens:  t0 .. t(c-1) | tc .. t(L-1)        draft KV holds t0..t(c-1) (c <= L-1)
    catch-up:       one packed step feeds tc..t(L-1)   -> d1 = argmax at t(L-1)
    k-1 decodes:    feed d1, d2, ... batched over the sequences -> d2 .. dk
    draft KV then:  t0 .. t(L-1) d1 .. d(k-1)

At the next proposal the draft's tokens are compared with the target's: whatever the target
did not keep is rolled back by length (BlockPool.truncate) and the rest is fed in the catch-up.
A draft sequence whose KV cannot grow proposes nothing (the request decodes one token a step);
a finished or cancelled request's draft blocks are freed by `release`.

`draft_mismatches` is the one compatibility check of a draft plan against a target, used by
the builder (against the spec being built) and at load.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from kiln.plugins.inflight_batching import TokenSequence
from kiln.plugins.paged_kv.block_pool import BlockPool
from kiln.runtime.executor import Executor, ModelInput
from kiln.runtime.plan import (GENERATION_FILE, TOKENIZER_FILE, Plan, PlanError, load_plan,
                               rebuild_command)

log = logging.getLogger("kiln.runtime")


# ---- what a draft plan must match ----------------------------------------------------------

@dataclass(frozen=True)
class DraftTarget:
    """The facts of a target plan (built, or being built) a draft plan must match."""
    tokenizer_json: bytes
    vocab_size: int
    bos_token_id: Optional[int]
    eos_token_ids: tuple[int, ...]
    max_seq_len: int
    max_batch: int                    # sequences that speculate in one step
    device: str
    arch: str
    cpu_features: tuple[str, ...]
    compute_capability: Optional[str] = None

    @classmethod
    def from_plan(cls, plan: Plan, max_batch: int) -> "DraftTarget":
        gen, t = plan.generation, plan.manifest.target
        return cls(plan.data_file(TOKENIZER_FILE), plan.shape.vocab_size,
                   gen.get("bos_token_id"), _eos(gen), plan.limits.max_seq_len,
                   min(max_batch, plan.limits.max_batch_size), t.device, t.arch,
                   tuple(t.cpu_features or ()), t.compute_capability)


def _eos(gen: dict) -> tuple[int, ...]:
    eos = gen.get("eos_token_ids", gen.get("eos_token_id", ()))
    return tuple([eos] if isinstance(eos, int) else eos or ())


def draft_mismatches(target: DraftTarget, draft: Plan) -> list[str]:
    """What keeps `draft` from drafting for `target`, one line each ([]: it can)."""
    m, gen = draft.manifest, draft.generation
    out = []
    tok = _tokenizer_diff(target.tokenizer_json, draft.data_file(TOKENIZER_FILE))
    if tok:
        out.append(tok)
    if draft.shape.vocab_size != target.vocab_size:
        out.append(f"vocab_size: the draft has {draft.shape.vocab_size}, the target "
                   f"{target.vocab_size}")
    if gen.get("bos_token_id") != target.bos_token_id:
        out.append(f"bos_token_id: the draft has {gen.get('bos_token_id')}, the target "
                   f"{target.bos_token_id}")
    if _eos(gen) != target.eos_token_ids:
        out.append(f"eos_token_ids: the draft has {list(_eos(gen))}, the target "
                   f"{list(target.eos_token_ids)}")
    if m.limits.max_seq_len < target.max_seq_len:
        out.append(f"limits.max_seq_len: the draft has {m.limits.max_seq_len}, below the "
                   f"target's {target.max_seq_len}")
    if m.limits.max_batch_size < target.max_batch:
        out.append(f"limits.max_batch_size: the draft has {m.limits.max_batch_size}, below the "
                   f"{target.max_batch} sequences that speculate in one step")
    t = m.target
    if (t.device, t.arch, t.compute_capability) != (target.device, target.arch,
                                                     target.compute_capability):
        out.append(f"target: the draft is compiled for {t.device} {t.arch} "
                   f"{t.compute_capability or ''}".rstrip() + f", the target for "
                   f"{target.device} {target.arch} {target.compute_capability or ''}".rstrip())
    missing = sorted(set(t.cpu_features or ()) - set(target.cpu_features))
    if not t.is_gpu and missing:
        out.append(f"target.cpu_features: the draft (ISA {t.isa}) needs {', '.join(missing)}, "
                   "which the target's machines need not have")
    return out


def _tokenizer_diff(a: bytes, b: bytes) -> Optional[str]:
    """None when two tokenizer.json files are the same tokenizer; else what differs."""
    if a == b:
        return None
    try:
        ja, jb = json.loads(a), json.loads(b)
    except ValueError:
        return "tokenizer.json: the files differ and do not both parse as JSON"
    keys = sorted(k for k in set(ja) | set(jb) if ja.get(k) != jb.get(k))
    if not keys:
        return None
    detail = ""
    va = (ja.get("model") or {}).get("vocab")
    vb = (jb.get("model") or {}).get("vocab")
    if isinstance(va, dict) and isinstance(vb, dict) and va != vb:
        diff = sum(1 for k in set(va) | set(vb) if va.get(k) != vb.get(k))
        detail = (f" (vocabularies of {len(vb)} and {len(va)} tokens, {diff} entries "
                  "differ)")
    return f"tokenizer: the draft's tokenizer.json differs in {', '.join(keys)}{detail}"


def load_draft(target: Plan, max_batch: int, recorded_fingerprint: Optional[str],
               path: Path) -> Plan:
    """The draft plan at `path`, verified like any plan (load_plan), of the recorded
    fingerprint (None: not recorded, any), and able to draft for `target`; PlanError otherwise."""
    try:
        draft = load_plan(path)
    except PlanError as e:
        raise PlanError(f"the draft plan of {target.path} cannot be loaded: {e}") from None
    fix = rebuild_command(target.manifest.spec_path)
    if recorded_fingerprint is not None and draft.fingerprint != recorded_fingerprint:
        raise PlanError(f"the draft plan {path} ({draft.name}) has fingerprint "
                        f"{draft.fingerprint[:16]}; plan {target.path} was built against "
                        f"{recorded_fingerprint[:16]}. Rebuild the target against this draft: "
                        f"{fix}", "speculative.draft.fingerprint")
    problems = draft_mismatches(DraftTarget.from_plan(target, max_batch), draft)
    if problems:
        raise PlanError(f"the draft plan {path} cannot draft for {target.path}: "
                        + "; ".join(problems), "speculative.draft")
    return draft


def draft_path(target: Plan, override: Optional[str | Path] = None) -> Path:
    """Where the target's draft plan is: `override`, else the manifest's record (relative to
    the target plan's directory)."""
    if override is not None:
        return Path(override)
    section = target.manifest.speculative
    if section is None or section.draft is None:
        raise PlanError(f"plan {target.path} records no draft plan: pass one "
                        "(kiln serve --draft-plan DIR)")
    return target.path / section.draft.path


# ---- the proposer --------------------------------------------------------------------------

@dataclass
class _DraftSeq:
    """One target request's sequence in the draft's pool."""
    tokens: list[int] = field(default_factory=list)   # whose K/V is in the pool, in order
    block_table: list[int] = field(default_factory=list)


class DraftModel:
    """Proposes drafts with a draft plan, greedily, batched over a step's speculating
    sequences.

    `propose(seqs, ks)` is asked once per step that speculates (plugins.inflight_batching
    DraftPolicy), with each sequence's number of drafts (0: none this step); the draft plan
    runs only for those with drafts, and only what they need: the catch-up of their tokens it
    has not computed, then max(k) - 1 batched decodes. Nothing else runs on the draft plan:
    a step that does not speculate (a larger batch, a prompt in prefill) costs it nothing, and
    a sequence's draft KV is only caught up when it drafts. A sequence whose catch-up would
    cost more draft positions than drafting all of the rest of its output can (max_draft_tokens
    a token) does not draft: one that reaches a small batch near its end, its long history
    never seen by the draft, decodes one token a step instead."""

    def __init__(self, executor: Executor, max_draft_tokens: int, max_batch: int,
                 max_num_tokens: int, max_seq_len: int):
        self.executor = executor
        self.k, self.max_batch = max_draft_tokens, max_batch
        self.max_num_tokens, self.max_seq_len = max_num_tokens, max_seq_len
        self.pool = BlockPool(executor.layout.num_blocks, executor.layout.tokens_per_block,
                              prefix_caching=False)
        self._seqs: dict[str, _DraftSeq] = {}
        self.plan_path: Optional[Path] = None   # the draft plan's directory (from_plan)
        self.num_steps = 0          # draft steps run
        self.num_positions = 0      # tokens computed by the draft plan (catch-up and decodes)
        self.num_proposals = 0      # sequences drafted for (a draft step serves several)

    @classmethod
    def from_plan(cls, draft: Plan, max_draft_tokens: int, max_batch: int,
                  kv_budget_bytes: Optional[int] = None) -> "DraftModel":
        """A drafter running `draft` (a loaded plan; see for_target for the checks)."""
        lim = draft.limits
        model = cls(Executor.from_plan(draft, kv_budget_bytes), max_draft_tokens,
                    min(max_batch, lim.max_batch_size), lim.max_num_tokens, lim.max_seq_len)
        model.plan_path = draft.path
        return model

    @classmethod
    def for_target(cls, target: Plan, max_draft_tokens: int, max_batch: int,
                   path: Optional[str | Path] = None,
                   kv_budget_bytes: Optional[int] = None) -> "DraftModel":
        """The draft plan of `target` (at `path`, default the recorded one) loaded and checked
        (load_draft), its executor and KV pools allocated (kv_budget_bytes: default the draft
        plan's own kv_cache budget)."""
        section = target.manifest.speculative
        recorded = None if section is None or section.draft is None else section.draft
        draft = load_draft(target, max_batch, recorded and recorded.fingerprint,
                           draft_path(target, path))
        log.info("draft plan %s (%s) drafts up to %d tokens for %s", draft.path, draft.name,
                 max_draft_tokens, target.name)
        return cls.from_plan(draft, max_draft_tokens, max_batch, kv_budget_bytes)

    @staticmethod
    def attach(drafter: Optional["DraftModel"], speculative) -> Optional["DraftModel"]:
        """An engine's drafter (None: it has none); ValueError unless there is one exactly
        when speculative (a SpeculativeConfig) is method draft."""
        if (speculative is not None and speculative.method == "draft") != (drafter is not None):
            raise ValueError("speculative method 'draft' needs a draft model (drafter), and "
                             "only it does")
        return drafter

    @classmethod
    def for_engine(cls, target: Plan, speculative, path: Optional[str | Path] = None
                   ) -> Optional["DraftModel"]:
        """The drafter of an engine serving `target` with `speculative` (a SpeculativeConfig
        or None): for method draft the draft plan at `path` (default: the recorded one),
        else None; ValueError for a path given without method draft."""
        if speculative is not None and speculative.method == "draft":
            return cls.for_target(target, speculative.max_draft_tokens, speculative.max_batch,
                                  path)
        if path is not None:
            raise ValueError(f"a draft plan ({path}) drafts only with speculative method "
                             "'draft'; this engine's speculation is "
                             f"{speculative.method if speculative else 'off'}")
        return None

    @property
    def num_blocks_used(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    def release(self, request_id: str) -> None:
        """Free a finished (or cancelled) request's draft blocks."""
        st = self._seqs.pop(request_id, None)
        if st is not None:
            self.pool.free(st.block_table)

    def propose(self, seqs: Sequence[TokenSequence], ks: Sequence[int]) -> list[list[int]]:
        """Up to ks[i] drafts continuing seqs[i]'s tokens, drafted as one batch; [] for a
        sequence with ks[i] == 0, one whose catch-up costs too much (the class docstring),
        and one the draft's KV has no room for."""
        ready: list[tuple[TokenSequence, _DraftSeq]] = []
        want: list[int] = []
        rows: dict[str, int] = {}
        keep = {s.request_id for s, k in zip(seqs, ks) if k > 0}
        for seq, k in zip(seqs, ks):
            left = min(seq.num_prompt_tokens + seq.max_tokens, self.max_seq_len) - seq.num_tokens
            n = min(k, self.k, left)
            if n < 1 or len(ready) >= self.max_batch:
                continue
            st = self._seqs.setdefault(seq.request_id, _DraftSeq())
            self._sync(st, seq.token_ids)
            if seq.num_tokens - len(st.tokens) > self.k * left:
                continue           # its catch-up would cost more than its drafts can save
            if not self._room(st, seq.num_tokens + n - 1, keep):
                continue           # the draft's KV is full: no drafts for this one
            rows[seq.request_id] = len(ready)
            ready.append((seq, st))
            want.append(n)
        drafts = self._draft(ready, want) if ready else []
        return [drafts[rows[s.request_id]] if s.request_id in rows else [] for s in seqs]

    # ---- drafting ------------------------------------------------------------------------
    def _draft(self, ready: list[tuple[TokenSequence, _DraftSeq]], want: list[int]
               ) -> list[list[int]]:
        """Catch each sequence's draft KV up with its tokens, then greedy decodes: want[i]
        drafts for ready[i], max(want) - 1 decode steps in all."""
        self.num_proposals += len(ready)
        drafts = [[d] for d in self._catch_up(ready)]
        for j in range(1, max(want)):     # decode step j feeds each sequence's draft j
            rows = [i for i, n in enumerate(want) if n > j]
            batch = ModelInput.build([[drafts[i][-1]] for i in rows],
                                     [len(ready[i][1].tokens) for i in rows],
                                     [ready[i][1].block_table for i in rows],
                                     self.pool.tokens_per_block)
            for i, d in zip(rows, self._argmax(batch)):
                ready[i][1].tokens.append(drafts[i][-1])
                drafts[i].append(d)
        return drafts

    def _sync(self, st: _DraftSeq, tokens: list[int]) -> None:
        """Roll the draft's KV back to its longest prefix the target's tokens share (at most
        all but the last token: the last is fed again for the logits of the next)."""
        n = min(len(st.tokens), len(tokens) - 1)
        same = 0
        while same < n and st.tokens[same] == tokens[same]:
            same += 1
        del st.tokens[same:]
        self.pool.truncate(st.block_table, same)

    def _room(self, st: _DraftSeq, num_tokens: int, keep: set[str]) -> bool:
        """Grow st's blocks to hold num_tokens, evicting draft sequences outside `keep` (not
        drafting this step: they catch up again later) when the pool is short."""
        while not self.pool.can_append(st.block_table, num_tokens):
            idle = next((rid for rid in self._seqs if rid not in keep
                         and self._seqs[rid].block_table), None)
            if idle is None:
                return False
            other = self._seqs[idle]
            self.pool.free(other.block_table)
            other.block_table, other.tokens = [], []
        self.pool.may_append(st.block_table, num_tokens)
        return True

    def _catch_up(self, ready: list[tuple[TokenSequence, _DraftSeq]]) -> list[int]:
        """Feed each sequence's tokens the draft has not computed, packed into steps of at
        most max_num_tokens -> the first draft of each (the argmax after its last token)."""
        firsts: list[Optional[int]] = [None] * len(ready)
        todo = list(range(len(ready)))
        while todo:
            budget, rows, idx = self.max_num_tokens, [], []
            for i in todo:
                seq, st = ready[i]
                take = min(seq.num_tokens - len(st.tokens), budget)
                if take < 1:
                    break
                rows.append(seq.token_ids[len(st.tokens):len(st.tokens) + take])
                idx.append(i)
                budget -= take
            batch = ModelInput.build(rows, [len(ready[i][1].tokens) for i in idx],
                                     [ready[i][1].block_table for i in idx],
                                     self.pool.tokens_per_block)
            for i, row, d in zip(idx, rows, self._argmax(batch)):
                st = ready[i][1]
                st.tokens.extend(row)
                if len(st.tokens) == ready[i][0].num_tokens:
                    firsts[i] = d
            todo = [i for i in todo if firsts[i] is None]
        return firsts

    def _argmax(self, batch: ModelInput) -> list[int]:
        self.num_steps += 1
        self.num_positions += int(batch.input_ids.shape[0])
        logits = self.executor.execute(batch)
        return torch.argmax(logits, dim=-1).tolist()
