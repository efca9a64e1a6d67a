"""kiln::linear_fp32 at a decode batch's rows vs the BLAS and oneDNN ways of the same linear,
on SmolLM2's shapes, alternating rounds in one process (docs/PERFORMANCE.md).

    python bench/linear_fp32_dot.py [--threads 2] [--rows 1 8 32 64] [--rounds 5]
        [--shapes 49152x576 ...] [--bytes-out 64] [--isa avx2]

Per shape (out x in) and rows of x, each round times every way once (best of a few calls),
the ways in turn, round after round; reported: the median over rounds of each way's time
and of its ratio to kiln's. The weights of each way are --bytes-out MiB of distinct copies
of the matrix, used in turn (more than the L3: each call reads its weights from memory, as a
plan's step does).
  kiln       torch.ops.kiln.linear_fp32 (8-64 rows: its register-blocked dot products;
             1-7 rows: its GEMV)
  mkl        F.linear (MKL's sgemm / sgemv)
  mkl_wxt    (W x^T)^T through MKL (kiln's lm_head path before the dot products)
  onednn     oneDNN's prepacked weight (torch.ops.mkldnn._reorder_linear_weight +
             _linear_pointwise, what Inductor's freezing weight prepack emits), packed for
             these rows
Checks first that kiln's rows equal F.linear's within fp32 rounding and that a row's output
does not depend on the batch (bits of row 0 at every number of rows from 8).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln.plugins import isa                # noqa: E402
from kiln.plugins.quant import kernels   # noqa: E402

SHAPES = [(3072, 576), (576, 1536), (960, 576), (576, 576), (49152, 576)]


def ways(ws: list[torch.Tensor], m: int) -> dict:
    """name -> (fn(x, i) on the i-th copy)"""
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in ws]
    return {
        "kiln": lambda x, i: torch.ops.kiln.linear_fp32(x, ws[i], None),
        "mkl": lambda x, i: F.linear(x, ws[i]),
        "mkl_wxt": lambda x, i: torch.mm(ws[i], x.t()).t().contiguous(),
        "onednn": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none",
                                                                  [], ""),
    }


def time_way(fn, x, copies: int, calls: int) -> float:
    best = float("inf")
    for c in range(calls):
        t = time.perf_counter()
        fn(x, c % copies)
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def check(w: torch.Tensor) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, w.shape[1], generator=g)
    got = torch.ops.kiln.linear_fp32(x, w, None)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-4, atol=1e-4)
    rows = {torch.ops.kiln.linear_fp32(x[:m], w, None)[0].numpy().tobytes() for m in range(8, 65)}
    assert len(rows) == 1, f"row 0 differs across batch sizes ({len(rows)} distinct)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES])
    ap.add_argument("--bytes-out", type=int, default=64, help="MiB of weight copies per way")
    ap.add_argument("--isa", default=None, help="compile the kernels for this target.isa "
                    "(default: this machine's level)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kernels.load(kernels.build(isa.level(a.isa)) if a.isa else None)
    print(f"kernels for {a.isa or 'this machine'}; threads {a.threads}; median of {a.rounds} "
          "alternating rounds; us per call "
          "(ratio: way / kiln)")
    for shape in a.shapes:
        n, k = map(int, shape.split("x"))
        copies = max(1, (a.bytes_out << 20) // (n * k * 4))
        ws = [torch.randn(n, k) for _ in range(copies)]
        check(ws[0])
        for m in a.rows:
            x = torch.randn(m, k)
            fns = ways(ws, m)
            times = {name: [] for name in fns}
            for _ in range(a.rounds):
                for name, fn in fns.items():
                    times[name].append(time_way(fn, x, copies, max(3, copies)))
            med = {name: statistics.median(t) for name, t in times.items()}
            ratios = {name: statistics.median(t / b for t, b in zip(times[name], times["kiln"]))
                      for name in fns}
            cols = "  ".join(f"{name} {med[name]:8.0f} ({ratios[name]:.2f})" for name in fns)
            print(f"{shape:>10} rows {m:3d}: {cols}", flush=True)


if __name__ == "__main__":
    main()
