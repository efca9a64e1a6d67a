"""Multi-LoRA throughput: a LoRA plan serving its base model vs the same plan serving many
adapters at once, side by side in one run (not a test).

    python -m bench.lora plans/smollm2-135m-lora-cpu [--adapters 8] [--streams 32]
        [--rounds 2] [--max-tokens 64] [--threads 2] [--out bench/results/lora.json]

One in-process Engine. Random adapters in PEFT's format (random A, non-zero B, ranks 8 and 16
alternating, every target module of the plan) are written to a temporary directory and
loaded (mean load time reported). Each round runs `--streams` requests at once on the base
model, then the same requests spread over the adapters (request i on adapter i % n), greedy,
the same number of output tokens each (ignore_eos): output tokens/s over the batch's wall
time, and the ratio LoRA / base. Then, while `--streams` adapter requests run, one more
adapter is loaded: its load time, and whether every request finished.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from kiln.runtime.engine import Engine
from kiln.runtime.plan import read_manifest
from kiln.runtime.sampling import SamplingParams

PROMPTS = ["Write a short poem about the sea.",
           "What are three tips for staying focused while studying?",
           "Explain what a compiler does, in a few sentences.",
           "Give me a recipe idea for a quick vegetarian dinner."]
_PART = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
         "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(path: Path, lora, num_layers: int, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter of `rank` on every target module of the plan."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(num_layers):
        for m in lora.target_modules:
            key = f"base_model.model.model.layers.{i}.{_PART[m]}.{m}"
            n_in, n_out = lora.in_features[m], lora.out_features[m]
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in ** .5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
         "target_modules": list(lora.target_modules)}))
    return path


def run_batch(engine: Engine, adapters: list, max_tokens: int) -> tuple[int, float, int]:
    """Requests at once (request i on adapters[i]) -> (output tokens, wall s, failures)."""
    chat = bool(engine.tokenizer.chat_template)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(adapters))]
    t0 = time.perf_counter()
    res = engine.generate([[{"role": "user", "content": p}] if chat else p for p in prompts],
                          [SamplingParams(max_tokens=max_tokens, temperature=0,
                                          ignore_eos=True, adapter=a) for a in adapters])
    wall = time.perf_counter() - t0
    failed = sum(1 for r in res if r.finish_reason not in ("length", "stop"))
    return sum(len(r.token_ids) for r in res), wall, failed


def load_during_run(engine: Engine, names: list, extra: Path, max_tokens: int) -> dict:
    """Load one more adapter while len(names) adapter requests run."""
    out = {}

    def load():
        time.sleep(0.5)
        t0 = time.perf_counter()
        engine.adapters.load("extra", extra)
        out["load_end"] = time.perf_counter()
        out["load_s"] = out["load_end"] - t0
    th = threading.Thread(target=load)
    th.start()
    tokens, wall, failed = run_batch(engine, names, max_tokens)
    end = time.perf_counter()
    th.join()
    return {"load_s": out["load_s"], "loaded_while_running": out["load_end"] < end,
            "tokens": tokens, "wall_s": wall, "failed": failed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = Engine.from_plan(args.plan, num_threads=args.threads)
    if engine.adapters is None:
        raise SystemExit(f"{args.plan} was built without a lora section")
    lora, layers = engine.adapters.section, engine.executor.layout.num_layers
    tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-lora-"))
    names, loads = [f"a{i}" for i in range(args.adapters)], []
    for i, n in enumerate(names):
        d = write_adapter(tmp / n, lora, layers, lora.max_rank // (1 + i % 2), seed=i)
        t0 = time.perf_counter()
        engine.adapters.load(n, d)
        loads.append(time.perf_counter() - t0)
    extra = write_adapter(tmp / "extra", lora, layers, lora.max_rank, seed=99)
    spread = [names[i % len(names)] for i in range(args.streams)]
    rows = {"base": [], "lora": []}
    run_batch(engine, spread[:4], 8)                              # warm-up
    for r in range(args.rounds):
        for side, adapters in (("base", [None] * args.streams), ("lora", spread)):
            tokens, wall, failed = run_batch(engine, adapters, args.max_tokens)
            rows[side].append({"tokens": tokens, "wall_s": wall, "failed": failed,
                               "tok_s": tokens / wall})
            print(f"round {r} {side:4s}: {tokens / wall:7.1f} tok/s ({tokens} tokens, "
                  f"{wall:.2f}s, {failed} failed)", flush=True)
    during = load_during_run(engine, spread, extra, args.max_tokens)
    engine.shutdown()
    tok_s = {s: sum(x["tokens"] for x in v) / sum(x["wall_s"] for x in v)
             for s, v in rows.items()}
    result = {"plan": args.plan, "isa": read_manifest(args.plan).target.isa,
              "machine": platform.processor() or platform.machine(),
              "threads": args.threads, "streams": args.streams, "adapters": args.adapters,
              "max_tokens": args.max_tokens, "rounds": rows, "tok_s": tok_s,
              "ratio": tok_s["lora"] / tok_s["base"],
              "load_s_mean": statistics.mean(loads), "load_during_run": during}
    print(f"base {tok_s['base']:.1f} tok/s, {args.adapters} adapters {tok_s['lora']:.1f} "
          f"tok/s: ratio {result['ratio']:.2f}; load {result['load_s_mean'] * 1e3:.0f} ms "
          f"(idle), {during['load_s'] * 1e3:.0f} ms with {args.streams} streams running "
          f"(finished before them: {during['loaded_while_running']}), {during['failed']} "
          "failed")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
