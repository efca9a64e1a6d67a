"""Draft-model speculative decoding on the tiny random model, run eagerly: a perturbed copy
of the target drafts. Greedy output identical to plain decoding, drafts accepted, the draft's
KV rolled back to what the target kept, its blocks freed when requests end or are cancelled,
and a full draft KV proposes nothing instead of failing the request. (The built plans, the
build's checks and the load's refusals: test_draft_plans.py.)"""
from __future__ import annotations

import copy
import random

import pytest
import torch

from kiln.runtime.draft_model import DraftModel
from kiln.runtime.executor import Executor, KVLayout
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.speculative import SpeculativeConfig
from runtime_helpers import tiny_engine, tiny_model

pytestmark = pytest.mark.model

SPEC = SpeculativeConfig(method="draft", max_draft_tokens=4, max_batch=8)
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _drafter(num_blocks: int = 256, noise: float = 0.02, k: int = 4) -> DraftModel:
    """The target's weights plus noise: it agrees with the target often, not always."""
    model = copy.deepcopy(tiny_model())
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
    cfg = model.cfg
    layout = KVLayout(cfg.num_layers, num_blocks, 4, cfg.num_kv_heads, cfg.head_dim, "fp32")
    return DraftModel(Executor(model, layout), k, max_batch=8, max_num_tokens=32,
                      max_seq_len=256)


def _prompts(n: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(3, 50))] for _ in range(n)]


def _engine(drafter=None, **kw):
    return tiny_engine(speculative=SPEC if drafter else None, drafter=drafter, **kw)


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_output_identical_with_drafts_accepted(batch):
    prompts = _prompts(8)
    with _engine(max_batch_size=batch) as plain:
        want = plain.generate(prompts, GREEDY)
    drafter = _drafter()
    with _engine(drafter, max_batch_size=batch) as spec:
        got = spec.generate(prompts, GREEDY)
        stats = spec.stats()
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert stats["kv_blocks_used"] == 0 and drafter.num_blocks_used == 0
    # k = 4 draft steps a proposal alone; batched, a step serves several sequences
    assert drafter.num_steps <= 4 * drafter.num_proposals / (2 if batch > 1 else 1)


def test_draft_kv_follows_the_kept_tokens():
    drafter = _drafter()
    engine = _engine(drafter, start=False)
    for p in _prompts(4, seed=9):
        engine.submit(p, GREEDY)
    engine.run_pending()
    pool, checked = drafter.pool, 0
    while engine.scheduler.has_work():
        engine.step()
        for seq in engine.scheduler.running:
            st = drafter._seqs.get(seq.request_id)
            if st is None or st.made_for < 0:
                continue
            # its tokens are the target's up to where it drafted, then its unverified drafts
            assert st.tokens[:st.made_for] == seq.token_ids[:st.made_for]
            assert len(st.block_table) == pool.blocks_for(len(st.tokens))
            checked += 1
        for rid in drafter._seqs:     # finished requests left the draft at once
            assert rid in engine.scheduler.by_id
    assert checked and engine.stats()["spec_accepted_tokens"] > 0
    assert drafter.num_blocks_used == 0 and not drafter._seqs


def test_cancel_frees_draft_blocks():
    drafter = _drafter()
    engine = _engine(drafter, start=False)
    streams = [engine.submit(p, SamplingParams(max_tokens=100, temperature=0,
                                               ignore_eos=True)) for p in _prompts(3)]
    engine.run_pending()
    for _ in range(6):
        engine.step()
    assert drafter.num_blocks_used > 0 and engine.stats()["spec_draft_tokens"] > 0
    for s in streams:
        s.cancel()
    engine.run_pending()
    assert drafter.num_blocks_used == 0 and engine.stats()["kv_blocks_used"] == 0
    assert all(s.result().finish_reason == "cancelled" for s in streams)


def test_full_draft_kv_proposes_nothing():
    """A draft pool of 6 blocks of 4 tokens: the long prompt never fits it and decodes one
    token a step; the short one drafts; both outputs are the plain ones."""
    prompts = [list(range(40, 70)), [7, 8, 9]]
    with _engine() as plain:
        want = plain.generate(prompts, GREEDY)
    drafter = _drafter(num_blocks=6)
    with _engine(drafter) as spec:
        got = spec.generate(prompts, GREEDY)
        stats = spec.stats()
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert all(r.finish_reason == "length" for r in got)
    assert stats["spec_draft_tokens"] > 0 and drafter.num_blocks_used == 0


def test_sampled_requests_keep_their_tokens():
    """Sampled requests draft too (a point-mass proposal); a seeded one gets the tokens it
    gets without speculation."""
    params = SamplingParams(max_tokens=24, temperature=0.7, seed=11, ignore_eos=True)
    prompts = _prompts(3, seed=2)
    with _engine() as plain:
        want = plain.generate(prompts, params)
    drafter = _drafter()
    with _engine(drafter) as spec:
        got = spec.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert drafter.num_blocks_used == 0


def test_draft_method_needs_a_draft_model():
    with pytest.raises(ValueError, match="needs a draft model"):
        tiny_engine(start=False, speculative=SPEC)
