"""Where a single stream's time goes inside `kiln serve`: the engine thread's compiled step,
the Python around it, and when the token's serving path runs (docs/PERFORMANCE.md, serving).

    python bench/serve_timeline.py [--plan plans/smollm2-135m-throughput-cpu] [--threads 2]
        [--requests 8] [--tokens 128] [--json F]

A child process runs `kiln serve PLAN` unchanged but for timers: the engine thread's phases
(scheduling, ModelInput.build, the compiled step, the sampler, update) are wrapped, and the
event loop's receipt of each output (streams._deliver) and each KServe response it builds
are time-stamped. This process drives it over gRPC with `kiln bench --url`'s load generator
(KServe ModelStreamInfer, one stream, greedy, exactly --tokens tokens a request), stops it,
and prints the medians: the step inside the server, the period between steps, each phase,
and where the serving path's events fall (inside a step, or in the gap after one).

The engine thread holds each step's outputs until it launches the next step, which runs without
the GIL (runtime/streams.hold_posts, plugins/engine_call): the serving path is expected inside
the steps. A plan built before the engine-call library runs its step holding the GIL.
"""
from __future__ import annotations

import argparse
import atexit
import bisect
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _median_us(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6 if xs else float("nan")


def serve_instrumented(plan: str, threads: int, port: int, mport: int, out: str) -> None:
    """The child: `kiln serve` with the engine's phases and the serving events timed."""
    from kiln.runtime.compute import claim_process
    claim_process(threads)                       # before torch, as `kiln serve` does
    import kiln.runtime.engine as engine_mod
    import kiln.runtime.executor as executor_mod
    import kiln.runtime.model_runner as runner_mod
    import kiln.runtime.sampling as sampling_mod
    import kiln.runtime.server.kserve as kserve_mod
    import kiln.runtime.streams as streams_mod
    from kiln.plugins.inflight_batching import scheduler as scheduler_mod

    phases: dict[str, list[float]] = {}
    steps: list[tuple[float, float]] = []        # (start, end) of each compiled step
    events: dict[str, list[float]] = {"deliver": [], "response": []}

    def timed(cls, name: str, key: str) -> None:
        f = getattr(cls, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                phases.setdefault(key, []).append(time.perf_counter() - t0)
        setattr(cls, name, wrapper)

    for cls, name, key in ((scheduler_mod.Scheduler, "schedule", "schedule"),
                           (runner_mod.ModelRunner, "prepare", "ModelInput.build"),
                           (sampling_mod.Sampler, "__call__", "sampler"),
                           (engine_mod.Engine, "update", "update (emit, deliver)")):
        timed(cls, name, key)

    execute = executor_mod.Executor.execute

    def execute_timed(self, batch):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return execute(self, batch)
        finally:
            steps.append((t0, time.perf_counter(), time.thread_time() - c0))
    executor_mod.Executor.execute = execute_timed

    deliver = streams_mod._deliver

    def deliver_stamped(batch):
        events["deliver"].append(time.perf_counter())
        return deliver(batch)
    streams_mod._deliver = deliver_stamped
    response = kserve_mod.response

    def response_stamped(*a, **k):
        events["response"].append(time.perf_counter())
        return response(*a, **k)
    kserve_mod.response = response_stamped

    def report() -> None:
        Path(out).write_text(json.dumps({"phases": phases, "steps": steps, "events": events}))
    atexit.register(report)
    from kiln.cli import main
    sys.argv = ["kiln", "serve", plan, "--port", str(port), "--metrics-port", str(mport),
                "--threads", str(threads)]
    main()


def summarize(data: dict) -> dict:
    steps = [(s, e) for s, e, _ in data["steps"]]
    starts = [s for s, _ in steps]
    periods = [b[0] - a[0] for a, b in zip(steps, steps[1:]) if b[0] - a[0] < 0.05]
    res = {"steps": len(steps), "step_us": _median_us([e - s for s, e in steps]),
           # the engine thread's own CPU in the step: below step_us, it waited (for the GIL
           # as the call returned, or for a core)
           "step_engine_thread_cpu_us": _median_us([c for _, _, c in data["steps"]]),
           "period_us": _median_us(periods),
           "phases_us": {k: _median_us(v) for k, v in data["phases"].items()}, "events": {}}
    for kind, stamps in data["events"].items():
        inside, after = [], []
        for t in stamps:
            i = bisect.bisect_right(starts, t) - 1
            if not 0 <= i < len(steps) - 1:
                continue
            s, e = steps[i]
            if t <= e:
                inside.append((t - s) / (e - s))
            else:
                after.append(t - e)
        res["events"][kind] = {"in_step": len(inside), "after_step": len(after),
                               "in_step_at_fraction": (statistics.median(inside)
                                                       if inside else None),
                               "after_step_end_us": _median_us(after)}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", default="plans/smollm2-135m-throughput-cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--client-anywhere", action="store_true",
                    help="with --threads below the cores the server keeps its compute threads "
                         "on their own cores; the load generator runs on the others unless "
                         "this is given")
    ap.add_argument("--_serve", nargs=3, help=argparse.SUPPRESS)   # the child's role
    args = ap.parse_args()
    if args._serve:
        port, mport, out = args._serve
        serve_instrumented(args.plan, args.threads, int(port), int(mport), out)
        return
    from bench.grpc_vs_inprocess import free_port, wait_serving
    from kiln.runtime.compute import pin_process, serving_cores
    from kiln.runtime.tools.loadgen import run_loadgen

    port, mport = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "timeline.json")
        proc = subprocess.Popen([sys.executable, __file__, "--plan", args.plan, "--threads",
                                 str(args.threads), "--_serve", str(port), str(mport), out],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_serving(port, proc)
            client_cores = serving_cores(args.threads)
            if client_cores is not None and not args.client_anywhere:
                pin_process(client_cores)     # off the server's compute cores (below)
            url, quiet = f"127.0.0.1:{port}", (lambda *a, **k: None)
            run_loadgen(url, requests=2, output_len=args.tokens, concurrencies=(1,),
                        print_fn=quiet)                                   # warm-up
            level = run_loadgen(url, requests=args.requests, output_len=args.tokens,
                                concurrencies=(1,), print_fn=quiet)["levels"][0]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        res = summarize(json.loads(Path(out).read_text()))
    res.update(tok_s=1.0 / level["tpot_s"]["mean"], plan=args.plan, threads=args.threads)
    print(f"decode over gRPC {res['tok_s']:.1f} tok/s; inside the server: compiled step "
          f"{res['step_us'] / 1e3:.2f} ms, a step every {res['period_us'] / 1e3:.2f} ms "
          f"({res['step_us'] / res['period_us']:.0%} of it in the step); the engine thread's "
          f"own CPU in the step {res['step_engine_thread_cpu_us'] / 1e3:.2f} ms")
    for name, us in res["phases_us"].items():
        print(f"  engine thread, {name:24} {us:7.1f} us (median)")
    rest = res["period_us"] - res["step_us"] - sum(res["phases_us"].values())
    print(f"  engine thread, the rest of the period   {rest:7.1f} us (its other Python, and "
          "waiting for the GIL or a core)")
    for kind, e in res["events"].items():
        where = (f"{e['in_step']} inside a step" + (f" (at {e['in_step_at_fraction']:.2f} of it)"
                                                     if e["in_step"] else ""))
        print(f"  serving, {kind:9} {where}, {e['after_step']} after one "
              f"({e['after_step_end_us']:.0f} us after its end, median)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
