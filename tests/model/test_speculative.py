"""N-gram speculative decoding on the tiny random model: greedy output identical to plain
decoding token for token, drafts accepted, KV rolled back and returned, stop rules applied to
every emitted token in order."""
from __future__ import annotations

import random
import re
from collections import Counter

import pytest
import torch

from kiln.runtime.sampling import SamplingParams
from kiln.runtime.speculative import SpeculativeConfig
from runtime_helpers import tiny_engine
from tests.helpers import chi2_pvalue

pytestmark = pytest.mark.model

REPETITIVE = ["abcabcabcabcabcabc", "the cat sat on the mat. the cat sat on the",
              "1 2 3 4 1 2 3 4 1 2 3 4 1 2"]
SPEC = SpeculativeConfig(max_draft_tokens=4, max_batch=16)


def _looping_prompt(text: str = REPETITIVE[0], n: int = 60) -> list[int]:
    """text + the model's own greedy continuation: the random model settles into a loop
    of its own, so its next tokens repeat the prompt's tail and drafts are kept at once."""
    res, _ = _run([text], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return list(text.encode()) + res[0].token_ids


def _random_prompts(n: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def _run(prompts, params, speculative=None, **config):
    """-> (results, engine stats) of prompts run to completion on a fresh engine."""
    with tiny_engine(speculative=speculative, **config) as engine:
        results = engine.generate(prompts, params)
        return results, engine.stats()


def _steps(prompt, params, speculative):
    """Run one request step by step -> (its outputs, one per step; the engine)."""
    engine = tiny_engine(start=False, speculative=speculative)
    engine.submit(prompt, params)
    engine.run_pending()
    outs = []
    while engine.scheduler.has_work():
        outs += engine.step()
    return outs, engine


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_identical_with_drafts_accepted(batch):
    prompts = REPETITIVE + _random_prompts(5)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    want, plain = _run(prompts, params, max_batch_size=batch)
    got, spec = _run(prompts, params, SPEC, max_batch_size=batch)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.text for r in got] == [r.text for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert plain["spec_draft_tokens"] == 0
    assert spec["spec_accepted_tokens"] > 0          # drafts were kept: the test means something
    assert spec["spec_draft_tokens"] > spec["spec_accepted_tokens"]   # and some were rejected
    assert spec["tokens_generated"] == plain["tokens_generated"]
    assert spec["kv_blocks_used"] == 0


def test_prometheus_counters():
    from prometheus_client import generate_latest

    from kiln.runtime.server.metrics import Metrics

    with tiny_engine(speculative=SPEC) as engine:
        engine.generate(REPETITIVE, SamplingParams(max_tokens=48, temperature=0,
                                                   ignore_eos=True))
        text = generate_latest(Metrics(lambda: engine).registry).decode()
        stats = engine.stats()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("kiln_spec_")}
    assert values == {"kiln_spec_draft_tokens_total": stats["spec_draft_tokens"],
                      "kiln_spec_accepted_tokens_total": stats["spec_accepted_tokens"],
                      "kiln_spec_draft_rows_total": stats["spec_draft_rows"],
                      "kiln_spec_draft_model_steps_total": 0,        # n-gram: no draft plan
                      "kiln_spec_draft_model_positions_total": 0}
    assert 0 < values["kiln_spec_accepted_tokens_total"] < values["kiln_spec_draft_tokens_total"]
    # each row carried 1..k drafts: the mean accepted length is at most k
    rows = values["kiln_spec_draft_rows_total"]
    assert 0 < rows <= values["kiln_spec_draft_tokens_total"] <= SPEC.max_draft_tokens * rows


def test_random_prompts_identical():
    prompts = _random_prompts(8, seed=11)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    want, _ = _run(prompts, params)
    got, _ = _run(prompts, params, SPEC)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


@pytest.mark.parametrize("batch", [1, 4])
def test_seeded_sampled_requests_identical_with_drafts_accepted(batch):
    """A seeded request's generator gives back the draws of rejected positions: the same
    tokens with and without speculation, whatever else shares the step."""
    prompts = [_looping_prompt(t) for t in REPETITIVE]
    params = [SamplingParams(max_tokens=40, temperature=0.7, top_k=5, top_p=0.9,
                             repetition_penalty=1.05, seed=s, ignore_eos=True)
              for s in range(len(prompts))]
    want, _ = _run(prompts, params, max_batch_size=batch)
    got, stats = _run(prompts, params, SPEC, max_batch_size=batch)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert stats["kv_blocks_used"] == 0


def test_large_batch_does_not_speculate():
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    _, stats = _run(REPETITIVE * 2, params, SpeculativeConfig(max_batch=2))
    # six decoding sequences > max_batch 2: no drafts until only two are left
    _, alone = _run(REPETITIVE[:2], params, SpeculativeConfig(max_batch=2))
    assert stats["spec_draft_tokens"] < 2 * alone["spec_draft_tokens"]


def test_rejected_positions_rolled_back_and_blocks_returned():
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    engine = tiny_engine(start=False, speculative=SPEC)
    for p in REPETITIVE:
        engine.submit(p, params)
    engine.run_pending()
    pool = engine.scheduler.pool
    while engine.scheduler.has_work():
        engine.step()
        for seq in engine.scheduler.running:   # no block past what the kept tokens need
            if seq.num_output_tokens:          # (prefill chunks aside)
                assert len(seq.block_table) <= pool.blocks_for(seq.num_tokens)
                assert seq.num_computed_tokens == seq.num_tokens - 1
    assert engine.stats()["spec_accepted_tokens"] > 0
    assert engine.stats()["kv_blocks_used"] == 0


def test_cancel_mid_generation_returns_blocks():
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    engine = tiny_engine(start=False, speculative=SPEC)
    streams = [engine.submit(p, params) for p in REPETITIVE + [_looping_prompt()]]
    engine.run_pending()
    for _ in range(6):
        engine.step()
    assert engine.stats()["spec_accepted_tokens"] > 0 and engine.stats()["kv_blocks_used"] > 0
    for s in streams:
        s.cancel()
    engine.run_pending()
    assert engine.stats()["kv_blocks_used"] == 0
    assert all(s.result().finish_reason == "cancelled" for s in streams)


def _inside_a_group(outs) -> list[int]:
    """Output positions p (0-based) emitted by a step that emitted tokens after p too."""
    inside, at = [], 0
    for o in outs:
        inside += range(at, at + len(o.token_ids) - 1)
        at += len(o.token_ids)
    return inside


def test_max_tokens_and_stop_token_inside_an_accepted_draft():
    prompt = _looping_prompt("hello world. hello")   # its loop has several distinct tokens
    big = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    outs, _ = _steps(prompt, big, SPEC)
    ref = [t for o in outs for t in o.token_ids]
    inside = _inside_a_group(outs)
    assert inside, "no step emitted several tokens"
    m = inside[len(inside) // 2] + 1          # max_tokens ends inside a multi-token step
    capped, _ = _run([prompt], SamplingParams(max_tokens=m, temperature=0, ignore_eos=True),
                     SPEC)
    assert capped[0].token_ids == ref[:m] and capped[0].finish_reason == "length"
    firsts = [p for p in inside if ref[p] not in ref[:p]]
    assert firsts, "no token first seen inside a multi-token step"
    p = firsts[0]
    params = SamplingParams(max_tokens=64, temperature=0, stop_token_ids=(ref[p],))
    want, _ = _run([prompt], params)
    got, stats = _run([prompt], params, SPEC)
    assert got[0].token_ids == want[0].token_ids == ref[:p + 1]
    assert got[0].finish_reason == want[0].finish_reason == "stop"
    assert got[0].usage.completion_tokens == p + 1
    assert stats["kv_blocks_used"] == 0


def test_stop_strings_inside_an_accepted_draft():
    prompt = _looping_prompt("hello world. hello")
    outs, _ = _steps(prompt, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
                     SPEC)
    text = "".join(o.text for o in outs)
    stops = {text[i:i + 2] for i in range(0, min(len(text) - 2, 40), 3)} - {""}
    for stop in sorted(stops):
        params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, stop=(stop,))
        want, _ = _run([prompt], params)
        got, _ = _run([prompt], params, SPEC)
        assert (got[0].token_ids, got[0].text, got[0].finish_reason, got[0].stop_reason,
                got[0].usage.completion_tokens) == \
            (want[0].token_ids, want[0].text, want[0].finish_reason, want[0].stop_reason,
             want[0].usage.completion_tokens), stop


@pytest.fixture(scope="module")
def ngram_plan(tiny_spec_path, tmp_path_factory):
    """The tiny random plan with `speculative: ngram` (AOTInductor), built once per
    fingerprint."""
    from tests.conftest import TEST_PLANS
    from kiln.builder.build import build
    from kiln.builder.progress import Progress

    spec = tmp_path_factory.mktemp("spec") / "tiny-random-ngram.yaml"
    spec.write_text(tiny_spec_path.read_text().replace("name: tiny-random", "name: tiny-ngram")
                    + "speculative: {method: ngram, max_draft_tokens: 4}\n")
    return build(spec, TEST_PLANS / "tiny-random-ngram", progress=Progress(enabled=False)).path


def test_compiled_plan_speculates_with_identical_output(ngram_plan):
    """The compiled step takes the drafted rows as built (nothing new in the plan): the
    plan's section turns speculation on, `speculative=False` off, same tokens either way."""
    from kiln.runtime.engine import Engine
    from kiln.runtime.plan import read_manifest
    from kiln.runtime.tools.inspect import describe

    m = read_manifest(ngram_plan)
    assert m.speculative.max_draft_tokens == 4
    assert re.search(r"^speculative +method=ngram, max_draft_tokens=4, ngram_min=1, "
                     r"ngram_max=4, max_batch=4$", describe(m, ngram_plan), re.M)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [[5, 9, 13] * 6, [100 + i % 7 for i in range(30)], [3, 1, 4, 1, 5, 9, 2, 6]]
    with Engine.from_plan(ngram_plan, speculative="off") as plain:
        first = plain.generate(prompts, params)
        prompts = [p + r.token_ids for p, r in zip(prompts, first)]   # the model's own loops
        want = plain.generate(prompts, params)
        assert plain.stats()["spec_draft_tokens"] == 0
    with Engine.from_plan(ngram_plan) as spec:
        got = spec.generate(prompts, params)
        stats = spec.stats()
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert stats["spec_accepted_tokens"] > 0 and stats["kv_blocks_used"] == 0


def test_serve_speculative_choice(ngram_plan):
    """`kiln serve --speculative plan|off` (ServeConfig.speculative): the plan's section or
    none; anything else is refused before the plan loads, naming the choices."""
    from kiln.runtime.engine import Engine
    from kiln.runtime.server.app import ServeConfig, ServeError, _load, check_config

    with pytest.raises(ServeError, match="--speculative on: the choices are plan, off"):
        check_config(ServeConfig(plan=ngram_plan, speculative="on"))
    for choice, max_k in (("plan", 4), ("off", None)):
        engine, _ = _load(ServeConfig(plan=ngram_plan, speculative=choice))
        with engine:
            spec = engine.speculative
            assert (spec and spec.max_draft_tokens) == max_k, choice
    with pytest.raises(ValueError, match="speculative='on': the choices are plan, off"):
        Engine.from_plan(ngram_plan, speculative="on")


def _target_joint(prompt: list[int], params: SamplingParams, n: int) -> dict:
    """P(first n output tokens), exactly as the plain sampler draws them, from the plan's
    own logits: the executor runs prompt + each prefix; Sampler.probs gives each step's
    distribution."""
    from kiln.runtime.executor import ModelInput
    from kiln.runtime.sampling import Sampler, SamplingState

    engine = tiny_engine(start=False)
    bs, state = engine.config.tokens_per_block, SamplingState.create(params)
    joint = {(): 1.0}
    for _ in range(n):
        prefixes = list(joint)
        seqs = [prompt + list(p) for p in prefixes]
        width = engine.scheduler.pool.blocks_for(len(seqs[0]))
        tables = [list(range(i * width, (i + 1) * width)) for i in range(len(seqs))]
        logits = engine.executor.execute(ModelInput.build(seqs, [0] * len(seqs), tables, bs))
        probs = Sampler().probs(logits, [state] * len(seqs), seqs, [len(prompt)] * len(seqs))
        joint = {p + (t,): joint[p] * float(probs[i, t]) for i, p in enumerate(prefixes)
                 for t in probs[i].nonzero()[:, 0].tolist()}
    return joint


def test_temperature_one_draws_follow_the_target_distribution():
    """Unseeded draws at temperature 1 (top_k 3), with and without n-gram drafts: the first
    three output tokens' joint frequencies (the 2nd and 3rd verified as drafts) match the
    distribution the plan's logits give (chi-square)."""
    prompt = _looping_prompt()
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    target = _target_joint(prompt, params, 3)
    assert abs(sum(target.values()) - 1) < 1e-5 and len(target) == 27
    n = 2400
    torch.manual_seed(0)
    for spec in (None, SPEC):
        # 16 requests at a time, prefilled in one step: their next steps decode alone and
        # speculate (a step with prefill work does not)
        with tiny_engine(speculative=spec, num_blocks=512, max_num_tokens=2048) as engine:
            results = [r for i in range(0, n, 16)
                       for r in engine.generate([prompt] * 16, params)]
            stats = engine.stats()
        counts = Counter(tuple(r.token_ids) for r in results)
        assert chi2_pvalue(counts, target, n) > 1e-3, (spec, counts.most_common(5))
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert stats["spec_draft_tokens"] >= n       # most requests drafted


def test_per_request_draft_limit_and_usage_counts():
    """max_draft_tokens: 0 turns a request's speculation off, 1 caps its drafts a step, above
    the plan's limit (or any with speculation off) is refused naming it; each request's
    usage counts its drafts, and they add up to the engine's counters."""
    from kiln.plugins.inflight_batching import RequestRefused

    prompt = _looping_prompt()
    base = dict(max_tokens=30, temperature=0, ignore_eos=True)
    want, _ = _run([prompt], SamplingParams(**base))
    ks = [None, 0, 1, 4]
    outs, engine = [], tiny_engine(start=False, speculative=SPEC)
    for k in ks:
        stream = engine.submit(prompt, SamplingParams(**base, max_draft_tokens=k))
        engine.run_pending()
        steps = []
        while engine.scheduler.has_work():
            steps.append(sum(len(o.token_ids) for o in engine.step()))
        outs.append((stream.result(), max(steps)))
    for k, (res, most) in zip(ks, outs):
        assert res.token_ids == want[0].token_ids, k
    assert [u.usage.draft_tokens > 0 for u, _ in outs] == [True, False, True, True]
    assert [most for _, most in outs] == [5, 1, 2, 5]   # tokens a step: drafts kept + 1
    stats = engine.stats()
    assert sum(r.usage.draft_tokens for r, _ in outs) == stats["spec_draft_tokens"]
    assert sum(r.usage.accepted_draft_tokens for r, _ in outs) == stats["spec_accepted_tokens"]
    with pytest.raises(RequestRefused, match=r"max_draft_tokens=5 exceeds the plan's "
                                             r"speculative.max_draft_tokens \(4\)"):
        engine.submit(prompt, SamplingParams(**base, max_draft_tokens=5))
    plain = tiny_engine(start=False)
    with pytest.raises(RequestRefused, match="max_draft_tokens=1: this engine does not "
                                             "speculate"):
        plain.submit(prompt, SamplingParams(**base, max_draft_tokens=1))
    plain.submit(prompt, SamplingParams(**base, max_draft_tokens=0))   # 0: nothing to refuse
