"""The engine end to end on a tiny random Llama through the real paged_attention op."""
import asyncio
import dataclasses
import random
import threading
import time
from pathlib import Path

import pytest

from kiln.contracts.manifest import LimitsSection, SchedulerSection
from kiln.plugins.inflight_batching import RequestRefused
from kiln.runtime.engine import EngineConfig, QueueFullError
from kiln.runtime.plan import Plan, read_manifest
from kiln.runtime.sampling import SamplingParams
from tests.runtime_helpers import tiny_engine, tiny_model

pytestmark = pytest.mark.model
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(rng.randint(3, 60))] for _ in range(16)]


@pytest.fixture(scope="module")
def alone(model, prompts):
    """Each prompt run by itself."""
    with tiny_engine(model=model, prefix_caching=False) as eng:
        return [eng.generate([p], GREEDY)[0].token_ids for p in prompts]


@pytest.mark.parametrize("name,num_blocks,config", [
    ("no_evict_chunked", 256, dict(policy="guaranteed_no_evict", max_num_tokens=16)),
    ("max_util_chunked", 256, dict(policy="max_utilization", max_num_tokens=16)),
    ("max_util_preempt", 24, dict(policy="max_utilization", max_num_tokens=32)),
    ("no_chunking", 256, dict(chunked_prefill=False, max_num_tokens=64)),
])
def test_batched_equals_alone(model, prompts, alone, name, num_blocks, config):
    with tiny_engine(model=model, num_blocks=num_blocks, **config) as eng:
        streams = [eng.submit(p, GREEDY) for p in prompts]
        results = [s.result() for s in streams]
        stats = eng.stats()
    assert [r.token_ids for r in results] == alone
    assert all(r.finish_reason == "length" for r in results)
    assert stats["kv_blocks_used"] == 0
    if name == "max_util_preempt":
        assert stats["preemptions"] > 0
    else:
        assert stats["preemptions"] == 0


def random_params(rng):
    kw = dict(max_tokens=rng.randint(1, 8))
    kind = rng.random()
    if kind < 0.3:
        kw["temperature"] = 0
    else:
        kw.update(temperature=rng.choice([0.5, 1.0, 1.5]), top_k=rng.choice([0, 5, 50]),
                  top_p=rng.choice([1.0, 0.9, 0.5]), min_p=rng.choice([0.0, 0.05]))
    if rng.random() < 0.3:
        kw["seed"] = rng.randrange(1000)
    if rng.random() < 0.2:
        kw.update(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3)
    if rng.random() < 0.2:
        kw["stop"] = [chr(rng.randrange(97, 123))]
    if rng.random() < 0.1:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    return SamplingParams(**kw)


def test_thousand_random_requests_end_once_and_free_all_blocks(model):
    rng = random.Random(1)
    t0 = time.monotonic()
    with tiny_engine(model=model, num_blocks=96, max_batch_size=32, max_num_tokens=96,
                     max_queue=2000) as eng:
        jobs, cancels, immediate = [], [], set()
        for i in range(1000):
            prompt = [rng.randrange(256) for _ in range(rng.randint(1, 40))]
            params = random_params(rng)
            stream = eng.submit(prompt, params)
            jobs.append((stream, params))
            if rng.random() < 0.2:   # cancelled at once, or later from another thread
                if rng.random() < 0.3:
                    stream.cancel()
                    immediate.add(i)
                else:
                    cancels.append((rng.uniform(0, 3.0), stream))
        cancels.sort(key=lambda c: c[0])

        def canceller():
            for at, stream in cancels:
                time.sleep(max(0.0, t0 + at - time.monotonic()))
                stream.cancel()
                stream.cancel()                   # idempotent
        thread = threading.Thread(target=canceller)
        thread.start()
        reasons = []
        for i, (stream, params) in enumerate(jobs):
            outs = list(stream)
            assert sum(o.finished for o in outs) == 1 and outs[-1].finished
            last = outs[-1]
            reasons.append(last.finish_reason)
            if i in immediate:   # cancelled right after submit, long before its turn
                assert last.finish_reason == "cancelled", i
            assert last.finish_reason in ("stop", "length", "cancelled")
            n = sum(len(o.token_ids) for o in outs)
            assert last.usage.completion_tokens == n
            if last.finish_reason == "length":
                assert n == params.max_tokens
        thread.join()
        time.sleep(0.1)
        stats = eng.stats()
    assert stats["requests_finished"] == 1000
    # How many of the later cancels land before their request ends depends on the machine's
    # speed; the ones cancelled at submission always do.
    assert len(immediate) > 40 and reasons.count("cancelled") >= len(immediate)
    assert reasons.count("stop") > 10
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["running"] == stats["waiting"] == 0
    print(f"1,000 requests in {time.monotonic() - t0:.1f} s")


