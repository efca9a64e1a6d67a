"""One bad request never harms another, in the engine: requests refused at submission by
the model's vocabulary, a failure pinned on the request that caused it, a fault in the
scheduler/pool during a step (the engine recovers), and a dead engine loop (every request
fails at once, submit refuses, the failure callbacks run). Real engine: the tiny random
Llama of tests/runtime_helpers.py through the real paged-attention op."""
from __future__ import annotations

import threading
import time

import pytest

from kiln.plugins.inflight_batching import RequestRefused
from kiln.runtime.engine import EngineError
from kiln.runtime.sampling import Sampler, SamplingParams
from tests.runtime_helpers import VOCAB, tiny_engine

pytestmark = pytest.mark.model

WAIT = 5.0   # no request may wait longer than this for its end after a fault


def _ends_within(streams, seconds: float):
    """Each stream's result, asserting that all of them ended within `seconds`."""
    box = {}

    def gather():
        box["r"] = [s.result() for s in streams]

    t = threading.Thread(target=gather, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"requests still waiting after {seconds}s"
    return box["r"]


def _longest_wait(stream) -> tuple[float, object]:
    """Read a stream to its end -> (the longest wait for one of its outputs, its result)."""
    box = {}

    def read():
        t, longest, outs = time.monotonic(), 0.0, []
        for out in stream:
            now = time.monotonic()
            longest, t = max(longest, now - t), now
            outs.append(out)
        box["r"] = (longest, outs[-1])

    th = threading.Thread(target=read, daemon=True)
    th.start()
    th.join(120)
    assert "r" in box, "a stream never ended"
    return box["r"]


def test_out_of_vocab_ids_are_refused_and_the_batch_goes_on():
    with tiny_engine() as engine:
        good = [engine.submit(f"prompt {i}", SamplingParams(max_tokens=12, temperature=0,
                                                              ignore_eos=True))
                for i in range(31)]
        for bad in (dict(stop_token_ids=(VOCAB + 1,), min_tokens=1),
                    dict(bad_token_ids=(VOCAB,))):
            with pytest.raises(RequestRefused, match="outside the model's vocabulary"):
                engine.submit("bad", SamplingParams(max_tokens=12, **bad))
        with pytest.raises(RequestRefused, match="outside the vocabulary"):
            engine.submit([1, 2, VOCAB], SamplingParams(max_tokens=2))
        results = _ends_within(good, 120)
        assert [r.finish_reason for r in results] == ["length"] * 31
        assert all(len(r.token_ids) == 12 for r in results)
        # the model's vocabulary, not the tokenizer's, bounds the ids (a padded lm_head)
        engine.vocab_size = VOCAB - 8
        with pytest.raises(RequestRefused):
            engine.submit("x", SamplingParams(stop_token_ids=(VOCAB - 8,)))
        with pytest.raises(RequestRefused):
            engine.submit([VOCAB - 8], SamplingParams())


class _FaultySampler(Sampler):
    """The real sampler, with a fault injected for rows whose request has top_k == 7."""

    def __call__(self, logits, states, *args, **kw):
        if any(s.params.top_k == 7 for s in states):
            raise IndexError("injected: index 999 is out of bounds")
        return super().__call__(logits, states, *args, **kw)


def test_a_failure_in_sampling_fails_only_its_request():
    """A fault injected into the sampler for one request's row: that request ends with
    'error', the others get the tokens they would have got alone."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with tiny_engine() as engine:
        alone = engine.generate([f"p{i}" for i in range(4)], params)
        engine.model_runner.sampler = _FaultySampler()
        streams = [engine.submit(f"p{i}", params) for i in range(4)]
        bad = engine.submit("victim", SamplingParams(max_tokens=10, temperature=0, top_k=7))
        results = _ends_within(streams + [bad], 60)
        assert results[-1].finish_reason == "error"
        assert "IndexError" in results[-1].error
        for got, want in zip(results[:4], alone):
            assert got.finish_reason == "length" and got.token_ids == want.token_ids
        assert engine.stats()["kv_blocks_used"] == 0


def test_a_fault_in_the_pool_during_a_step_is_recovered():
    """The block pool raises once mid-schedule: the running batch fails at once (nothing
    waits past WAIT), nothing leaks, and the engine serves the next requests."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with tiny_engine(num_blocks=64) as engine:
        pool = engine.scheduler.pool
        real = pool.can_append
        fired = threading.Event()

        def once(*a, **kw):
            if not fired.is_set() and engine.scheduler.num_running >= 2:
                fired.set()
                raise RuntimeError("injected pool fault")
            return real(*a, **kw)

        pool.can_append = once
        streams = [engine.submit(f"request {i}", params) for i in range(6)]
        gaps = [_longest_wait(s) for s in streams]
        results = [g[1] for g in gaps]
        assert max(g[0] for g in gaps) < WAIT, gaps
        assert fired.is_set()
        reasons = [r.finish_reason for r in results]
        assert set(reasons) <= {"length", "error"} and "error" in reasons, reasons
        for r in results:
            assert r.finish_reason == "error" or r.usage.completion_tokens == 24
            if r.finish_reason == "error":
                assert "injected pool fault" in r.error
        assert engine.failure is None
        assert engine.stats()["kv_blocks_used"] == 0
        again = engine.generate(["after the fault"], params)[0]
        assert again.finish_reason == "length" and len(again.token_ids) == 24


def test_a_dead_engine_loop_fails_everything_and_says_so():
    """A fault outside the step (in the loop's own bookkeeping) ends the engine: every
    request in flight or queued fails within WAIT, submit refuses, callbacks run."""
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    with tiny_engine(max_batch_size=4) as engine:
        failures = []
        engine.on_failure(failures.append)
        streams = [engine.submit(f"long {i}", params) for i in range(4)]
        first = next(iter(streams[0]))          # running
        assert not first.finished
        late = engine.submit("queued", params)   # waits: the batch is full
        real = engine.scheduler.has_work
        engine.scheduler.has_work = lambda: (_ for _ in ()).throw(RuntimeError("injected"))
        ended = _ends_within([late] + streams, WAIT)
        engine.scheduler.has_work = real
        assert all(r.finish_reason == "error" for r in ended)
        assert all("the engine failed" in r.error for r in ended)
        assert engine.failure and "injected" in engine.failure
        assert failures == [engine.failure]
        with pytest.raises(EngineError, match="the engine failed"):
            engine.submit("after", params)
        called = []
        engine.on_failure(called.append)        # registered late: called at once
        assert called == [engine.failure]


def test_shutdown_does_not_wait_forever_for_a_hung_step():
    """A step that never returns: shutdown gives up after its timeout and ends every
    request (running and queued) with 'error'."""
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    with tiny_engine(max_batch_size=1) as engine:
        release = threading.Event()
        real = engine.model_runner.execute

        def hang(out):
            release.wait(60)
            return real(out)

        engine.model_runner.execute = hang
        streams = [engine.submit(f"r{i}", params) for i in range(3)]
        time.sleep(0.2)                 # the loop is inside the first step
        t0 = time.monotonic()
        engine.shutdown(timeout=0.5)
        assert time.monotonic() - t0 < WAIT
        results = _ends_within(streams, WAIT)
        release.set()
        assert [r.finish_reason for r in results] == ["error"] * 3
