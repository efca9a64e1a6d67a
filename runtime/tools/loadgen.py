"""`kiln bench --url`: a gRPC load generator against a running server.

Each request is one KServe ModelStreamInfer call with stream=true, the way genai-perf and
perf_analyzer drive Triton's TensorRT-LLM ensemble, so the numbers compare with theirs.
The workload is seeded (prompts of random words, trimmed with the server's own Tokenize to
fit its limits; every request asks for exactly `output_len` tokens via min_length), and runs
closed-loop at each concurrency: C workers, each sending its next request when the last
one ends.

Per level: throughput (output tokens/s, requests/s), TTFT, TPOT (per request: time after
the first token / tokens after the first), ITL (gaps between streamed responses), e2e,
at p50/p95/p99; goodput = requests/s that met the SLO (TTFT and TPOT both within bound).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as kpb
from tritonclient.grpc import service_pb2_grpc as kpb_grpc

from kiln.runtime.server.proto import kiln_pb2 as pb
from kiln.runtime.server.proto import kiln_pb2_grpc as pb_grpc
from kiln.runtime.server.tensors import encode

WORDS = ("the of and to in is was for on that with as by at from his an were are which this "
         "be or had not but first one their its new after who they have her she two been "
         "other when there all during into school time may years more most only over city "
         "some world would where later up such used many can state about national out known "
         "university united then made").split()


@dataclass(frozen=True)
class SLO:
    """A request is 'good' when both hold."""
    ttft_s: float = 2.0
    tpot_s: float = 0.1


@dataclass
class Sample:
    ok: bool
    ttft: Optional[float] = None
    tpot: Optional[float] = None
    e2e: Optional[float] = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def _pcts(xs: Sequence[float]) -> dict:
    if not len(xs):
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    a = np.asarray(xs, dtype=np.float64)
    return {"p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def _request(model: str, rid: str, prompt: str, output_len: int) -> kpb.ModelInferRequest:
    req = kpb.ModelInferRequest(model_name=model, id=rid)
    tensors = [("text_input", "BYTES", [prompt.encode()]), ("max_tokens", "INT32", [output_len]),
               ("min_length", "INT32", [output_len]), ("stream", "BOOL", [True]),
               ("temperature", "FP32", [0.0]), ("exclude_input_in_output", "BOOL", [True]),
               ("return_num_output_tokens", "BOOL", [True])]
    for name, dt, values in tensors:
        req.inputs.add(name=name, datatype=dt, shape=[1, 1])
        req.raw_input_contents.append(encode(dt, values))
    return req


async def _one(stub, req, metadata) -> Sample:
    t0 = time.perf_counter()
    call = stub.ModelStreamInfer(metadata=metadata)
    await call.write(req)
    await call.done_writing()
    s, last, first = Sample(ok=False), None, None
    try:
        async for res in call:
            now = time.perf_counter()
            if res.error_message:
                s.error = res.error_message
                break
            r = res.infer_response
            n = int(np.frombuffer(r.raw_output_contents[1], "<i4")[0])
            s.output_tokens += n
            if n and first is None:
                first = now
            elif n:
                s.itl.append(now - last)
            if n:
                last = now
            if r.parameters["triton_final_response"].bool_param:
                s.ok = first is not None
                break
    except grpc.aio.AioRpcError as e:
        s.error = f"{e.code().name}: {e.details()}"
    s.e2e = time.perf_counter() - t0
    if first is not None:
        s.ttft = first - t0
        if s.output_tokens > 1:
            s.tpot = (last - first) / (s.output_tokens - 1)
    return s


async def _level(url: str, model: str, prompts: list[str], output_len: int, concurrency: int,
                 metadata, slo: SLO) -> dict:
    async with grpc.aio.insecure_channel(url) as ch:
        stub = kpb_grpc.GRPCInferenceServiceStub(ch)
        todo = list(enumerate(prompts))
        samples: list[Sample] = []

        async def worker():
            while todo:
                i, p = todo.pop(0)
                samples.append(await _one(stub, _request(model, str(i), p, output_len),
                                          metadata))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [s for s in samples if s.ok]
    good = [s for s in ok if s.ttft <= slo.ttft_s and (s.tpot is None or s.tpot <= slo.tpot_s)]
    tokens = sum(s.output_tokens for s in ok)
    return {"concurrency": concurrency, "requests": len(samples), "failed": len(samples) - len(ok),
            "errors": sorted({s.error for s in samples if s.error})[:5], "wall_s": wall,
            "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "requests_per_s": len(ok) / wall,
            "goodput_requests_per_s": len(good) / wall,
            "slo_attainment": len(good) / max(1, len(samples)),
            "ttft_s": _pcts([s.ttft for s in ok]), "tpot_s": _pcts([s.tpot for s in ok
                                                                    if s.tpot is not None]),
            "itl_s": _pcts([x for s in ok for x in s.itl]), "e2e_s": _pcts([s.e2e for s in ok])}


def _workload(url: str, n: int, output_len: int, prompt_words: tuple[int, int], seed: int,
              metadata) -> tuple[str, list[str], dict]:
    """(model name, prompts, limits): prompts trimmed to the server's limits."""
    with grpc.insecure_channel(url) as ch:
        stub = pb_grpc.KilnStub(ch)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=30)
        limits = json.loads(info.limits_json)
        room = min(limits["max_input_len"], limits["max_seq_len"] - output_len)
        if room < 1:
            raise ValueError(f"--output-len {output_len} leaves no room for a prompt under the "
                             f"server's max_seq_len ({limits['max_seq_len']})")
        rng = random.Random(seed)
        prompts = []
        for _ in range(n):
            words = [rng.choice(WORDS) for _ in range(rng.randint(*prompt_words))]
            while True:
                text = " ".join(words)
                ids = stub.Tokenize(pb.TokenizeRequest(prompt=text, add_special_tokens=True),
                                    metadata=metadata, timeout=30).token_ids
                if len(ids) <= room or len(words) == 1:
                    break
                words = words[:max(1, len(words) * room // len(ids) - 1)]
            prompts.append(text)
    return info.name, prompts, limits


def run_loadgen(url: str, requests: int = 64, output_len: int = 128,
                concurrencies: Sequence[int] = (1, 8, 32), seed: int = 0,
                json_path: Optional[str] = None, plot_path: Optional[str] = None,
                prompt_words: tuple[int, int] = (16, 128), slo: SLO = SLO(),
                token: Optional[str] = None, print_fn=print) -> dict:
    """Benchmark the server at url over a sweep of concurrencies; prints a table and returns
    (and optionally writes as JSON and plots) the report."""
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    model, prompts, limits = _workload(url, requests, output_len, prompt_words, seed, metadata)
    report = {"url": url, "model": model, "seed": seed, "limits": limits,
              "workload": {"requests_per_level": requests, "output_len": output_len,
                           "prompt_words": list(prompt_words),
                           "protocol": "KServe v2 ModelStreamInfer, stream=true, greedy"},
              "slo": asdict(slo), "levels": []}
    asyncio.run(_level(url, model, prompts[:2], min(8, output_len), 2, metadata, slo))  # warm-up
    print_fn(f"{url} model {model!r}: {requests} requests per level, {output_len} output "
             f"tokens each; SLO TTFT <= {slo.ttft_s * 1000:.0f} ms and TPOT <= "
             f"{slo.tpot_s * 1000:.0f} ms")
    print_fn(f"{'conc':>4} {'tok/s':>8} {'req/s':>6} {'good/s':>6}  {'TTFT p50/p95/p99 ms':>22}  "
             f"{'TPOT p50/p95/p99 ms':>20}  {'ITL p50/p99 ms':>14}  {'e2e p50/p99 s':>13}  fail")
    for c in concurrencies:
        r = asyncio.run(_level(url, model, prompts, output_len, c, metadata, slo))
        report["levels"].append(r)
        print_fn(_row(r))
        for e in r["errors"]:
            print_fn(f"     error: {e}")
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
    if plot_path:
        plot(report, plot_path)
    return report


def _row(r: dict) -> str:
    def ms(d, *keys):
        return "/".join("-" if d[k] is None else f"{d[k] * 1000:.1f}" for k in keys)
    e2e = r["e2e_s"]
    e2e_txt = "-" if e2e["p50"] is None else f"{e2e['p50']:.2f}/{e2e['p99']:.2f}"
    return (f"{r['concurrency']:>4} {r['output_tokens_per_s']:>8.1f} {r['requests_per_s']:>6.2f} "
            f"{r['goodput_requests_per_s']:>6.2f}  {ms(r['ttft_s'], 'p50', 'p95', 'p99'):>22}  "
            f"{ms(r['tpot_s'], 'p50', 'p95', 'p99'):>20}  {ms(r['itl_s'], 'p50', 'p99'):>14}  "
            f"{e2e_txt:>13}  "
            f"{r['failed']}")


def plot(report: dict, path: str) -> None:
    """PNG: throughput and goodput, and latency percentiles, against concurrency."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lv = report["levels"]
    c = [r["concurrency"] for r in lv]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(c, [r["output_tokens_per_s"] for r in lv], "o-", label="output tokens/s")
    a2 = a.twinx()
    a2.plot(c, [r["goodput_requests_per_s"] for r in lv], "s--", color="tab:green",
            label="goodput (req/s in SLO)")
    a.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s",
          title=f"throughput — {report['model']}")
    a2.set_ylabel("goodput requests/s")
    a.set_xticks(c, [str(x) for x in c])
    a.legend(loc="upper left")
    a2.legend(loc="lower right")
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "e2e")):
        for q, style in (("p50", "o-"), ("p99", "x:")):
            b.plot(c, [(r[key][q] or float("nan")) * 1000 for r in lv], style,
                   label=f"{name} {q}")
    b.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="ms", title="latency")
    b.set_xticks(c, [str(x) for x in c])
    b.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
