"""Offline benchmark: the engine in-process on a seeded synthetic workload, against a naive
server on the same weights (Hugging Face transformers, one generate() per request, in order),
plus TTFT with prefix caching on and off for requests sharing a long system prompt.

`kiln bench PLAN --offline` calls run_offline().
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from kiln.runtime.engine import Engine, RequestResult
from kiln.runtime.plan import Plan, load_plan
from kiln.runtime.sampling import SamplingParams


def _pct(xs: Sequence[float], q: float) -> Optional[float]:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _workload(rng: random.Random, n: int, prompt_len: tuple[int, int], output_len: int,
              vocab: int, max_input: int, max_seq: int) -> list[list[int]]:
    hi = min(prompt_len[1], max_input, max_seq - output_len)
    lo = min(prompt_len[0], hi)
    if hi < 1:
        raise ValueError(f"output_len {output_len} leaves no room for a prompt under "
                         f"max_seq_len {max_seq}")
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def _drive(engine: Engine, prompts: list[list[int]], params: SamplingParams,
                 concurrency: int) -> list[RequestResult]:
    sem = asyncio.Semaphore(concurrency)

    async def one(p):
        async with sem:
            return await engine.submit(p, params).aresult()
    return await asyncio.gather(*(one(p) for p in prompts))


def _run(engine: Engine, prompts, params, concurrency) -> dict:
    engine.peak_blocks_used = 0
    t0 = time.perf_counter()
    results = asyncio.run(_drive(engine, prompts, params, concurrency))
    wall = time.perf_counter() - t0
    out_tokens = sum(r.usage.completion_tokens for r in results)
    ttft = [r.timings.ttft for r in results]
    tpot = [r.timings.tpot for r in results]
    return {"concurrency": concurrency, "requests": len(results), "wall_s": wall,
            "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
            "peak_kv_blocks": engine.peak_blocks_used,
            "cached_prompt_tokens": sum(r.usage.cached_tokens for r in results)}


def _naive_hf(plan: Plan, prompts: list[list[int]], output_len: int,
              threads: Optional[int] = None) -> dict:
    """One transformers generate() per request, in order: the baseline server (on `threads`
    compute threads, default torch's)."""
    src = plan.manifest.model.source_path
    if not src:
        return {"skipped": f"the plan records no HF/GGUF source path (model source "
                           f"{plan.manifest.model.source!r})"}
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        return {"skipped": f"transformers is not installed ({e})"}
    path = Path(src)
    if not path.exists():
        return {"skipped": f"source {src} is not on this machine"}
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    n_out = 0
    ttft = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            t1 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False)
            ttft.append(time.perf_counter() - t1)   # a separate prefill-only call, for TTFT
            out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len,
                                 do_sample=False)
            n_out += out.shape[1] - ids.shape[1]
    wall = time.perf_counter() - t0 - sum(ttft)
    return {"requests": len(prompts), "wall_s": wall, "output_tokens": n_out,
            "output_tokens_per_s": n_out / wall, "ttft_p50_s": _pct(ttft, 50)}


