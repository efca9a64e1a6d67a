"""Speculative decoding's pure parts: the spec section, the manifest section, the n-gram
proposer and the scheduler's draft bookkeeping (acceptance, rollback, stop rules)."""
from __future__ import annotations

import copy
from collections import Counter

import pytest

from kiln.builder.spec import parse_spec
from kiln.contracts.manifest import ManifestError, PlanManifest
from kiln.plugins.inflight_batching import (DraftPolicy, Scheduler, SchedulerConfig,
                                            StepOutput, TokenSequence)
import torch

from kiln.runtime.sampling import Sampler, SamplingParams, SamplingState
from kiln.runtime.speculative import DraftRecord, NgramIndex, SpeculativeConfig, num_kept
from tests.helpers import TINY_SPEC as BASE, chi2_pvalue, spec_problems
from tests.unit.test_manifest import MANIFEST

pytestmark = pytest.mark.unit

SECTION = {"method": "ngram", "max_draft_tokens": 3, "ngram_min": 1, "ngram_max": 4,
           "max_batch": 4}


def test_spec_section_defaults_and_recorded_only_when_set():
    plain = parse_spec(BASE)
    assert plain.speculative is None and "speculative" not in plain.canonical()
    spec = parse_spec(BASE + "speculative: {method: ngram, max_draft_tokens: 3}\n")
    assert spec.canonical()["speculative"] == SECTION
    assert spec.digest() != plain.digest()


@pytest.mark.parametrize("text, words", [
    ("speculative: {method: draft}\n", "draft_plan is required with method draft"),
    ("speculative: {method: ngram, draft_plan: x}\n", "draft_plan is required with method draft"),
    ("speculative: {method: eagle}\n", "'ngram' or 'draft'"),
    ("speculative: {method: ngram, ngram_min: 3, ngram_max: 2}\n",
     "ngram_min (3) must be at most ngram_max (2)"),
    ("speculative: {method: ngram, max_draft_tokens: 0}\n", "greater than or equal to 1"),
    ("limits: {max_batch_size: 8, max_num_tokens: 16}\n"
     "speculative: {method: ngram, max_draft_tokens: 4}\n",
     "4 speculating sequences (min of speculative.max_batch, limits.max_batch_size) x "
     "(max_draft_tokens 4 + 1) = 20 tokens exceed limits.max_num_tokens (16)"),
])
def test_inconsistent_spec_refused(text, words):
    _, msg = spec_problems(BASE + text)
    assert words in msg and "speculative" in msg


def test_manifest_section_round_trip_and_absent_by_default():
    plain = PlanManifest.from_json(copy.deepcopy(MANIFEST))
    assert plain.speculative is None and "speculative" not in plain.to_json()
    m = PlanManifest.from_json({**copy.deepcopy(MANIFEST), "speculative": dict(SECTION)})
    assert m.speculative.max_draft_tokens == 3 and m.to_json()["speculative"] == SECTION
    with pytest.raises(ManifestError, match="speculative"):
        PlanManifest.from_json({**copy.deepcopy(MANIFEST),
                                "speculative": {**SECTION, "ngram_min": 5}})


