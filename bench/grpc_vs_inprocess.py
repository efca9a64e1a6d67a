"""How much of the engine's throughput survives the gRPC front end, side by side in one run.

    python -m bench.grpc_vs_inprocess plans/smollm2-135m-cpu [--concurrency 32] [--requests 64]

1. Starts `kiln serve PLAN` on a free loopback port and drives it with `kiln bench --url`'s
   load generator (KServe ModelStreamInfer, streaming, greedy, exactly N output tokens).
2. Stops it, then drives an in-process Engine from the same plan with the same prompts and
   the same sampling (greedy, min_tokens = max_tokens = N), closed-loop at the same
   concurrency.
3. Prints output tokens/s of both and the ratio (the issue's target: >= 0.85 at 32).
Repeats 1-2 --rounds times (alternating, so load on a shared machine hits both sides alike)
and reports the median ratio.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kiln serve exited with {proc.returncode}")
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise RuntimeError("kiln serve did not become ready")


async def drive_engine(engine, prompts, params, concurrency) -> tuple[int, float]:
    todo = list(prompts)
    tokens = 0

    async def worker():
        nonlocal tokens
        while todo:
            res = await engine.submit(todo.pop(0), params).aresult()
            tokens += res.usage.completion_tokens

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tokens, time.perf_counter() - t0


def grpc_round(args) -> tuple[dict, list[str]]:
    """Starts `kiln serve`, drives it with the load generator, stops it: (its report, the
    prompts it sent)."""
    from kiln.runtime.tools.loadgen import _workload, run_loadgen

    port, mport = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", args.plan, "--port",
                             str(port), "--metrics-port", str(mport)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_serving(port, proc)
        url = f"127.0.0.1:{port}"
        _, prompts, _ = _workload(url, args.requests, args.output_len, (16, 128), 0, None)
        return run_loadgen(url, requests=args.requests, output_len=args.output_len,
                           concurrencies=(args.concurrency,), seed=0), prompts
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("plan")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternate gRPC and in-process this many times; the median ratio "
                         "is the result (a shared machine's load moves single runs a lot)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from kiln.runtime.engine import Engine
    from kiln.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len,
                            temperature=0.0)
    rounds = []
    for r in range(args.rounds):
        grpc_report, prompts = grpc_round(args)       # the engine below is not loaded yet
        engine = Engine.from_plan(args.plan)
        try:
            asyncio.run(drive_engine(engine, prompts[:2], SamplingParams(max_tokens=8), 2))
            tokens, wall = asyncio.run(drive_engine(engine, prompts, params, args.concurrency))
        finally:
            engine.shutdown()
        grpc_tps = grpc_report["levels"][0]["output_tokens_per_s"]
        inproc_tps = tokens / wall
        rounds.append({"grpc_tokens_per_s": grpc_tps, "inprocess_tokens_per_s": inproc_tps,
                       "ratio": grpc_tps / inproc_tps, "grpc": grpc_report})
        print(f"round {r + 1}: concurrency {args.concurrency}: gRPC {grpc_tps:.1f} tok/s, "
              f"in-process {inproc_tps:.1f} tok/s -> {grpc_tps / inproc_tps:.0%}", flush=True)
    ratio = statistics.median(r["ratio"] for r in rounds)
    print(f"median of {len(rounds)} rounds: gRPC keeps {ratio:.0%} of in-process throughput "
          f"(rounds: {', '.join(format(r['ratio'], '.0%') for r in rounds)})")
    if args.json:
        Path(args.json).write_text(json.dumps({"concurrency": args.concurrency,
                                               "ratio": ratio, "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
