"""Scheduler: max_prefill_tokens_with_decodes, the prefill tokens a step with decodes may add.

No model and no tensors: step outputs are made by hand."""
import pytest

from kiln.contracts import FieldError
from kiln.plugins.inflight_batching import (Scheduler, SchedulerConfig, StepOutput,
                                            TokenSequence)

pytestmark = pytest.mark.unit


def make(cap, **kw):
    cfg = dict(max_batch_size=8, max_num_tokens=32, max_seq_len=128, tokens_per_block=4,
               max_prefill_tokens_with_decodes=cap)
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg), 256)


def seq(rid, n_prompt, start=0, max_tokens=8):
    return TokenSequence(rid, list(range(start, start + n_prompt)), max_tokens)


def step(s):
    out = s.schedule()
    s.update(out, StepOutput([7 if smp else None for smp in out.sample]))
    return out


def test_no_decodes_take_the_whole_budget():
    s = make(cap=4)
    s.add(seq("a", 40))
    out = step(s)
    assert out.num_scheduled_tokens == [32]        # no decode runs: the cap does not apply


def test_a_step_with_decodes_adds_at_most_the_cap():
    s = make(cap=4)
    s.add(seq("a", 3))
    step(s)                                        # a decodes from now on
    s.add(seq("b", 10, start=100))
    s.add(seq("c", 10, start=200))
    sizes = []
    while s.by_id["b"].num_output_tokens == 0:
        out = step(s)
        assert out.seqs[0].request_id == "a" and out.num_scheduled_tokens[0] == 1
        sizes.append(out.num_scheduled_tokens[1:])
        assert sum(out.num_scheduled_tokens[1:]) <= 4
    assert sizes == [[4], [4], [2, 2]]             # b in chunks of 4, then c is admitted


def test_unset_mixes_up_to_the_token_budget():
    s = make(cap=None)
    s.add(seq("a", 3))
    step(s)
    s.add(seq("b", 40, start=100))
    out = step(s)
    assert out.num_scheduled_tokens == [1, 31]


def test_the_same_tokens_whatever_the_cap():
    """The cap moves prefill work between steps, never changes what is computed."""
    def run(cap):
        s = make(cap=cap)
        seqs = [seq(f"r{i}", 5 + 7 * i, start=50 * i) for i in range(5)]
        s.add(seqs[0])
        step(s)
        for q in seqs[1:]:
            s.add(q)
        steps = 0
        while s.has_work():
            step(s)
            steps += 1
        return [q.token_ids for q in seqs], steps
    (toks_1, steps_1), (toks_0, steps_0) = run(1), run(None)
    assert toks_1 == toks_0
    assert steps_1 > steps_0


def test_the_cap_is_checked():
    with pytest.raises(FieldError, match="max_prefill_tokens_with_decodes"):
        SchedulerConfig(max_prefill_tokens_with_decodes=0)