def test_ngram_proposals():
    assert NgramIndex(1, 4).propose([1, 2, 3, 4, 9, 8, 1, 2, 3], 3) == [4, 9, 8]
    assert NgramIndex(1, 4).propose([5, 6, 7], 3) == []            # nothing occurred before
    assert NgramIndex(1, 4).propose([1, 2, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]   # a period
    ix = NgramIndex(2, 3)            # 1-grams are not looked up: "3" alone proposes nothing
    assert ix.propose([3, 7, 1, 3], 2) == []
    assert ix.propose([3, 7, 1, 3, 7], 2) == [1, 3]    # the index grows with the sequence
    assert NgramIndex(1, 1).propose([4, 1, 5, 1, 6, 1], 1) == [6]   # the latest occurrence
    # a suffix of n tokens proposes at most 2n: "7" alone matched, two of the four asked
    assert NgramIndex(1, 4).propose([7, 1, 2, 3, 4, 5, 6, 7], 4) == [1, 2]
    assert NgramIndex(1, 4).propose([7, 8, 1, 2, 3, 4, 7, 8], 4) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculativeConfig(ngram_min=3, ngram_max=2)


def _drafting(drafts, max_tokens=10, stop=()):
    """A scheduler whose one sequence (prompt of 6 tokens) is decoding, with `drafts`
    scheduled behind its last token -> (scheduler, seq, scheduler output)."""
    cfg = SchedulerConfig(max_batch_size=4, max_num_tokens=64, max_seq_len=64,
                          tokens_per_block=4)
    sched = Scheduler(cfg, 32, DraftPolicy(4, lambda seqs, ks: [list(drafts)[:k] for k in ks]))
    seq = TokenSequence("r", [1, 2, 3, 4, 5, 6], max_tokens, stop_token_ids=stop)
    sched.add(seq)
    sched.update(sched.schedule(), StepOutput([9]))          # prefill -> output [9]
    out = sched.schedule()
    return sched, seq, out


def test_scheduler_keeps_accepted_drafts_and_rolls_back_the_rest():
    sched, seq, out = _drafting([7, 8, 9, 10, 11, 12])
    assert out.drafts == {0: [7, 8, 9, 10, 11, 12]} and out.num_scheduled_tokens == [7]
    assert len(seq.block_table) == sched.pool.blocks_for(13)
    sched.update(out, StepOutput([20], num_accepted={0: 2}))
    assert seq.output_token_ids == [9, 7, 8, 20]
    assert seq.num_computed_tokens == 9 and len(seq.block_table) == sched.pool.blocks_for(10)
    assert sched.num_generated_tokens == 4


@pytest.mark.parametrize("max_tokens, stop, want, reason", [
    (3, (), [9, 7, 8], "length"),          # max_tokens inside the accepted drafts
    (10, (8,), [9, 7, 8], "stop"),         # a stop token inside them
])
def test_scheduler_stop_rules_inside_accepted_drafts(max_tokens, stop, want, reason):
    sched, seq, out = _drafting([7, 8, 9], max_tokens, stop)
    assert out.drafts == {0: [7, 8, 9][:max_tokens - 1]}   # never drafts past max_tokens
    sched.update(out, StepOutput([5], num_accepted={0: len(out.drafts[0])}))
    assert seq.output_token_ids == want and seq.status.value == reason
    assert sched.num_generated_tokens == len(want) and sched.pool.stats().used_blocks == 0


def test_scheduler_row_without_a_token_keeps_nothing():
    sched, seq, out = _drafting([7, 8, 9])
    sched.update(out, StepOutput([None]))      # its sampling failed: no token this step
    assert seq.output_token_ids == [9] and seq.num_computed_tokens == 6
    assert len(seq.block_table) == sched.pool.blocks_for(7)
    out = sched.schedule()                      # its last token runs again, drafts and all
    assert out.num_scheduled_tokens == [4] and out.drafts == {0: [7, 8, 9]}


@pytest.mark.parametrize("drafts", [[2, 0], [3, 3]])   # likely drafts; an unlikely first one
def test_sampled_verification_is_rejection_sampling(drafts):
    """Draws of the target at each position, drafts kept while they equal the draw: the
    emitted tokens follow the analytic law of rejection sampling with a point-mass proposal
    (accept d with p(d); else p without d, renormalized; all kept: a bonus from p)."""
    p = torch.tensor([[0.1, 0.2, 0.6, 0.1], [0.5, 0.3, 0.1, 0.1], [0.25, 0.25, 0.4, 0.1]])
    m, n = len(drafts), 20000
    law = {}                                  # emitted tokens -> probability
    for a in range(m + 1):
        kept = float(torch.prod(torch.tensor([p[j, drafts[j]] for j in range(a)])))
        for x in range(4):
            if a == m or x != drafts[a]:
                law[tuple(drafts[:a]) + (x,)] = kept * float(p[a, x])
    assert abs(sum(law.values()) - 1) < 1e-6
    torch.manual_seed(1)
    state = SamplingState.create(SamplingParams(temperature=1.0))
    rows = p.log().repeat(n, 1)                                      # [n * (m+1), 4]
    toks = Sampler()(rows, [state] * len(rows), [[0]] * len(rows), [1] * len(rows))
    emitted = []
    for r in range(0, len(toks), m + 1):
        t = toks[r:r + m + 1]
        a = num_kept(drafts, t)
        emitted.append(tuple(drafts[:a]) + (t[a],))
    assert chi2_pvalue(Counter(emitted), law, n) > 1e-3
    assert num_kept([5, 6, 7], [5, 6, 8, 1]) == 2 and num_kept([5], [4, 5]) == 0


def test_draft_record_backs_off_on_rejection_and_grows_back_on_acceptance():
    r = DraftRecord(4)
    assert r.limit() == 4
    r.record(4, 0)
    assert r.limit() == 2                     # none kept: halved
    r.record(2, 1)
    assert r.limit() == 2                     # some kept: unchanged
    r.record(2, 0)
    r.record(1, 0)                            # k reaches 0: four steps without drafts
    assert [r.limit() for _ in range(5)] == [0, 0, 0, 0, 1]
    r.record(1, 0)                            # again: the cooling doubles
    assert [r.limit() for _ in range(9)] == [0] * 8 + [1]
    r.record(1, 1)                            # all kept: doubled, cooling back to 4
    assert r.limit() == 2 and r.cooling == 4
    r.record(2, 2)
    r.record(4, 4)
    assert r.limit() == 4                     # never past the ceiling
    assert (r.drafted, r.accepted) == (4 + 2 + 2 + 1 + 1 + 1 + 2 + 4, 1 + 1 + 2 + 4)
    assert DraftRecord(4, cooling=4).limit() == 4


def test_ngram_draft_record_does_not_back_off():
    """n-gram drafts (adapt=False): the allowance stays at max_k whatever was rejected; the
    totals are still counted."""
    r = DraftRecord(4, adapt=False)
    for _ in range(6):
        r.record(r.limit(), 0)
    assert r.limit() == 4 and (r.drafted, r.accepted) == (24, 0)


def test_draft_record_bounds_the_cost_of_text_that_never_repeats():
    r = DraftRecord(8)
    for _ in range(1000):                     # every draft rejected
        k = r.limit()
        if k:
            r.record(k, 0)
    assert r.drafted < 8 + 4 + 2 + 1 + 1000 // 64 + 6     # ~ one draft per 64 steps
