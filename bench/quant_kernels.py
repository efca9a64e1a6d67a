"""Quantized linear kernels vs torch's fp32 F.linear on SmolLM2-135M shapes, side by side.

    python bench/quant_kernels.py [--rounds 40] [--steps 12] [--group-size 128]

Two tables:
  1. per layer shape, batch 1 and 32: median time of each precision, and its ratio to fp32.
     One weight per shape is timed over and over, so small shapes sit in the shared cache:
     these numbers show the kernels' speed, not the memory system's.
  2. one full decode step's linears: 30 layers x (wqkv, wo, w13, w2) with *distinct* weights
     per layer (the working set is 56-540 MB, far past the cache, as in a real step) plus the
     lm_head kept fp32; batch 1 and 32.
Every measurement interleaves the precisions round by round, so drift in machine load (the
cores are shared) hits all of them alike; medians over rounds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from kiln.plugins.quant import formats, kernels, ops

HIDDEN, INTER, LAYERS, VOCAB = 576, 1536, 30, 49152
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
SHAPES = {  # name: (N out, K in)
    "wqkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "wo": (HIDDEN, HEADS * HEAD_DIM),
    "w13": (2 * INTER, HIDDEN),
    "w2": (HIDDEN, INTER),
    "lm_head": (VOCAB, HIDDEN),
}
PRECISIONS = ("fp32", "int8", "int4", "fp8")


def make_fn(prec: str, w: torch.Tensor, group_size: int):
    """A callable x -> x @ w.T in precision `prec` (fp32 = torch's F.linear)."""
    if prec == "fp32":
        return lambda x: F.linear(x, w)
    qw = formats.quantize(w, prec, group_size if prec == "int4" else None)
    return lambda x: ops.quant_linear(x, qw)


def interleaved(fns: dict, arg_for, rounds: int, reps: int) -> dict[str, float]:
    """Median seconds per call of each fn, rounds interleaved across fns."""
    times = {k: [] for k in fns}
    for name, fn in fns.items():       # warm up
        fn(arg_for(name))
    for _ in range(rounds):
        for name, fn in fns.items():
            a = arg_for(name)
            t0 = time.perf_counter()
            for _ in range(reps):
                fn(a)
            times[name].append((time.perf_counter() - t0) / reps)
    return {k: statistics.median(v) for k, v in times.items()}


def per_shape(rounds: int, group_size: int) -> None:
    print(f"\n## per layer shape (weights cache-resident), int4 group_size={group_size}")
    print(f"{'layer':8} {'N x K':>12} {'M':>3} " +
          " ".join(f"{p:>9}" for p in PRECISIONS) + "   " +
          " ".join(f"{p + '/fp32':>10}" for p in PRECISIONS[1:]))
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.02
        fns = {p: make_fn(p, w, group_size) for p in PRECISIONS}
        for m in (1, 32):
            x = torch.randn(m, k)
            reps = 1 if name == "lm_head" or m > 1 else 10
            t = interleaved(fns, lambda _: x, rounds, reps)
            print(f"{name:8} {f'{n}x{k}':>12} {m:>3} " +
                  " ".join(f"{t[p] * 1e6:8.1f}u" for p in PRECISIONS) + "   " +
                  " ".join(f"{t[p] / t['fp32']:10.2f}" for p in PRECISIONS[1:]))


def full_step(steps: int, group_size: int) -> None:
    print(f"\n## one decode step's linears: {LAYERS} layers x 4 (distinct weights) + lm_head fp32")
    gen = torch.Generator().manual_seed(0)
    lm_head = torch.randn(*SHAPES["lm_head"], generator=gen) * 0.02
    step_fns = {}
    for p in PRECISIONS:
        layers = []
        for _ in range(LAYERS):
            for name in ("wqkv", "wo", "w13", "w2"):
                w = torch.randn(*SHAPES[name], generator=gen) * 0.02
                layers.append((SHAPES[name][1], make_fn(p, w, group_size)))
        step_fns[p] = layers
    head = make_fn("fp32", lm_head, group_size)
    for m in (1, 32):
        xs = {k: torch.randn(m, k) for k in (HIDDEN, INTER)}

        def run_step(layers):
            def f(_):
                for k, fn in layers:
                    fn(xs[k])
                head(xs[HIDDEN])
            return f
        t = interleaved({p: run_step(step_fns[p]) for p in PRECISIONS}, lambda _: None, steps, 1)
        print(f"M={m:<3} " + "  ".join(f"{p} {t[p] * 1e3:7.2f} ms ({t[p] / t['fp32']:.2f}x)"
                                       for p in PRECISIONS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40, help="interleaved rounds per shape")
    ap.add_argument("--steps", type=int, default=12, help="interleaved full decode steps")
    ap.add_argument("--group-size", type=int, default=64, choices=formats.GROUP_SIZES)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0: torch's default); 1 is steadier on shared cores")
    ap.add_argument("--skip-shapes", action="store_true")
    ap.add_argument("--skip-step", action="store_true")
    args = ap.parse_args()
    kernels.load()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with torch.inference_mode():
        if not args.skip_shapes:
            per_shape(args.rounds, args.group_size)
        if not args.skip_step:
            full_step(args.steps, args.group_size)


if __name__ == "__main__":
    main()
