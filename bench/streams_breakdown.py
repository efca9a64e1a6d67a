"""Where the time of an in-process many-stream run goes: the compiled step (steps that carry
prefill vs pure-decode steps), packing the inputs, sampling, scheduling and the update
(detokenizing, stop rules, streaming).

    python bench/streams_breakdown.py plans/smollm2-135m-cpu --streams 32 --prompt 128 \
        --out 128 --threads 2 [--set max_prefill_tokens_with_decodes=128]

Random prompts of --prompt tokens, --out greedy tokens each (ignore_eos), all submitted at
once; reports output tokens/s over the whole run, TTFT p50/max, and per kind of step the
seconds in each part (each wrapped with time.perf_counter; "other" is the rest of step()).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln.runtime.compute import claim_process  # noqa: E402

PARTS = ("step", "prepare", "sample", "schedule", "update")


def instrument(eng, rows: list) -> None:
    """Wrap the engine's parts so each step appends ({part: seconds, T, B}, total) to rows."""
    cur: dict = {}

    def timed(fn, key):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                cur[key] = cur.get(key, 0.0) + time.perf_counter() - t0
        return run

    mr, sched = eng.model_runner, eng.scheduler
    eng.executor.execute = timed(eng.executor.execute, "step")
    mr.prepare = timed(mr.prepare, "prepare")
    sampler, sample = mr.sampler, timed(mr.sampler, "sample")
    mr.sampler = type("TimedSampler", (), {"__call__": lambda self, *a, **k: sample(*a, **k),
                                           "__getattr__": lambda self, n: getattr(sampler, n)})()
    schedule = timed(sched.schedule, "schedule")

    def schedule_and_count():
        out = schedule()
        cur["T"], cur["B"] = out.total_num_tokens, len(out.seqs)
        return out
    sched.schedule = schedule_and_count
    eng.update = timed(eng.update, "update")
    step = eng.step

    def counted_step():
        cur.clear()
        t0 = time.perf_counter()
        out = step()
        rows.append((dict(cur), time.perf_counter() - t0))
        return out
    eng.step = counted_step


def report(rows: list) -> None:
    kinds = (("prefill-carrying", [r for r in rows if r[0].get("T", 0) > r[0].get("B", 0)]),
             ("pure-decode", [r for r in rows if r[0].get("T", 0) == r[0].get("B", 0)]))
    for name, rs in kinds:
        if not rs:
            continue
        total = sum(r[1] for r in rs)
        parts = {k: sum(r[0].get(k, 0.0) for r in rs) for k in PARTS}
        print(f"{name}: {len(rs)} steps, {total:.2f} s; "
              + " ".join(f"{k} {v:.3f}" for k, v in parts.items())
              + f" other {total - sum(parts.values()):.3f} s; mean tokens "
              f"{statistics.mean(r[0]['T'] for r in rs):.0f}, rows "
              f"{statistics.mean(r[0]['B'] for r in rs):.1f}, step "
              f"{1e3 * parts['step'] / len(rs):.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("plan")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--out", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="SETTING=N",
                    help="an engine setting (EngineConfig field), e.g. max_num_tokens=256")
    a = ap.parse_args()
    claim_process(a.threads)
    from kiln.runtime.engine import Engine
    from kiln.runtime.sampling import SamplingParams

    settings = {k: int(v) for k, v in (s.split("=") for s in a.set)}
    eng = Engine.from_plan(a.plan, num_threads=a.threads, **settings)
    rows: list = []
    instrument(eng, rows)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(a.prompt)] for _ in range(a.streams)]
    params = SamplingParams(max_tokens=a.out, temperature=0.0, ignore_eos=True)
    eng.generate([prompts[0][:16]], params)    # warm
    rows.clear()
    t0 = time.perf_counter()
    res = eng.generate(prompts, params)
    wall = time.perf_counter() - t0
    eng.shutdown()
    tokens = sum(r.usage.completion_tokens for r in res)
    ttft = sorted(r.timings.ttft for r in res)
    print(f"{a.streams} streams: {tokens / wall:.1f} tokens/s ({tokens} in {wall:.2f} s), TTFT "
          f"p50 {statistics.median(ttft):.3f} s max {ttft[-1]:.3f} s; outside step() "
          f"{wall - sum(r[1] for r in rows):.3f} s; load {os.getloadavg()[0]:.2f}")
    report(rows)


if __name__ == "__main__":
    main()
