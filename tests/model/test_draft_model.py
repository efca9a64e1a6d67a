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
            if st is None or not st.tokens:
                continue
            # its tokens are the target's, then at most k - 1 drafts the target did not keep
            same = next((i for i, (a, b) in enumerate(zip(st.tokens, seq.token_ids))
                         if a != b), min(len(st.tokens), seq.num_tokens))
            assert len(st.tokens) - same <= SPEC.max_draft_tokens - 1
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


def _stepped(engine, prompts, params) -> int:
    """Submit prompts together, step the engine until done -> its number of steps."""
    for p in prompts:
        engine.submit(p, params)
    engine.run_pending()
    steps = 0
    while engine.scheduler.has_work():
        engine.step()
        steps += 1
    return steps


def test_a_batch_above_max_batch_costs_the_draft_nothing():
    """12 decoding sequences (max_batch 8), prefilled in one step and finishing together:
    no step speculates, the draft plan runs no step, and the target runs the plain steps."""
    prompts, params = _prompts(12), SamplingParams(max_tokens=12, temperature=0,
                                                   ignore_eos=True)
    plain = _engine(start=False, max_num_tokens=1024)
    want = _stepped(plain, prompts, params)
    drafter = _drafter()
    spec = _engine(drafter, start=False, max_num_tokens=1024)
    assert _stepped(spec, prompts, params) == want == 12
    assert drafter.num_steps == drafter.num_positions == 0
    assert spec.stats()["spec_draft_tokens"] == 0 and not drafter._seqs


def test_steps_with_prefill_work_do_not_speculate():
    """A decoding request speculates until a long prompt arrives; while that prompt is
    prefilled in chunks (max_num_tokens 16), no step drafts and the draft plan is idle;
    afterwards they speculate again."""
    drafter = _drafter()
    engine = _engine(drafter, start=False, max_num_tokens=16)
    long_params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.submit([5, 6, 7, 8], long_params)
    engine.run_pending()
    for _ in range(4):
        engine.step()
    assert drafter.num_steps > 0
    engine.submit(list(range(100, 160)), long_params)     # 60 tokens: 4 chunks
    engine.run_pending()
    before = drafter.num_steps, engine.stats()["spec_draft_tokens"]
    new = engine.scheduler.waiting[0]
    while new.num_computed_tokens < new.num_prompt_tokens - 1:
        engine.step()
        assert (drafter.num_steps, engine.stats()["spec_draft_tokens"]) == before
    while engine.scheduler.has_work():
        engine.step()
    assert drafter.num_proposals > 0 and engine.stats()["spec_draft_tokens"] > before[1]


def test_a_long_history_near_its_end_is_not_caught_up():
    """A sequence the draft never saw, 50 tokens long with 2 left: catching it up would cost
    more draft positions than its drafts can save, so it gets none and the draft plan runs
    nothing; the same history with 40 tokens left is caught up and drafted for."""
    from kiln.plugins.inflight_batching import TokenSequence
    prompt = _prompts(1, seed=3)[0][:20] * 3
    drafter = _drafter()
    near_end = TokenSequence("a", prompt[:50], max_tokens=2)
    assert drafter.propose([near_end], [2]) == [[]]
    assert drafter.num_steps == drafter.num_positions == 0
    fresh = TokenSequence("b", prompt[:50], max_tokens=40)
    (drafts,) = drafter.propose([fresh], [4])
    assert len(drafts) == 4 and drafter.num_positions == 50 + 3