def _prefix_workload(engine_factory, rng, vocab, max_prompt, n, output_len, shared_len) -> dict:
    shared_len = min(shared_len, max_prompt - 32)
    system = [rng.randrange(vocab) for _ in range(shared_len)]
    prompts = [system + [rng.randrange(vocab) for _ in range(32)] for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    out = {"shared_prefix_tokens": shared_len, "requests": n}
    for caching in (True, False):
        engine = engine_factory(prefix_caching=caching)
        try:
            r = _run(engine, prompts, params, 1)
        finally:
            engine.shutdown()
        key = "on" if caching else "off"
        out[f"ttft_p50_s_caching_{key}"] = r["ttft_p50_s"]
        out[f"ttft_p99_s_caching_{key}"] = r["ttft_p99_s"]
        out[f"cached_prompt_tokens_caching_{key}"] = r["cached_prompt_tokens"]
    return out


def run_offline(plan_path, requests: int = 64, prompt_len: tuple[int, int] = (64, 512),
                output_len: int = 128, concurrencies: Sequence[int] = (1, 8, 32), seed: int = 0,
                json_path: Optional[str] = None, naive_requests: Optional[int] = 8,
                prefix_requests: int = 16, shared_prefix_len: int = 1024,
                print_fn=print, threads: Optional[int] = None) -> dict:
    """Benchmark a plan in-process; prints a summary and returns (and optionally writes) it.

    naive_requests: how many of the workload's requests the HF baseline runs (it is serial
    and slow; its tokens/s does not depend on the count). None = all of them.
    threads: the engine's compute threads and the baseline's (default: torch's). `kiln bench
    --offline` lays the process out as `kiln serve` does (runtime/compute.py): only the
    engine thread computes multi-threaded while engines run; the baseline runs last, on the
    main thread, after every engine has stopped.
    """
    plan = plan_path if isinstance(plan_path, Plan) else load_plan(plan_path)
    rng = random.Random(seed)
    engine = Engine.from_plan(plan, num_threads=threads)
    tok, cfg = engine.tokenizer, engine.config
    vocab = min(tok.vocab_size, plan.shape.vocab_size)
    prompts = _workload(rng, requests, tuple(prompt_len), output_len, vocab, cfg.input_len,
                        cfg.max_seq_len)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    # compute threads: the engine thread's, and every other thread's (the layout kiln serve uses)
    layout = {"engine": threads or torch.get_num_threads(), "other": torch.get_num_threads()}
    report = {"plan": str(plan.path), "fingerprint": plan.fingerprint, "seed": seed,
              "compute_threads": layout,
              "kv": engine.kv_report, "workload": {"requests": requests,
                                                   "prompt_len": list(prompt_len),
                                                   "output_len": output_len},
              "engine": []}
    try:
        for c in concurrencies:
            r = _run(engine, prompts, params, c)
            report["engine"].append(r)
            print_fn(f"engine  c={c:<3d} {r['output_tokens_per_s']:8.1f} tok/s  "
                     f"TTFT p50 {r['ttft_p50_s']:.3f}s p99 {r['ttft_p99_s']:.3f}s  "
                     f"TPOT p50 {_ms(r['tpot_p50_s'])} p99 {_ms(r['tpot_p99_s'])}  "
                     f"peak KV blocks {r['peak_kv_blocks']}/{engine.kv_report['blocks']}")
    finally:
        engine.shutdown()

    def factory(**kw):
        return Engine.from_plan(plan, num_threads=threads, **kw)
    pre_out = min(16, output_len)
    pre = _prefix_workload(factory, random.Random(seed + 1), vocab,
                           min(cfg.input_len, cfg.max_seq_len - pre_out), prefix_requests,
                           pre_out, shared_prefix_len)
    report["prefix_caching"] = pre
    print_fn(f"prefix  {pre['requests']} requests sharing {pre['shared_prefix_tokens']} tokens: "
             f"TTFT p50 {pre['ttft_p50_s_caching_on']:.3f}s with prefix caching, "
             f"{pre['ttft_p50_s_caching_off']:.3f}s without")
    naive = _naive_hf(plan, prompts[:naive_requests] if naive_requests else prompts, output_len,
                      threads)
    report["naive_hf"] = naive
    if "skipped" in naive:
        print_fn(f"naive   skipped: {naive['skipped']}")
    else:
        best = max(r["output_tokens_per_s"] for r in report["engine"])
        report["speedup_vs_naive"] = best / naive["output_tokens_per_s"]
        print_fn(f"naive   HF generate, one request at a time: "
                 f"{naive['output_tokens_per_s']:.1f} tok/s -> engine is "
                 f"{report['speedup_vs_naive']:.1f}x")
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
    return report


def _ms(x: Optional[float]) -> str:
    return "   n/a" if x is None else f"{x * 1000:5.1f}ms"
