"""Scheduler: budgets, chunking, policies, preemption, prefix hits, refusal, cancellation.

No model and no tensors: step outputs are made by hand."""
import pytest

from kiln.plugins.inflight_batching import (RequestRefused, Scheduler, SchedulerConfig, TokenSequence,
                                       SequenceStatus, StepOutput)

pytestmark = pytest.mark.unit
EOS = 99


def make(num_blocks=64, **kw):
    cfg = dict(max_batch_size=4, max_num_tokens=16, max_seq_len=64, tokens_per_block=4)
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg), num_blocks)


def seq(rid, n_prompt, max_tokens=4, start=0, **kw):
    return TokenSequence(rid, list(range(start, start + n_prompt)), max_tokens,
                    stop_token_ids=[EOS], **kw)


def step(s, token=7):
    out = s.schedule()
    assert out.total_num_tokens <= s.config.max_num_tokens
    assert len(out.seqs) <= s.config.max_batch_size
    assert len({id(q) for q in out.seqs}) == len(out.seqs)
    s.update(out, StepOutput([token if smp else None for smp in out.sample]))
    return out


def drain(s, limit=1000):
    for _ in range(limit):
        if not s.has_work():
            return
        step(s)
    raise AssertionError("scheduler did not drain")


def test_decodes_first_then_chunked_prefill():
    s = make(max_num_tokens=8)
    a = seq("a", 3)
    s.add(a)
    step(s)                                   # a: prefill 3, samples
    assert a.num_output_tokens == 1
    b = seq("b", 20, start=100)
    s.add(b)
    out = step(s)
    assert [q.request_id for q in out.seqs] == ["a", "b"]
    assert out.num_scheduled_tokens == [1, 7] and out.sample == [True, False]
    out = step(s)
    assert out.num_scheduled_tokens == [1, 7]
    out = step(s)                             # b's last 6 tokens, then it samples
    assert out.num_scheduled_tokens == [1, 6] and out.sample == [True, True]
    assert b.num_computed_tokens == 20 and b.num_output_tokens == 1


def test_batch_size_limit():
    s = make(max_batch_size=2, max_num_tokens=64)
    for i in range(5):
        s.add(seq(f"r{i}", 3, start=10 * i))
    out = step(s)
    assert len(out.seqs) == 2 and s.num_running == 2 and s.num_waiting == 3
    drain(s)
    assert s.pool.stats().used_blocks == 0


def test_no_chunking_prompt_waits_for_whole_budget():
    s = make(max_num_tokens=10, chunked_prefill=False)
    with pytest.raises(RequestRefused, match="chunked prefill off"):
        s.check(11, 1)
    s.add(seq("a", 6))
    s.add(seq("b", 6, start=50))
    out = step(s)
    assert [q.request_id for q in out.seqs] == ["a"]        # b does not fit the rest (4)
    out = step(s)
    assert [q.request_id for q in out.seqs] == ["a", "b"] and out.num_scheduled_tokens == [1, 6]


def test_refusals():
    s = make(num_blocks=8, max_input_len=30)
    with pytest.raises(RequestRefused, match="max_input_len"):
        s.check(31, 1)
    with pytest.raises(RequestRefused, match="max_seq_len"):
        s.check(30, 40)
    with pytest.raises(RequestRefused, match="KV blocks"):
        s.check(20, 20)                                      # 40 tokens = 10 blocks > 8
    with pytest.raises(RequestRefused, match="empty"):
        s.check(0, 1)


def test_guaranteed_no_evict_admits_only_what_can_finish():
    s = make(num_blocks=10, policy="guaranteed_no_evict", max_num_tokens=64)
    a, b = seq("a", 8, max_tokens=12), seq("b", 8, max_tokens=12, start=50)  # 5 blocks each
    c = seq("c", 4, max_tokens=4, start=80)
    for q in (a, b, c):
        s.add(q)
    step(s)
    assert a.status is b.status is SequenceStatus.RUNNING
    assert c.status is SequenceStatus.WAITING              # 10 blocks promised to a and b
    drain(s)
    assert s.num_preemptions == 0
    assert all(q.num_output_tokens == q.max_tokens for q in (a, b, c))
    assert s.pool.stats().used_blocks == 0


def test_max_utilization_preempts_newest_and_recomputes():
    s = make(num_blocks=6, policy="max_utilization", max_num_tokens=64, prefix_caching=False)
    a, b = seq("a", 8, max_tokens=8), seq("b", 8, max_tokens=8, start=50)
    s.add(a)
    s.add(b)
    tokens = {"a": [], "b": []}
    preempted = []
    while s.has_work():
        out = s.schedule()
        preempted += [q.request_id for q in out.preempted]
        assert s.pool.stats().used_blocks <= 6
        toks = [len(q.token_ids) if smp else None for q, smp in zip(out.seqs, out.sample)]
        s.update(out, StepOutput(toks))
        for q, t in zip(out.seqs, toks):
            if t is not None:
                tokens[q.request_id].append(t)
    assert preempted and preempted[0] == "b"              # the newest goes first
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    # every output position was produced exactly once, nothing lost or duplicated
    for q in (a, b):
        assert q.num_output_tokens == 8
        assert q.output_token_ids == list(range(8, 16))
    assert s.pool.stats().used_blocks == 0


