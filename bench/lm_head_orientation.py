"""The fp32 lm_head at decode rows both ways round through BLAS, interleaved, best of 10:
x W^T (what kiln::linear_fp32 ran before) and (W x^T)^T copied (what it runs from 8 to 64 rows
of a weight of 16384+ outputs).

    python bench/lm_head_orientation.py [--threads 2] [--rows 8 16 32 64]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln.runtime.compute import claim_process, enter_engine_thread  # noqa: E402


def best_ms(fn, n: int = 10) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    a = ap.parse_args()
    claim_process(a.threads)
    import torch
    enter_engine_thread(a.threads)
    w = torch.randn(a.vocab, a.hidden)
    for m in a.rows:
        x, out = torch.randn(m, a.hidden), torch.empty(m, a.vocab)
        wide = best_ms(lambda: torch.mm(x, w.t(), out=out))
        tall = best_ms(lambda: out.copy_(torch.mm(w, x.t()).t()))
        diff = (torch.mm(x, w.t()) - torch.mm(w, x.t()).t()).abs().max().item()
        print(f"{m} rows: x W^T {wide:.1f} ms, (W x^T)^T {tall:.1f} ms, {wide / tall:.2f}x; "
              f"max difference {diff:.2g}; load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