def test_prefix_cache_hit_is_reported_and_output_unchanged(model):
    rng = random.Random(2)
    system = [rng.randrange(256) for _ in range(40)]
    first = system + [1, 2, 3]
    second = system + [9, 8, 7, 6]
    results = {}
    for caching in (True, False):
        with tiny_engine(model=model, prefix_caching=caching, max_num_tokens=64) as eng:
            eng.generate([first], GREEDY)
            scheduled = []
            execute = eng.executor.execute
            eng.executor.execute = lambda mi: (scheduled.append(mi.input_ids.numel()),
                                               execute(mi))[1]
            results[caching] = eng.generate([second], GREEDY)[0]
            eng.executor.execute = execute
            results[caching, "first_step_tokens"] = scheduled[0]
    assert results[True].usage.cached_tokens == 40
    assert results[False].usage.cached_tokens == 0
    assert results[True, "first_step_tokens"] == len(second) - 40
    assert results[False, "first_step_tokens"] == len(second)
    assert results[True].token_ids == results[False].token_ids


def test_seed_gives_same_output_whatever_the_batch(model):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=10, ignore_eos=True)
    prompt = list(b"the same prompt")
    with tiny_engine(model=model) as eng:
        alone = eng.generate([prompt], seeded)[0].token_ids
        rng = random.Random(3)
        others = [[rng.randrange(256) for _ in range(rng.randint(2, 30))] for _ in range(6)]
        streams = [eng.submit(p, SamplingParams(temperature=1.0, max_tokens=10)) for p in others[:3]]
        mine = eng.submit(prompt, seeded)
        streams += [eng.submit(p, SamplingParams(temperature=0.7, max_tokens=10)) for p in others[3:]]
        together = mine.result().token_ids
        for s in streams:
            s.result()
    assert together == alone


def test_async_iteration_and_text(model):
    async def main(eng):
        stream = eng.submit("hello", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        outs = [o async for o in stream]
        other = eng.submit("hello", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        res = await other.aresult()
        return outs, res
    with tiny_engine(model=model) as eng:
        outs, res = asyncio.run(main(eng))
        sync = eng.generate(["hello"], SamplingParams(temperature=0, max_tokens=6,
                                                      ignore_eos=True))[0]
    assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 6
    assert res.token_ids == sync.token_ids == [t for o in outs for t in o.token_ids]
    assert res.text == eng.tokenizer.decode(res.token_ids) == "".join(o.text for o in outs)
    assert res.timings.ttft is not None and res.timings.queue_time is not None
    assert res.usage.prompt_tokens == 5


def test_chat_messages_stop_strings_and_cancel(model):
    with tiny_engine(model=model) as eng:
        res = eng.generate([[{"role": "user", "content": "hi"}]],
                           SamplingParams(temperature=0, max_tokens=8))[0]
        assert res.usage.prompt_tokens == len(eng.tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=True))
        full = eng.generate(["abc"], SamplingParams(temperature=0, max_tokens=20,
                                                    ignore_eos=True))[0]
        stop = next(full.text[i:i + 2] for i in range(2, len(full.text) - 1)
                    if "\ufffd" not in full.text[i:i + 2])
        cut = eng.generate(["abc"], SamplingParams(temperature=0, max_tokens=20,
                                                   ignore_eos=True, stop=[stop]))[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
        assert cut.text == full.text[:full.text.index(stop)]
        s = eng.submit("abc", SamplingParams(max_tokens=200, ignore_eos=True))
        next(iter(s))
        s.cancel()
        last = list(s)[-1]
        assert last.finish_reason == "cancelled"
        time.sleep(0.05)
        assert eng.stats()["kv_blocks_used"] == 0


def test_refusals_and_queue_full(model):
    eng = tiny_engine(model=model, start=False, max_queue=2, max_seq_len=64)
    with pytest.raises(RequestRefused, match="max_seq_len"):
        eng.submit(list(range(60)), SamplingParams(max_tokens=10))
    eng.submit("a")
    eng.submit("b")
    with pytest.raises(QueueFullError):
        eng.submit("c")
    eng.shutdown()


def test_limits_lowered_never_raised(tiny_plan, tmp_path):
    manifest = read_manifest(tiny_plan)
    assert manifest.kv_cache.tokens_per_block == 16
    plan = Plan(Path(tmp_path), dataclasses.replace(
        manifest,
        limits=LimitsSection(max_batch_size=8, max_seq_len=512, max_input_len=511,
                             max_num_tokens=128),
        scheduler=SchedulerSection(policy="guaranteed_no_evict", chunked_prefill=True,
                                   prefix_caching=True, max_queue=64)))
    cfg = EngineConfig.from_plan(plan, max_batch_size=4, max_seq_len=256)
    assert (cfg.max_batch_size, cfg.max_seq_len, cfg.input_len) == (4, 256, 255)
    assert cfg.policy == "guaranteed_no_evict"
    with pytest.raises(ValueError, match=r"max_num_tokens=256 exceeds the plan's max_num_tokens \(128\)"):
        EngineConfig.from_plan(plan, max_num_tokens=256)
    with pytest.raises(ValueError, match="unknown engine setting"):
        EngineConfig.from_plan(plan, max_batch=4)
