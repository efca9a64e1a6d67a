"""Throughput with every request JSON-schema-constrained vs none, side by side in one run,
and what the masks cost per engine step.

    python -m bench.guided plans/smollm2-135m-cpu [--concurrency 32] [--requests 96]
        [--rounds 2] [--compare-libraries]

One in-process Engine. Each round drives it twice, closed-loop at --concurrency (a slot
submits its next request when one ends, so the batch stays full), with the same chat prompts
in the same order: first every request constrained to a JSON schema (greedy), then every
request unconstrained (greedy) with min_tokens = max_tokens = the length its constrained twin
had -- the same tokens per request, so the same batch occupancy step by step, and the
throughput ratio is the cost of the constraints alone. Reported per side: output tokens/s,
mean step time, and the per-step time of the mask work (llguidance filling the bitmasks of
the constrained rows, applying them to the logits, advancing the matchers) and its share of
the step.

--compare-libraries also times llguidance and xgrammar (if installed) filling the bitmasks of
--concurrency rows of this plan's vocabulary along one JSON document (the choice of library).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import defaultdict

import kiln.runtime.sampling as sampling
from kiln.runtime.engine import Engine
from kiln.runtime.guided import GuidedDecoding
from kiln.runtime.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 32},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de", "es", "zh"]},
                      "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"enum": ["FR", "DE", "US", "GB", "JP"]}},
            "required": ["city", "country"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "languages", "address", "active"],
    "additionalProperties": False,
}
DOC = ('{"name":"Ada Lovelace","age":36,"email":"ada@example.org","languages":["en","fr"],'
       '"address":{"city":"London","country":"GB"},"active":true}')


class Timers:
    """Wall time of wrapped callables, per call."""

    def __init__(self):
        self.samples: dict[str, list[float]] = defaultdict(list)

    def wrap(self, name, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.samples[name].append(time.perf_counter() - t0)
        return timed

    def mean_ms(self, name) -> float:
        s = self.samples.get(name) or [0.0]
        return 1e3 * sum(s) / len(s)

    def total(self, name) -> float:
        return sum(self.samples.get(name) or ())


async def drive(engine: Engine, jobs, concurrency: int) -> tuple[list[int], float, int]:
    """Closed loop over (prompt, params) -> (output tokens per job, seconds, constrained
    outputs that are not JSON)."""
    todo = list(enumerate(jobs))
    lengths = [0] * len(jobs)
    bad = 0

    async def worker():
        nonlocal bad
        while todo:
            i, (prompt, params) = todo.pop(0)
            res = await engine.submit(prompt, params).aresult()
            lengths[i] = res.usage.completion_tokens
            if params.guided is not None:
                try:
                    json.loads(res.text)
                except ValueError:
                    bad += 1
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lengths, time.perf_counter() - t0, bad


def run_side(engine, name, jobs, concurrency) -> tuple[dict, list[int]]:
    timers = Timers()
    runner = engine.model_runner
    execute, masks, advance = runner.execute, runner._masks, runner._advance
    apply = sampling.apply_bitmask
    runner.execute = timers.wrap("step", execute)
    runner._masks = timers.wrap("fill", masks)
    runner._advance = timers.wrap("advance", advance)
    sampling.apply_bitmask = timers.wrap("apply", apply)
    try:
        lengths, secs, bad = asyncio.run(drive(engine, jobs, concurrency))
        tokens = sum(lengths)
    finally:
        del runner.execute, runner._masks, runner._advance
        sampling.apply_bitmask = apply
    steps = len(timers.samples["step"])
    mask = sum(timers.total(k) for k in ("fill", "apply", "advance"))
    out = {"side": name, "tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs,
           "steps": steps, "step_ms": timers.mean_ms("step"), "invalid_json": bad,
           "fill_ms": timers.mean_ms("fill"), "apply_ms": timers.mean_ms("apply"),
           "advance_ms": timers.mean_ms("advance"),
           "mask_ms_per_step": 1e3 * mask / max(steps, 1),
           "mask_share": mask / max(timers.total("step"), 1e-9)}
    print(f"  {name:13s} {tokens:6d} tokens in {secs:6.1f} s = {out['tokens_per_s']:6.1f} tok/s"
          f" | {steps} steps, {out['step_ms']:.1f} ms/step | masks {out['mask_ms_per_step']:.2f}"
          f" ms/step (fill {out['fill_ms']:.2f}, apply {out['apply_ms']:.2f}, advance "
          f"{out['advance_ms']:.2f}) = {100 * out['mask_share']:.2f}% of the step"
          + (f" | {bad} invalid" if bad else ""), flush=True)
    return out, lengths


def compare_libraries(engine: Engine, rows: int) -> None:
    """llguidance vs xgrammar: bitmasks of `rows` rows along DOC, on the plan's vocabulary."""
    import torch
    tok = engine.tokenizer
    V = engine.vocab_size
    ids = tok.encode(DOC, add_special_tokens=False)
    eos = tok.eos_token_ids[0]
    logits = torch.randn(rows, V)

    def report(name, setup_s, fills, applies):
        print(f"  {name:10s} setup (tokenizer + compile + {rows} matchers) {1e3 * setup_s:7.1f} ms"
              f" | fill {rows} rows: median {1e3 * statistics.median(fills):.2f} ms, first "
              f"{1e3 * fills[0]:.2f} ms | apply: median {1e3 * statistics.median(applies):.2f}"
              " ms", flush=True)

    import llguidance
    import llguidance.torch as lgt
    from kiln.runtime.guided import apply_bitmask
    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(tok.to_json(), n_vocab=V, eos_token=eos)
    g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                      defaults={"whitespace_flexible": False})
    ms = [llguidance.LLMatcher(lt, g) for _ in range(rows)]
    setup = time.perf_counter() - t0
    bm, ex, fills, applies = lgt.allocate_token_bitmask(rows, V), llguidance.LLExecutor(), [], []
    for t in ids:
        t0 = time.perf_counter()
        lgt.fill_next_token_bitmask_par(ex, [(m, i) for i, m in enumerate(ms)], bm)
        t1 = time.perf_counter()
        apply_bitmask(logits.clone(), list(range(rows)), bm)
        applies.append(time.perf_counter() - t1)
        fills.append(t1 - t0)
        assert all(m.consume_token(t) for m in ms)
    report("llguidance", setup, fills, applies)
    try:
        import xgrammar as xgr
    except ImportError:
        print("  xgrammar   not installed (pip install xgrammar==0.2.9 to compare)")
        return
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo([tok.token_text(i) for i in range(tok.vocab_size)],
                             xgr.VocabType.BYTE_LEVEL, vocab_size=V, stop_token_ids=[eos])
    cg = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                       separators=(",", ":"))
    xm = [xgr.GrammarMatcher(cg) for _ in range(rows)]
    setup = time.perf_counter() - t0
    xbm, batch, fills, applies = xgr.allocate_token_bitmask(rows, V), \
        xgr.BatchGrammarMatcher(), [], []
    for t in ids:
        t0 = time.perf_counter()
        batch.batch_fill_next_token_bitmask(xm, xbm)
        t1 = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits.clone(), xbm)
        applies.append(time.perf_counter() - t1)
        fills.append(t1 - t0)
        assert all(m.accept_token(t) for m in xm)
    report("xgrammar", setup, fills, applies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("plan")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compare-libraries", action="store_true")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    engine = Engine.from_plan(args.plan)
    if engine.config.max_batch_size < args.concurrency:
        print(f"note: the plan runs at most {engine.config.max_batch_size} sequences a step")
    chat = bool(engine.tokenizer.chat_template)
    prompts = [[{"role": "user", "content": f"Invent person number {i}: give their name, age, "
                 "email, languages, city and country as a JSON record."}] if chat
               else f"Person number {i} as a JSON record: " for i in range(args.requests)]
    bound = SamplingParams(max_tokens=min(400, engine.config.max_seq_len // 2), temperature=0,
                           guided=GuidedDecoding.json_schema(SCHEMA))
    engine.generate(prompts[:2], [SamplingParams(max_tokens=8), bound])   # warm up
    if args.compare_libraries:
        print(f"bitmask libraries, {args.concurrency} rows, vocabulary {engine.vocab_size}:")
        compare_libraries(engine, args.concurrency)
    results = []
    for r in range(args.rounds):
        print(f"round {r + 1}: {args.requests} requests at concurrency {args.concurrency}")
        out, lengths = run_side(engine, "json-schema", [(p, bound) for p in prompts],
                                args.concurrency)
        free = [(p, SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True))
                for p, n in zip(prompts, lengths)]
        results += [out, run_side(engine, "unconstrained", free, args.concurrency)[0]]
    ratios = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(results[1::2], results[::2])]
    print(f"constrained / unconstrained throughput: {', '.join(f'{x:.2f}' for x in ratios)} "
          f"(median {statistics.median(ratios):.2f})")
    engine.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "ratios": ratios}, f, indent=2)


if __name__ == "__main__":
    main()
