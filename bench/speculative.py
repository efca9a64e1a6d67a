"""Speculative decoding vs none on one plan, side by side in one run (not a test).

    python -m bench.speculative plans/smollm2-135m-cpu [--rounds 2] [--max-tokens 96]
        [--draft 4] [--streams 1,8,32] [--threads 2] [--out bench/results/speculative.json]
        [--draft-plan plans/smollm2-135m-throughput-cpu]

Two in-process Engines over the same plan: one with speculation (n-gram, or with
--draft-plan a draft model: that plan, loaded beside the target, proposes; --draft tokens)
and one without. At each concurrency of --streams, each round runs the prompts on each
engine alternately (each group of prompts on one side then the other, the side that goes
first alternating), that many requests at a time (a batch of 1 is one request alone; a
larger one cycles the prompts to fill it), greedy: (a) input-grounded prompts (quote, edit
or repeat a given text: the output copies the input, where prompt lookup proposes well) and
(b) open chat prompts. Reported per kind, concurrency and side: output tokens/s (sum of
tokens over sum of batch wall times), mean TPOT, the acceptance rate (accepted / drafted)
and whether every output is token-for-token the one without speculation.

Both engines are stepped from this one thread, laid out as `kiln serve` lays out its process
(runtime/compute.py: claim_process before torch loads, this thread the only one computing, with
--threads OpenMP threads). Two engine threads would give the process two OpenMP pools, more
pool threads than cores, and libgomp then sleeps between parallel regions instead of
spinning: every region of a step pays a futex wake-up, which a draft plan's short W4A8 steps
(several a round) pay far more of than the fp32 step, and no server, one engine per process,
pays at all.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from kiln.runtime.compute import claim_process, enter_engine_thread

if __name__ == "__main__":     # before torch is imported (through the engine)
    _ap = argparse.ArgumentParser(add_help=False)
    _ap.add_argument("--threads", type=int, default=None)
    THREADS = claim_process(_ap.parse_known_args()[0].threads)

from kiln.runtime.engine import Engine  # noqa: E402
from kiln.runtime.sampling import SamplingParams  # noqa: E402
from kiln.runtime.speculative import SpeculativeConfig  # noqa: E402
from kiln.runtime.streams import RequestResult  # noqa: E402

TEXT = ("The river rises in the northern hills and runs south for two hundred miles. "
        "Its water feeds three towns, a paper mill and the farms of the valley. In dry "
        "summers the mill stops and the farmers draw lots for the water. ")
GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    f"Here is a paragraph:\n\n{TEXT}\n\nRewrite it, replacing 'river' with 'canal'.",
    f"Quote the second sentence of this text, then the first:\n\n{TEXT}",
    "Fix the spelling in this code and return the whole function:\n\n"
    "def add_numbres(a, b):\n    resutl = a + b\n    return resutl\n",
]
CHAT = [
    "Write a short poem about the sea.",
    "What are three tips for staying focused while studying?",
    "Explain what a compiler does, in a few sentences.",
    "Give me a recipe idea for a quick vegetarian dinner.",
]


def run_batch(engine: Engine, prompts: list[str], params: SamplingParams
              ) -> tuple[list[RequestResult], float]:
    """Requests submitted together and stepped on this thread until done -> (their results,
    wall seconds of the batch). Chat messages where the plan has a chat template, else the
    bare text."""
    chat = bool(engine.tokenizer.chat_template)
    t0 = time.perf_counter()
    streams = [engine.submit([{"role": "user", "content": p}] if chat else p, params)
               for p in prompts]
    engine.run_pending()
    while engine.scheduler.has_work():
        engine.step()
    return [s.result() for s in streams], time.perf_counter() - t0


def batches(prompts: list[str], streams: int) -> list[list[str]]:
    """The prompts in groups of `streams` (cycled to fill one group when fewer)."""
    if streams >= len(prompts):
        return [[prompts[i % len(prompts)] for i in range(streams)]]
    return [prompts[i:i + streams] for i in range(0, len(prompts), streams)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--draft", type=int, default=4, help="max_draft_tokens")
    ap.add_argument("--streams", default="1", help="concurrencies, comma-separated: 1,8,32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--draft-plan", default=None, help="a draft plan (method draft) instead "
                    "of n-gram lookup")
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    streams = [int(s) for s in args.streams.split(",")]
    method = "ngram" if args.draft_plan is None else "draft"
    spec = SpeculativeConfig(method=method, max_draft_tokens=args.draft)
    enter_engine_thread(THREADS)      # this thread steps both engines
    engines = {"off": Engine.from_plan(args.plan, start=False, speculative=False),
               method: Engine.from_plan(args.plan, start=False, speculative=spec,
                                        draft_plan=args.draft_plan)}
    try:
        for e in engines.values():      # warm-up: first steps of a fresh engine are slower
            run_batch(e, CHAT[:1], SamplingParams(max_tokens=8, temperature=0))
        report = {"plan": args.plan, "machine": platform.processor() or platform.machine(),
                  "threads": THREADS, "max_tokens": args.max_tokens,
                  "speculative": spec.__dict__, "draft_plan": args.draft_plan, "kinds": {}}
        for kind, prompts in (("grounded", GROUNDED), ("chat", CHAT)):
            report["kinds"][kind] = {str(n): measure(engines, batches(prompts, n), params,
                                                     args.rounds) for n in streams}
    finally:
        for e in engines.values():
            e.shutdown()
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


def measure(engines: dict[str, Engine], groups: list[list[str]], params: SamplingParams,
            rounds: int) -> dict:
    """Alternating rounds over the groups of prompts -> per side tokens/s and TPOT, and the
    comparison."""
    tokens = {k: 0 for k in engines}
    seconds = {k: 0.0 for k in engines}
    tpots: dict[str, list[float]] = {k: [] for k in engines}
    outputs: dict[str, dict[int, list[list[int]]]] = {k: {} for k in engines}
    side = next(k for k in engines if k != "off")
    spec = engines[side]
    before = spec.stats()
    for r in range(rounds):
        for i, group in enumerate(groups):
            # alternate which side runs first (off, spec; then spec, off; ...): a fixed
            # order would put any drift of a shared machine on one side
            order = list(engines.items())[::1 if (r + i) % 2 == 0 else -1]
            for k, e in order:
                res, dt = run_batch(e, group, params)
                tokens[k] += sum(len(r.token_ids) for r in res)
                seconds[k] += dt
                tpots[k] += [r.timings.tpot for r in res if r.timings.tpot is not None]
                outputs[k][i] = [r.token_ids for r in res]
    after = spec.stats()
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    draft_steps = after["spec_draft_model_steps"] - before["spec_draft_model_steps"]
    tps = {k: tokens[k] / seconds[k] for k in engines}
    return {"streams": len(groups[0]),
            "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
            "tpot_ms": {k: round(1000 * sum(v) / len(v), 2) if v else None
                        for k, v in tpots.items()},
            "speedup": round(tps[side] / tps["off"], 3),
            "drafted": drafted, "accepted": accepted, "draft_model_steps": draft_steps,
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "identical": outputs[side] == outputs["off"]}


if __name__ == "__main__":
    main()
