"""N-gram speculative decoding vs none on one plan, side by side in one run (not a test).

    python -m bench.speculative plans/smollm2-135m-cpu [--rounds 2] [--max-tokens 96]
        [--draft 4] [--threads 2] [--out bench/results/speculative.json]

Two in-process Engines over the same plan: one with speculation (n-gram, --draft tokens)
and one without. Each round runs every prompt on each engine alternately, single stream
(one request at a time), greedy: (a) input-grounded prompts (quote, edit or repeat a given
text: the output copies the input, where prompt lookup proposes well) and (b) open chat
prompts. Reported per kind and side: output tokens/s (sum of tokens over sum of request
wall times), the acceptance rate (accepted / drafted), the mean tokens per step, and whether
every output is token-for-token the one without speculation.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from kiln.runtime.engine import Engine
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.speculative import SpeculativeConfig

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


def run_one(engine: Engine, prompt: str, params: SamplingParams) -> tuple[list[int], float]:
    """One request alone -> (its tokens, wall seconds)."""
    t0 = time.perf_counter()
    res = engine.generate([[{"role": "user", "content": prompt}]], params)[0]
    return res.token_ids, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--draft", type=int, default=4, help="max_draft_tokens")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    spec = SpeculativeConfig(max_draft_tokens=args.draft)
    engines = {"off": Engine.from_plan(args.plan, num_threads=args.threads, speculative=False),
               "ngram": Engine.from_plan(args.plan, num_threads=args.threads,
                                         speculative=spec)}
    try:
        for e in engines.values():      # warm-up: first steps of a fresh engine are slower
            run_one(e, CHAT[0], SamplingParams(max_tokens=8, temperature=0))
        report = {"plan": args.plan, "machine": platform.processor() or platform.machine(),
                  "threads": args.threads, "max_tokens": args.max_tokens,
                  "speculative": spec.__dict__, "kinds": {}}
        for kind, prompts in (("grounded", GROUNDED), ("chat", CHAT)):
            report["kinds"][kind] = measure(engines, prompts, params, args.rounds)
    finally:
        for e in engines.values():
            e.shutdown()
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


def measure(engines: dict[str, Engine], prompts: list[str], params: SamplingParams,
            rounds: int) -> dict:
    """Alternating rounds over the prompts -> per side tokens/s, and the comparison."""
    tokens = {k: 0 for k in engines}
    seconds = {k: 0.0 for k in engines}
    outputs: dict[str, dict[int, list[int]]] = {k: {} for k in engines}
    spec = engines["ngram"]
    before = spec.stats()
    for _ in range(rounds):
        for i, p in enumerate(prompts):
            for k, e in engines.items():
                toks, dt = run_one(e, p, params)
                tokens[k] += len(toks)
                seconds[k] += dt
                outputs[k][i] = toks
    after = spec.stats()
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    tps = {k: tokens[k] / seconds[k] for k in engines}
    return {"tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
            "speedup": round(tps["ngram"] / tps["off"], 3),
            "drafted": drafted, "accepted": accepted,
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "identical": outputs["ngram"] == outputs["off"]}


if __name__ == "__main__":
    main()
