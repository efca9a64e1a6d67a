"""The model runner: one scheduled batch in, one sampled token per sequence out.

    SchedulerOutput --ModelInput.build--> ModelInput --Executor--> logits [B, vocab]
                    --Sampler (+ output constraints, logprobs)--> SampledOutput

It never decides policy: which sequences run and with how many tokens is the scheduler's,
what a sampled token means for its request (stop rules, streaming) is the engine's update.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kiln.plugins.inflight_batching import SchedulerOutput, TokenSequence, StepOutput
from kiln.runtime.executor import Executor, ModelInput
from kiln.runtime.guided import Masker
from kiln.runtime.lora import AdapterRegistry
from kiln.runtime.sampling import Sampler, TokenLogprobs
from kiln.runtime.speculative import num_kept

log = logging.getLogger("kiln.runtime")


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
        # called just before each compiled step, or where one would have launched (the
        # engine: release the outputs its thread holds, runtime/streams.hold_posts)
        self.before_launch: Optional[Callable[[], None]] = None
        self.tokens_per_block = executor.layout.tokens_per_block
        self.num_drafted = 0      # speculative decoding: draft tokens verified
        self.adapters: Optional[AdapterRegistry] = None   # a plan with lora: its adapters
        self.num_accepted = 0     # of those, kept
        self.num_draft_rows = 0   # sequence-steps that carried drafts (mean accepted length:
                                  # num_accepted / num_draft_rows)

    def prepare(self, out: SchedulerOutput) -> ModelInput:
        """Pack the scheduled tokens of each sequence (ModelInput.build: the one packer).
        A sequence with drafts brings [its last token, drafts...] and wants logits at each."""
        starts = [s.num_computed_tokens for s in out.seqs]
        tables = [s.block_table for s in out.seqs]
        if not out.drafts:
            return ModelInput.build(
                [s.token_ids[st:st + k] for s, st, k in zip(out.seqs, starts,
                                                             out.num_scheduled_tokens)],
                starts, tables, self.tokens_per_block)
        rows, wanted, end = [], [], 0
        for i, (s, st, k) in enumerate(zip(out.seqs, starts, out.num_scheduled_tokens)):
            d = out.drafts.get(i, ())
            rows.append(s.token_ids[st:st + k - len(d)] + list(d))
            end += k
            wanted.extend(range(end - len(d) - 1, end))
        return ModelInput.build(rows, starts, tables, self.tokens_per_block, wanted)

    def execute(self, out: SchedulerOutput) -> StepOutput:
        if out.is_empty:
            if self.before_launch is not None:
                self.before_launch()
            return SampledOutput([])
        batch = self.prepare(out)
        if self.before_launch is not None:
            self.before_launch()
        if self.adapters is None:
            logits = self.executor.execute(batch)                    # [B, vocab]
        else:       # each token's adapter slot
            logits = self.executor.execute(batch, self.adapters.token_slots(
                [s.adapter for s in out.seqs], out.num_scheduled_tokens))
        drafted = logits
        if out.drafts:   # one row per sequence: its first position (the last real token)
            firsts = self._first_rows(out)
            logits = drafted[firsts]
            seeded = _generator_states(out)
        rows = [i for i, s in enumerate(out.sample) if s]
        sampled: list[Optional[int]] = [None] * len(out.seqs)
        errors: dict[str, str] = {}
        if rows:
            seqs = [out.seqs[i] for i in rows]
            guided, skip = self._masks(seqs, logits.shape[1], errors)
            if skip:     # no token this step: a failed constraint, or a mask left for the next
                keep = [j for j in range(len(seqs)) if j not in skip]
                at = {j: k for k, j in enumerate(keep)}
                rows, seqs = [rows[j] for j in keep], [seqs[j] for j in keep]
                if guided is not None:
                    guided = ([at[j] for j in guided[0]], guided[1])
        if rows:
            rl = logits[rows] if len(rows) < len(out.seqs) else logits
            try:
                toks = self.sampler(rl, [s.sampling for s in seqs], [s.token_ids for s in seqs],
                                    [s.num_prompt_tokens for s in seqs], guided)
            except Exception:   # pin it on its request(s): sample row by row
                toks = self._sample_rows(rl, seqs, errors, guided)
            if guided is not None:
                self._advance(seqs, guided[0], toks, errors)
            for i, t in zip(rows, toks):
                sampled[i] = t
            accepted = self._verify(out, drafted, firsts, sampled) if out.drafts else {}
            if out.drafts:
                _rewind(out, seeded, sampled, accepted)
            asked = [j for j, s in enumerate(seqs)
                     if s.sampling.params.logprobs is not None and toks[j] is not None]
            if asked:   # only requests that ask pay for a log_softmax
                lps = self.sampler.logprobs(rl[asked], [toks[j] for j in asked],
                                            [seqs[j].sampling.params.logprobs for j in asked])
                return SampledOutput(sampled, {seqs[j].request_id: lp
                                               for j, lp in zip(asked, lps)}, errors,
                                     num_accepted=accepted)
            return SampledOutput(sampled, {}, errors, num_accepted=accepted)
        return SampledOutput(sampled, {}, errors)

    @staticmethod
    def _first_rows(out: SchedulerOutput) -> list[int]:
        """The logit row of each sequence's first wanted position (prepare's layout)."""
        firsts, r = [], 0
        for i in range(len(out.seqs)):
            firsts.append(r)
            r += 1 + len(out.drafts.get(i, ()))
        return firsts

    def _verify(self, out: SchedulerOutput, logits: torch.Tensor, firsts: list[int],
                sampled: list[Optional[int]]) -> dict[int, int]:
        """Exact verification (runtime/speculative.py): the target's token at each draft
        position, sampled as a plain step would (same sampler, the history as if the drafts
        before were kept); drafts are kept while each equals the target's token at its
        position, and the target's token after the last kept one becomes the sequence's
        token. -> accepted per row."""
        rows, states, hists, prompts, owners = [], [], [], [], []
        for i, d in out.drafts.items():
            s = out.seqs[i]
            if sampled[i] is None:
                continue
            for j in range(1, len(d) + 1):   # row first+j scores the token after d[j-1]
                rows.append(firsts[i] + j)
                states.append(s.sampling)
                hists.append(s.token_ids + d[:j])
                prompts.append(s.num_prompt_tokens)
            owners.append(i)
        accepted: dict[int, int] = {}
        try:
            toks = self.sampler(logits[rows], states, hists, prompts) if rows else []
        except Exception:   # verification is an optimization: keep the plain token
            log.exception("draft verification failed; the step keeps one token per sequence")
            return {i: 0 for i in owners}
        at = 0
        for i in owners:
            d = out.drafts[i]
            target = [sampled[i]] + toks[at:at + len(d)]
            at += len(d)
            a = num_kept(d, target)
            sampled[i], accepted[i] = target[a], a
            self.num_drafted += len(d)
            self.num_accepted += a
            self.num_draft_rows += 1
        return accepted

    def _masks(self, seqs: list[TokenSequence], vocab: int, errors: dict[str, str]
               ) -> tuple[Optional[tuple[list[int], torch.Tensor]], set[int]]:
        """-> ((rows, bitmask) of the constrained requests among seqs that sample this step,
        or None; the rows that get no token this step). A row whose mask the step's budget left
        out waits (the scheduler computes its last token again); a constraint that failed
        (a limit hit, no token allowed) goes into errors. Unconstrained requests pay nothing."""
        rows = [j for j, s in enumerate(seqs) if s.sampling.guide is not None]
        if not rows:
            return None, set()
        if self.masker is None:
            self.masker = Masker(vocab, len(seqs))
        guides = [seqs[j].sampling.guide for j in rows]
        bitmask, filled = self.masker.fill_step(guides, vocab)
        live = [k for k in filled if guides[k].error is None]
        for k in set(filled).difference(live):
            errors[seqs[rows[k]].request_id] = guides[k].error
        skip = set(rows).difference(rows[k] for k in live)
        if not live:
            return None, skip
        return ([rows[k] for k in live], bitmask[live] if len(live) < len(rows) else bitmask), \
            skip

    @staticmethod
    def _advance(seqs: list[TokenSequence], rows: list[int], toks: list[Optional[int]],
                 errors: dict[str, str]) -> None:
        """Feed each constrained request its sampled token (a stop token ends it instead)."""
        for j in rows:
            s, t = seqs[j], toks[j]
            if t is None or t in s.stop_token_ids:
                continue
            guide = s.sampling.guide
            guide.advance(t)
            if guide.error is not None:
                errors[s.request_id] = guide.error

    def _sample_rows(self, logits: torch.Tensor, seqs: list[TokenSequence],
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
                toks.append(self.sampler(logits[j:j + 1], [s.sampling], [s.token_ids],
                                         [s.num_prompt_tokens], g)[0])
            except Exception as e:
                log.exception("sampling failed for request %s", s.request_id)
                errors[s.request_id] = f"sampling failed: {type(e).__name__}: {e}"
                toks.append(None)
        return toks


def _generator_states(out: SchedulerOutput) -> dict[int, torch.Tensor]:
    """The generator state of each seeded sequence that drafts this step, before it draws."""
    gens = {i: out.seqs[i].sampling.generator for i in out.drafts}
    return {i: g.get_state() for i, g in gens.items() if g is not None}


def _rewind(out: SchedulerOutput, seeded: dict[int, torch.Tensor],
            sampled: list[Optional[int]], accepted: dict[int, int]) -> None:
    """Leave each seeded drafting sequence's generator one draw past each token it emitted
    this step (the draws of rejected positions are given back): its next token then takes
    the same uniform number it would have taken without drafts, so a seeded request's
    tokens do not depend on what was drafted."""
    for i, state in seeded.items():
        g = out.seqs[i].sampling.generator
        g.set_state(state)
        if sampled[i] is not None:
            torch.rand(accepted.get(i, 0) + 1, generator=g)
