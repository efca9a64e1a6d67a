"""At one stream, how much of the compiled step's rate `kiln serve`
delivers over gRPC, with NVIDIA's perf_analyzer (C++, through genai-perf) and with
`kiln bench --url`'s Python load generator as the client, side by side in one run.

    python bench/serving_efficiency.py plans/smollm2-135m-throughput-cpu --threads 2 --rounds 4

Each round starts a fresh `kiln serve PLAN --threads N` per client (alternating the order),
measures the decode rate (1 / mean inter-token latency; 128 output tokens, greedy: the
KServe requests name no top_k/top_p) and then times the plan's compiled step alone in a new
process with N threads (`bench/vs_llamacpp.step_ms`). Efficiency = rate x step time. With N
below the host's cores the server keeps its serving threads off the step's cores
(`runtime/compute.py`) and the client runs on the serving cores too. Skips perf_analyzer
where genai-perf is not installed (`bash ../shared/tools/genai-perf-setup.sh`).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.genai_perf import genai_perf_env, profile, tokenizer_dir  # noqa: E402
from bench.grpc_vs_inprocess import free_port, wait_serving  # noqa: E402
from kiln.runtime.compute import pin_process, serving_cores  # noqa: E402
from kiln.runtime.tools.loadgen import run_loadgen  # noqa: E402

OUTPUT_TOKENS = 128


def step_alone(plan: Path, threads: int) -> float:
    """The compiled step alone, ms, in a fresh process (never two plans in one)."""
    code = ("import sys; sys.path.insert(0, %r); from bench.vs_llamacpp import step_ms; "
            "print(step_ms(%r, %d))" % (str(ROOT), str(plan), threads))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    return float(out.split()[-1])


def serve(plan: Path, threads: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", str(plan), "--port",
                             str(port), "--metrics-port", str(free_port()), "--threads",
                             str(threads)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=ROOT)
    wait_serving(port, proc)
    return proc, port


def perf_analyzer_rate(env: dict, port: int, plan: Path, threads: int, work: Path) -> float:
    cores = serving_cores(threads)
    prefix = ["taskset", "-c", ",".join(map(str, cores))] if cores else []
    art = Path(tempfile.mkdtemp(dir=work))
    data = profile(env, f"127.0.0.1:{port}", tokenizer_dir(plan, work / "tok"), art / "a",
                   plan.name, concurrency=1, requests=6, input_tokens=32,
                   output_tokens=OUTPUT_TOKENS, prefix=prefix)
    return 1e3 / data["inter_token_latency"]["avg"]


def python_rate(port: int, threads: int) -> float:
    every = sorted(os.sched_getaffinity(0))
    cores = serving_cores(threads)
    if cores:
        pin_process(cores)
    try:
        r = run_loadgen(f"127.0.0.1:{port}", requests=5, output_len=OUTPUT_TOKENS,
                        concurrencies=(1,), print_fn=lambda *a, **k: None)
    finally:
        pin_process(every)
    return 1.0 / r["levels"][0]["tpot_s"]["mean"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan", type=Path)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    plan = args.plan.resolve()
    env = genai_perf_env()
    clients = ["perf_analyzer", "python"] if env is not None else ["python"]
    if env is None:
        print("genai-perf / perf_analyzer not installed: the Python client only")
    rounds: dict[str, list[dict]] = {c: [] for c in clients}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for client in (clients if i % 2 == 0 else clients[::-1]):
                proc, port = serve(plan, args.threads)
                try:
                    rate = (perf_analyzer_rate(env, port, plan, args.threads, Path(tmp))
                            if client == "perf_analyzer" else python_rate(port, args.threads))
                finally:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=60)
                step = step_alone(plan, args.threads)
                r = {"tok_s": rate, "step_ms": step, "efficiency": rate * step / 1e3}
                rounds[client].append(r)
                print(f"round {i} {client:13s} {rate:6.1f} tok/s, step alone {step:.2f} ms: "
                      f"{r['efficiency']:.1%} of the step rate", flush=True)
    summary = {c: statistics.median(r["efficiency"] for r in v) for c, v in rounds.items()}
    for c, e in summary.items():
        print(f"{c}: median {e:.1%} of the step rate "
              f"({', '.join(format(r['efficiency'], '.0%') for r in rounds[c])})")
    if args.json:
        args.json.write_text(json.dumps({"plan": str(args.plan), "threads": args.threads,
                                         "cores": len(os.sched_getaffinity(0)),
                                         "rounds": rounds, "median_efficiency": summary},
                                        indent=1))


if __name__ == "__main__":
    main()
