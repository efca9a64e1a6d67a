"""Constrained decoding in the engine (a tiny random model, eager): a matcher that hits a
parser limit mid-reply or a mask that allows no token ends its request with an error, never a
stop; a tokenizer with more ids than the model is range-checked; and the step's mask budget
defers rows without changing any output."""
import pytest

from kiln.plugins.inflight_batching import RequestRefused
from kiln.runtime.guided import GuidedDecoding, GuidedLimits
from kiln.runtime.sampling import SamplingParams
from tests.runtime_helpers import tiny_engine, tiny_model

pytestmark = pytest.mark.model

# ---- the engine: limits hit mid-way, masks that allow nothing, the step budget ---------------
AMBIGUOUS = 'start: s\ns: s s | "a" | "b"'     # ambiguous: Earley items grow with the length


def test_a_matcher_that_hits_a_limit_mid_generation_ends_in_an_error_not_a_stop():
    with tiny_engine() as engine:
        engine.guided_limits = GuidedLimits(step_max_items=30)
        plain = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        results = engine.generate(["x", "y", "z"], [
            SamplingParams(max_tokens=200, temperature=1.0, seed=1,
                           guided=GuidedDecoding("grammar", AMBIGUOUS)), plain, plain])
        bad = results[0]
        assert bad.finish_reason == "error" and "limit" in bad.error, (bad.finish_reason,
                                                                       bad.text)
        assert [r.finish_reason for r in results[1:]] == ["length", "length"]
        assert engine.stats()["kv_blocks_used"] == 0


def test_a_tokenizer_larger_than_the_model_range_checks_prompts_and_masks():
    # the model has ids 0..199, the byte tokenizer 0..257
    with tiny_engine(model=tiny_model(vocab=200)) as engine:
        for prompt in ("中", [{"role": "user", "content": "中"}], [65, 230]):
            with pytest.raises(RequestRefused) as e:
                engine.submit(prompt, SamplingParams(max_tokens=4))
            assert "outside the vocabulary [0, 200)" in str(e.value)
        guided = SamplingParams(max_tokens=20, temperature=0,
                                guided=GuidedDecoding("regex", "[a-z]{5}"))
        nothing = SamplingParams(max_tokens=20, temperature=0,
                                 guided=GuidedDecoding("regex", "中+"))  # first byte 228
        plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        ok, none, free = engine.generate(["ab", "cd", "ef"], [guided, nothing, plain])
        assert ok.finish_reason == "stop" and len(ok.text) == 5 and ok.text.isalpha()
        assert none.finish_reason == "error" and "allows no token" in none.error
        assert free.finish_reason == "length" and len(free.token_ids) == 6


def test_the_step_budget_defers_masks_without_changing_any_output():
    prompts = [f"p{i}" for i in range(5)]
    params = [SamplingParams(max_tokens=30, temperature=0 if i % 2 else 0.8, seed=i,
                             guided=GuidedDecoding("regex", "[a-z]{3,9}[0-9]{2}"))
              for i in range(4)] + [SamplingParams(max_tokens=12, temperature=0,
                                                   ignore_eos=True)]
    with tiny_engine() as engine:
        expected = [r.token_ids for r in engine.generate(prompts, params)]
    with tiny_engine() as engine:
        engine.guided_limits = GuidedLimits(step_budget_ms=0, mask_threads=1)
        got = engine.generate(prompts, params)
        deferred = engine.model_runner.masker.num_deferred
    assert [r.token_ids for r in got] == expected
    assert all(r.finish_reason in ("stop", "length") for r in got)
    assert deferred > 0
