"""Mixture-of-experts decode, Kiln vs llama.cpp on the same GGUF weights, side by side in one
run (docs/PERFORMANCE.md).

    python bench/moe_vs_llamacpp.py [--shapes mixtral qwen3moe] [--threads 2] [--rounds 3]
        [--ntg 64] [--llamacpp-bin /tmp/llamacpp/llama-build/bin] [--json FILE]

Two random models made with transformers' own classes at a size that fits a 2-core host:
  mixtral   Mixtral-shaped: 8 experts, top-2 (softmax, top-k renormalized), wide experts
  qwen3moe  Qwen3-MoE-shaped: 64 small experts, top-8, q/k norm
Each is written once as a Q8_0 GGUF (the tests' writer, tests/model/test_sources.py); llama.cpp runs that file, Kiln
builds an int8 plan from it (Q8_0 read exactly, re-quantized per row for its int8 kernels),
AOTInductor, its accuracy gate on. Per round and shape, one system at a time: llama.cpp's
llama-bench (tg, batch 1) and llama-batched-bench (32 parallel sequences), then `kiln serve`
driven over gRPC at concurrency 1 and 32 (bench/vs_llamacpp.py's rounds). Ratios of medians.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.vs_llamacpp import ensure_llamacpp, kiln_round, llamacpp_round  # noqa: E402

COMMON = dict(vocab_size=320, num_hidden_layers=6, num_attention_heads=16,
              num_key_value_heads=4, hidden_size=1024, max_position_embeddings=1024,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
SHAPES = {
    "mixtral": ("llama", "MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=1792, num_local_experts=8, num_experts_per_tok=2)),
    "qwen3moe": ("qwen3moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                 dict(intermediate_size=1792, moe_intermediate_size=256, num_experts=64,
                      num_experts_per_tok=8, head_dim=64, norm_topk_prob=True)),
}


def make_gguf(shape: str, out: Path) -> Path:
    """The shape's random model (seed 0) as a Q8_0 GGUF (cached by path)."""
    path = out / f"{shape}-q8_0.gguf"
    if path.exists():
        return path
    import torch
    import transformers

    from tests.model.test_sources import _write_gguf

    arch, cfg_cls, model_cls, extra = SHAPES[shape]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**COMMON, **extra)
    model = getattr(transformers, model_cls)(cfg).eval()
    tmp = path.with_suffix(".tmp")
    _write_gguf(tmp, arch, model, qtype="Q8_0")
    tmp.rename(path)
    return path


def build_plan(shape: str, gguf: Path, out: Path) -> Path:
    """Kiln's int8 plan of the GGUF (skipped when up to date)."""
    from kiln.builder.build import build
    from kiln.builder.progress import Progress

    spec = {"name": f"moe-{shape}-int8", "model": {"source": str(gguf)},
            "target": {"device": "cpu", "backend": "aoti"}, "precision": {"weights": "int8"},
            "limits": {"max_batch_size": 32, "max_seq_len": 512, "max_num_tokens": 256},
            "kv_cache": {"tokens_per_block": 16, "memory": "512MiB"},
            "accuracy": {"eval_tokens": 2048}}
    path = out / f"moe-{shape}-int8.yaml"
    path.write_text(yaml.safe_dump(spec))
    return build(path, out / "plans" / spec["name"], progress=Progress(enabled=True)).path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ntg", type=int, default=64)
    ap.add_argument("--requests32", type=int, default=32)
    ap.add_argument("--work", default="/tmp/kiln-moe-bench")
    ap.add_argument("--llamacpp-bin", default="/tmp/llamacpp/llama-build/bin")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    bin_dir = ensure_llamacpp(Path(args.llamacpp_bin))
    models = {}
    for shape in args.shapes:
        gguf = make_gguf(shape, work)
        models[shape] = (gguf, str(build_plan(shape, gguf, work)))
    rounds = {s: {"llama.cpp": [], "kiln": []} for s in args.shapes}
    for i in range(args.rounds):
        for shape, (gguf, plan) in models.items():
            rounds[shape]["llama.cpp"].append(llamacpp_round(bin_dir, gguf, args.threads,
                                                             args.ntg))
            r = kiln_round(plan, args.threads, args.ntg, args.requests32)
            rounds[shape]["kiln"].append({k: v for k, v in r.items() if not isinstance(v, dict)})
        print(f"round {i + 1}: " + json.dumps(rounds), flush=True)
    report = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "rounds": rounds,
              "shapes": {s: {**COMMON, **SHAPES[s][3]} for s in args.shapes}, "median": {}}
    from kiln.plugins.isa import cpu_flags, host_level

    report["host_isa"] = host_level(cpu_flags()).name
    print(f"{'':22} {'llama.cpp':>10} {'kiln':>10} {'ratio':>7}   (decode tok/s, "
          f"{args.threads} threads, host {report['host_isa']})")
    for shape in args.shapes:
        med = {who: {k: statistics.median(r[k] for r in rs) for k in ("tg1_tok_s", "tg32_tok_s")}
               for who, rs in rounds[shape].items()}
        report["median"][shape] = med
        for key, label in (("tg1_tok_s", "batch 1"), ("tg32_tok_s", "batch 32")):
            a, b = med["llama.cpp"][key], med["kiln"][key]
            print(f"{shape + ' ' + label:22} {a:10.1f} {b:10.1f} {b / a:6.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
