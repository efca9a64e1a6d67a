"""One ISA level's quantized linear kernels against another's on a decode step's linears
(SmolLM2-135M: 30 layers of wqkv, wo, w13, w2 with distinct weights, so the step reads
them from memory), at several batch rows; each level in its own process, alternating rounds.

    python bench/kernel_levels.py --levels avx512_vnni amx --rows 16 32 64 \\
        [--precision int4_a8] [--activations int8] [--threads 2] [--rounds 2]

Prints the median of 7 steps per (level, rows) and round, then each level's median over
rounds and its ratio to the first level's (above 1: faster than the first).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, statistics, sys, time, torch
from kiln.plugins import isa
from kiln.plugins.quant import formats, kernels, ops
level, precision, activations, threads = sys.argv[1:5]
rows = [int(r) for r in sys.argv[5].split(",")]
kernels.load(kernels.build(isa.LEVELS[level]))
torch.set_num_threads(int(threads))
g = torch.Generator().manual_seed(0)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
layers = [[formats.quantize(torch.randn(n, k, generator=g) * 0.05, precision) for n, k in shapes]
          for _ in range(30)]
extra = {} if activations == "none" else {"activations": activations}
out = {}
for m in rows:
    xs = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
    times = []
    for _ in range(7):
        t = time.perf_counter()
        for layer in layers:
            for (n, k), q in zip(shapes, layer):
                ops.quant_linear(xs[k], q, None, **extra)
        times.append(time.perf_counter() - t)
    out[m] = statistics.median(times) * 1e3
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", nargs="+", default=["avx512_vnni", "amx"])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--precision", default="int4_a8", help="formats.quantize's scheme")
    ap.add_argument("--activations", default="none", choices=["none", "int8"],
                    help="int8: W8A8 / W4A8; none: the weight-only op")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    got: dict[str, dict[int, list[float]]] = {lv: {m: [] for m in args.rows} for lv in args.levels}
    for r in range(args.rounds):
        order = args.levels if r % 2 == 0 else list(reversed(args.levels))
        for lv in order:
            p = subprocess.run([sys.executable, "-c", CHILD, lv, args.precision, args.activations,
                                str(args.threads), ",".join(map(str, args.rows))],
                               capture_output=True, text=True, cwd=ROOT, check=True)
            ms = json.loads(p.stdout.strip().splitlines()[-1])
            print(f"round {r + 1} {lv}: " + ", ".join(f"{m} rows {v:.2f} ms"
                                                     for m, v in ms.items()), flush=True)
            for m, v in ms.items():
                got[lv][int(m)].append(v)
    base = args.levels[0]
    for lv in args.levels:
        cells = []
        for m in args.rows:
            med = statistics.median(got[lv][m])
            cells.append(f"{m} rows {med:.2f} ms ({statistics.median(got[base][m]) / med:.2f}x)")
        print(f"{lv:12s} " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
