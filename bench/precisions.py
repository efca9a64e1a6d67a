"""SmolLM2-135M plans at fp32, bf16, fp8, int8 and int4, side by side (README "Precisions").

    python bench/precisions.py [--rounds 7] [--threads 1 2] [--context 128] [--build]
        [--precisions fp32 bf16 fp8 int8 int4 int8-kv8 fp8-kv8]

A precision name is a plan: `fp32` is plans/smollm2-135m-cpu, any other `X` is
plans/smollm2-135m-X-cpu (`int8-kv8`: int8 weights and an int8 KV cache).
Per plan: size on disk, KV cache dtype and the tokens one GiB of pool holds, perplexity on the
accuracy gate's pydoc tokens and its increase over the fp32 model, top-1 agreement (both from
plan.json: what the build's gate measured), then engine step time through each plan's Executor:
  batch 1:  one decode token with --context tokens of context
  batch 32: 32 sequences decoding one token each, --context tokens of context each
Each round runs every plan once in turn (interleaved, so drift in machine load hits all alike);
medians over rounds. Each plan's batch-1 steps are timed between two measurements of the
machine's read rate (torch.sum over 1 GiB, same threads; the host's other tenants move it by
half within a minute), and the batch-1 step is given as a multiple of its bandwidth floor,
plan size / that read rate, per round, the median over rounds (the plan's bytes are its
weights plus about 3 MB of tokenizer and code; the step reads every weight once, the tied
embedding table as the lm_head). --build builds missing
plans first (model_specs/smollm2-135m-*-cpu.yaml).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kiln.plugins.paged_kv import kv_format                         # noqa: E402
from kiln.runtime.executor import Executor, KVLayout, ModelInput   # noqa: E402
from kiln.runtime.plan import load_plan, load_step_fn, read_manifest  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp8", "int8", "int4")


def plan_dir(prec: str, isa: str | None = None) -> Path:
    name = "smollm2-135m-cpu" if prec == "fp32" else f"smollm2-135m-{prec}-cpu"
    return ROOT / "plans" / (f"{name}-{isa}" if isa else name)


def spec_path(prec: str) -> Path:
    return ROOT / "model_specs" / ("smollm2-135m-cpu.yaml" if prec == "fp32"
                                   else f"smollm2-135m-{prec}-cpu.yaml")


class Runner:
    """A plan's engine with a small KV pool and the two batches, prefilled once."""

    def __init__(self, path: Path, context: int, batch: int = 32):
        self.plan = load_plan(path)
        m = self.plan.manifest
        cfg, bs = m.model.shape, m.kv_cache.tokens_per_block
        per_seq = -(-(context + 1) // bs)
        layout = KVLayout(cfg.num_layers, batch * per_seq + 1, bs, cfg.num_kv_heads,
                          cfg.head_dim, m.kv_cache.dtype)
        self.ex = Executor(load_step_fn(self.plan), layout)
        g = torch.Generator().manual_seed(0)
        self.tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
        step = m.limits.max_num_tokens
        for i, table in enumerate(self.tables):            # prefill `context` tokens per seq
            toks = torch.randint(0, cfg.vocab_size, (context,), generator=g).tolist()
            for s in range(0, context, step):
                self.ex.execute(ModelInput.build([toks[s:s + step]], [s], [table], bs))
        self.batches = {n: ModelInput.build([[7 + i] for i in range(n)], [context] * n,
                                            self.tables[:n], bs) for n in (1, batch)}

    def time_step(self, n: int, reps: int) -> float:
        inp = self.batches[n]
        self.ex.execute(inp)
        t = time.perf_counter()
        for _ in range(reps):
            self.ex.execute(inp)
        return (time.perf_counter() - t) / reps


_READ = None


def read_rate(reps: int = 2) -> float:
    """Bytes per second torch.sum reads from a 1 GiB float32 tensor (best of `reps`)."""
    global _READ
    if _READ is None:
        _READ = torch.ones(1 << 28)   # ones: written, so every page is really there
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        _READ.sum()
        best = min(best, time.perf_counter() - t)
    return _READ.nbytes / best


def isa_spec(prec: str, isa: str) -> Path:
    """The precision's spec with target.isa pinned (written beside the plans)."""
    import yaml

    data = yaml.safe_load(spec_path(prec).read_text())
    data["name"] += f"-{isa}"
    data.setdefault("target", {})["isa"] = isa
    out = ROOT / "plans" / ".specs" / f"{data['name']}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def plan_row(prec: str, isa: str | None = None) -> dict:
    m = read_manifest(plan_dir(prec, isa))
    acc = m.accuracy
    shape, kv = m.model.shape, m.kv_cache.dtype
    per_tok = kv_format.bytes_per_token(kv, shape.num_layers, shape.num_kv_heads,
                                        shape.head_dim)
    return {"size": m.total_bytes, "kv": kv,
            "kv_tokens_per_gib": (1 << 30) // per_tok,
            "ppl": acc and acc.ppl, "ppl_increase": acc and acc.ppl_increase,
            "top1": acc and acc.top1_agreement, "ref_ppl": acc and acc.ref_ppl}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS))
    ap.add_argument("--context", type=int, default=128, help="tokens of context per sequence")
    ap.add_argument("--build", action="store_true", help="build missing plans first")
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--isa", default=None, help="use (and with --build, build) the plans "
                    "compiled for this target.isa level: plans/<name>-<isa>")
    args = ap.parse_args()
    if args.build:
        from kiln.builder.build import build
        for p in args.precisions:
            build(isa_spec(p, args.isa) if args.isa else spec_path(p), plan_dir(p, args.isa))
    rows = {p: plan_row(p, args.isa) for p in args.precisions}
    ref = next((r["ref_ppl"] for r in rows.values() if r["ref_ppl"]), None)
    if "fp32" in rows and ref:
        rows["fp32"].update(ppl=ref, ppl_increase=0.0, top1=1.0)
    runners = {p: Runner(plan_dir(p, args.isa), args.context) for p in args.precisions}
    for th in args.threads:
        torch.set_num_threads(th)
        times = {(p, n): [] for p in runners for n in (1, 32)}
        floors = {p: [] for p in runners}
        rates = []
        for _ in range(args.rounds):
            for p, r in runners.items():
                # the read rate right before and after the plan's batch-1 steps: the host's
                # other tenants move it by half within a minute
                before = read_rate()
                t = r.time_step(1, reps=5)
                rate = (before + read_rate()) / 2
                rates.append(rate)
                times[(p, 1)].append(t)
                floors[p].append(t / (rows[p]["size"] / rate))   # every weight byte read once
                times[(p, 32)].append(r.time_step(32, reps=2))
        rate = statistics.median(rates)
        for p in runners:
            rows[p][f"b1_ms_t{th}"] = statistics.median(times[(p, 1)]) * 1e3
            rows[p][f"b32_tok_s_t{th}"] = 32 / statistics.median(times[(p, 32)])
            rows[p][f"read_gb_s_t{th}"] = rate / 1e9
            rows[p][f"b1_x_floor_t{th}"] = statistics.median(floors[p])
            rows[p][f"b1_x_floor_rounds_t{th}"] = floors[p]
        print(f"{th} thread(s): read rate {rate / 1e9:.1f} GB/s (median beside the batch-1 "
              f"steps; {min(rates) / 1e9:.1f}-{max(rates) / 1e9:.1f})")
    base = rows.get("fp32")
    isas = {read_manifest(plan_dir(p, args.isa)).target.isa for p in args.precisions}
    print(f"context {args.context} tokens per sequence; medians of {args.rounds} rounds; "
          f"CPU ISA level of the plans: {', '.join(sorted(isas))}")
    head = ["precision", "plan size", "x fp32", "KV", "KV tokens/GiB", "ppl", "increase",
            "top-1"]
    for th in args.threads:
        head += [f"b1 ms ({th}t)", "x fp32", "x floor", f"b32 tok/s ({th}t)", "x fp32"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for p, r in rows.items():
        ratio = lambda k, inv=False: (f"{(base[k] / r[k] if inv else r[k] / base[k]):.2f}"
                                      if base else "-")
        cells = [p, f"{r['size'] / 2**20:.0f} MiB", ratio("size"), r["kv"],
                 f"{r['kv_tokens_per_gib']:,}",
                 f"{r['ppl']:.3f}" if r["ppl"] else "-",
                 f"{r['ppl_increase']:+.2%}" if r["ppl_increase"] is not None else "-",
                 f"{r['top1']:.1%}" if r["top1"] is not None else "-"]
        for th in args.threads:
            cells += [f"{r[f'b1_ms_t{th}']:.1f}", ratio(f"b1_ms_t{th}"),
                      f"{r[f'b1_x_floor_t{th}']:.2f}",
                      f"{r[f'b32_tok_s_t{th}']:.0f}", ratio(f"b32_tok_s_t{th}")]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