def test_preempted_resumes_before_new_requests():
    s = make(num_blocks=5, max_num_tokens=64, prefix_caching=False)
    a, b = seq("a", 8, max_tokens=4), seq("b", 7, max_tokens=4, start=50)
    s.add(a)
    s.add(b)
    step(s)                     # a 2 blocks, b 2 blocks (+1 free)
    step(s)                     # a needs block 3 (9 tokens): takes the last free block
    out = step(s)               # b needs its 3rd block (9 tokens): none free -> b preempted
    assert b.status in (SequenceStatus.PREEMPTED, SequenceStatus.RUNNING)
    s.add(seq("c", 2, start=90))
    assert s.waiting[0] is b or b.status is SequenceStatus.RUNNING
    drain(s)
    assert s.pool.stats().used_blocks == 0


def test_stop_token_and_min_tokens():
    s = make()
    a = seq("a", 3, max_tokens=10, min_tokens=0)
    s.add(a)
    step(s, token=EOS)
    assert a.status is SequenceStatus.FINISHED_STOPPED and a.stop_reason == EOS
    b = seq("b", 3, max_tokens=10, min_tokens=2)
    s.add(b)
    step(s, token=EOS)
    assert not b.is_finished     # the sampler masks stops before min_tokens; still no stop
    step(s, token=EOS)
    assert b.status is SequenceStatus.FINISHED_STOPPED and b.num_output_tokens == 2
    assert s.pool.stats().used_blocks == 0


def test_length_finish():
    s = make(max_seq_len=8)
    a = seq("a", 5, max_tokens=3)
    s.add(a)
    drain(s)
    assert a.status is SequenceStatus.FINISHED_LENGTH and a.num_tokens == 8


def test_prefix_hit_skips_cached_tokens():
    s = make(max_num_tokens=64)
    a = seq("a", 13, max_tokens=2)
    s.add(a)
    drain(s)
    b = TokenSequence("b", list(range(12)) + [77], 2, stop_token_ids=[EOS])
    s.add(b)
    out = step(s)
    assert b.num_cached_tokens == 12 and out.num_scheduled_tokens == [1]
    drain(s)
    assert s.pool.stats().used_blocks == 0 and s.pool.stats().prefix_hit_tokens == 12


def test_cancel_frees_blocks_at_once():
    s = make(max_num_tokens=4)
    a, b = seq("a", 10), seq("b", 3, start=50)
    s.add(a)
    s.add(b)
    step(s)                                    # a mid-prefill
    assert s.pool.stats().used_blocks > 0
    s.abort("a")
    s.abort("b")                               # b still waiting
    assert a.status is b.status is SequenceStatus.FINISHED_ABORTED
    assert s.pool.stats().used_blocks == 0 and not s.has_work()
    assert s.abort("a") is None


def test_cancel_between_schedule_and_update_is_ignored():
    s = make()
    a = seq("a", 3)
    s.add(a)
    out = s.schedule()
    s.abort("a")
    s.update(out, StepOutput([7]))
    assert a.num_output_tokens == 0 and s.pool.stats().used_blocks == 0


def test_config_validation():
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="fifo")
    with pytest.raises(ValueError, match="max_input_len"):
        SchedulerConfig(max_seq_len=16, max_input_len=16)


def test_a_sequence_without_its_token_runs_its_last_token_again():
    """The sampler may leave a sampling row without a token (a constrained row whose mask the
    step's budget left out): the row's last scheduled token is computed again next step."""
    s = make()
    a, b = seq("a", 6), seq("b", 3)
    s.add(a)
    s.add(b)
    out = s.schedule()                                   # both prompts, whole
    s.update(out, StepOutput([None, 7]))                 # a deferred, b sampled
    assert (a.num_computed_tokens, a.num_output_tokens) == (5, 0)
    out = s.schedule()
    assert out.seqs == [a, b] and out.num_scheduled_tokens == [1, 1] and out.sample == [1, 1]
    assert a.token_ids[a.num_computed_tokens] == 5       # the prompt's last token, again
    s.update(out, StepOutput([8, None]))                 # now b waits
    assert a.output_token_ids == [8] and b.num_computed_tokens == 3
    drain(s)
    assert a.num_output_tokens == b.num_output_tokens == 4
    assert s.pool.stats().used_blocks == 0
