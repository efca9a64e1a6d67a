"""The quant plugin's linear kernels side by side on SmolLM2's shapes (docs/PERFORMANCE.md).

    python bench/linear_kernels.py [--threads 1] [--rows 1 4 32 64 128 512] [--isa avx2]
        [--shapes 49152x576 ...] [--no-streaming]

W4A8 (kiln::linear_int4_a8) vs W8A8 (kiln::linear_int8_a8: own GEMV below 4 rows, oneDNN's
_int_mm from 4) per shape and number of rows of x, weights in cache (one matrix, timed
repeatedly: kernel speed, not memory bandwidth). Then the streaming read: 30 distinct
w13-sized matrices (more than the caches) at one row of x, fp32 through BLAS (F.linear,
MKL's sgemv) vs kiln::linear_fp32 and kiln::linear_bf16, as GB/s of weights read.
Best of 5-7 repetitions each (the machines are shared; the minimum is the least disturbed).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln.plugins import isa                           # noqa: E402
from kiln.plugins.cpp_build import kernel_path         # noqa: E402
from kiln.plugins.quant import formats, kernels, ops   # noqa: E402

SHAPES = [(3072, 576), (576, 1536), (960, 576), (576, 576)]   # w13, w2, wqkv, wo


def best_us(fn, n: int, reps: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32, 64, 128, 512])
    ap.add_argument("--isa", default=None, help="compile the kernels for this target.isa "
                    "level (default: this machine's), e.g. avx2 for an AVX2-only fleet's code")
    ap.add_argument("--shapes", nargs="+", default=None, metavar="NxK",
                    help="weight shapes (default: SmolLM2's w13 w2 wqkv wo; its tied lm_head "
                    "is 49152x576)")
    ap.add_argument("--no-streaming", action="store_true", help="only the in-cache table")
    args = ap.parse_args()
    shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.lower().split("x"))
                                                 for s in args.shapes]
    lib = kernels.load(kernels.build(isa.level(args.isa)) if args.isa else None)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"{args.threads} thread(s); kernels for {args.isa or 'this machine'}: "
          f"{kernel_path(lib)}; weights in cache; best of 7")
    print(f"{'shape':>10} {'rows':>5} {'W8A8 us':>9} {'W4A8 us':>9} {'W4A8 speed-up':>14}")
    for n, k in shapes:
        w = torch.randn(n, k, generator=g)
        q8, q4 = formats.quantize(w, "int8"), formats.quantize(w, "int4_a8")
        for m in args.rows:
            x = torch.randn(m, k, generator=g)
            reps = max(2, 2000 // m)
            a = best_us(lambda: ops.quant_linear(x, q8, None, activations="int8"), reps)
            b = best_us(lambda: ops.quant_linear(x, q4, None, activations="int8"), reps)
            print(f"{n:>5}x{k:<4} {m:>5} {a:9.1f} {b:9.1f} {a / b:13.2f}x")
    if args.no_streaming:
        return

    layers = 30
    ws = [torch.randn(3072, 576, generator=g) for _ in range(layers)]
    x = torch.randn(1, 576, generator=g)

    def packed(scheme, gs=None, activations="float"):
        qws = [formats.quantize(w, scheme, gs) for w in ws]
        nbytes = sum(t.nbytes for q in qws for t in (q.qweight, q.scales, q.zeros)
                     if t is not None)
        return (lambda: [ops.quant_linear(x, q, None, activations=activations) for q in qws],
                nbytes)

    wb = [w.bfloat16() for w in ws]
    f32_bytes = sum(w.nbytes for w in ws)
    runs = {"fp32 F.linear (MKL sgemv)": (lambda: [F.linear(x, w) for w in ws], f32_bytes),
            "fp32 kiln::linear_fp32": (lambda: [torch.ops.kiln.linear_fp32(x, w, None)
                                                 for w in ws], f32_bytes),
            "bf16 kiln::linear_bf16": (lambda: [torch.ops.kiln.linear_bf16(x, w, None)
                                                 for w in wb], f32_bytes // 2),
            "int8 kiln::linear_int8": packed("int8"),
            "fp8 kiln::linear_fp8": packed("fp8"),
            "int4 g32 kiln::linear_int4": packed("int4", 32),
            "int4 g64 kiln::linear_int4": packed("int4", 64),
            "int4 kiln::linear_int4_rows16": packed("int4_a8"),
            "W8A8 kiln::linear_int8_a8": packed("int8", activations="int8"),
            "W4A8 kiln::linear_int4_a8": packed("int4_a8", activations="int8")}
    print(f"\nstreaming read: {layers} matrices 3072x576 (more than the caches), one row of x; "
          "GB/s of packed weight bytes (codes, scales, zeros or mins)")
    for name, (fn, nbytes) in runs.items():
        t = best_us(fn, 1, reps=5) / 1e6
        print(f"  {name:28} {t * 1e3:6.2f} ms  {nbytes / 2**20:6.1f} MiB  "
              f"{nbytes / t / 1e9:5.1f} GB/s")

if __name__ == "__main__":
    main()
