"""Soak `kiln serve` (not in CI): mixed traffic for N minutes, a fifth of it cancelled by
its client mid-way, and the server's RSS and KV blocks sampled over time.

    python -m bench.soak PLAN --minutes 10 [--concurrency 16] [--cancel 0.2] [--json F]

Starts `kiln serve PLAN` (gRPC + the OpenAI HTTP API) and runs `--concurrency` clients,
each looping over requests drawn at random (seeded) from: KServe ModelStreamInfer
(streamed), KServe ModelInfer (unary), kiln.v1 Generate, OpenAI /v1/completions (streamed
and not), OpenAI chat (plain, with tools and tool_choice auto/required, with a JSON-schema
response_format), KServe guided_json; prompts of --prompt-words words, max_tokens 8 to
--max-tokens, sampled or greedy. A --bad fraction of the requests is pathological (a schema
nested 100,000 deep, a tool whose parameters nest past the cap, a regex of many alternatives,
a reply forced to `<tool_call>` and thousands of spaces, an oversized schema): each must be
refused or answered for itself while the rest go on. A prober asks grpc.health.v1 every
0.2 s and the report gives its worst latency. With probability
--cancel a request is abandoned by its client after a random number of outputs (a
streaming call cancelled, an HTTP connection closed). Every --every seconds it records the
server's RSS, KV blocks in use and requests in flight. At the end it waits for the server
to be idle: blocks still in use then are leaked. Exit 1 on a leak, an unexpected error or
a health probe slower than --max-probe-ms.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as kpb
from tritonclient.grpc import service_pb2_grpc as kpb_grpc

from bench.grpc_vs_inprocess import free_port
from kiln.runtime.server.proto import kiln_pb2 as pb
from kiln.runtime.server.proto import kiln_pb2_grpc as pb_grpc
from kiln.runtime.server.tensors import encode

# The chat kinds' tool: two required arguments, no other keys (the strict case).
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}}}}
ANSWER_SCHEMA = {"type": "object", "required": ["answer"],
                 "properties": {"answer": {"type": "string", "maxLength": 40}}}


def nested(depth: int) -> dict:
    """A JSON schema nested `depth` arrays deep, built without recursion."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


# Requests built to hurt the server; each must end for itself (a 400 / INVALID_ARGUMENT or a
# normal answer) while everything else goes on.
BAD_KINDS = ("deep_json_text", "deep_tool_parameters", "wide_regex", "spaces_tool_call",
             "huge_schema")

WORDS = ("the quick brown fox jumps over a lazy dog while seven curious engineers measure "
         "memory and latency of every request under load").split()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    out = {}
    for line in text.decode().splitlines():
        if line.startswith("kiln_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def kserve_request(model: str, rid: str, prompt: str, max_tokens: int, stream: bool,
                   temperature: float) -> kpb.ModelInferRequest:
    req = kpb.ModelInferRequest(model_name=model, id=rid)
    for name, dt, values in (("text_input", "BYTES", [prompt.encode()]),
                             ("max_tokens", "INT32", [max_tokens]),
                             ("stream", "BOOL", [stream]),
                             ("temperature", "FP32", [temperature]),
                             ("exclude_input_in_output", "BOOL", [True])):
        req.inputs.add(name=name, datatype=dt, shape=[1, 1])
        req.raw_input_contents.append(encode(dt, values))
    return req


@dataclass(frozen=True)
class Draw:
    """One request's random draw."""
    prompt: str
    max_tokens: int
    temperature: float
    cancel_after: Optional[int]     # outputs before the client gives up; None: never


class Soak:
    def __init__(self, args, grpc_url: str, http_base: str, model: str):
        self.args, self.grpc_url, self.http_base, self.model = args, grpc_url, http_base, model
        self.outcomes: Counter = Counter()
        self.errors: list[str] = []

    async def one(self, rng: random.Random, ch, http: httpx.AsyncClient, n: int) -> str:
        """One request; -> its outcome (finished | cancelled | refused | rejected | error)."""
        if rng.random() < self.args.bad:
            return await self._bad(rng, ch, http)
        kind = rng.choice(("kserve_stream", "kserve_unary", "native", "openai_stream",
                           "openai", "chat", "chat_tools", "chat_schema", "kserve_guided"))
        lo, hi = self.args.prompt_words
        draw = Draw(prompt=" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))),
                    max_tokens=rng.randint(8, self.args.max_tokens),
                    temperature=rng.choice((0.0, 0.8)),
                    cancel_after=rng.randint(1, 6) if rng.random() < self.args.cancel
                    else None)
        try:
            if kind in ("kserve_stream", "kserve_unary"):
                req = kserve_request(self.model, str(n), draw.prompt, draw.max_tokens,
                                     kind == "kserve_stream", draw.temperature)
                stub = kpb_grpc.GRPCInferenceServiceStub(ch)
                if kind == "kserve_stream":
                    return await self._kserve_stream(stub, req, draw.cancel_after)
                return await self._kserve_unary(stub, req, draw.cancel_after)
            if kind == "native":
                return await self._native(pb_grpc.KilnStub(ch), draw)
            if kind == "kserve_guided":
                return await self._kserve_guided(kpb_grpc.GRPCInferenceServiceStub(ch), n, draw)
            if kind.startswith("chat"):
                return await self._chat(http, draw, kind, rng)
            return await self._openai(http, draw, stream=kind == "openai_stream")
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return "refused"
            self.errors.append(f"{kind}: {e.code()} {e.details()}")
            return "error"
        except httpx.HTTPStatusError as e:
            if e.response.status_code == 429:
                return "refused"
            self.errors.append(f"{kind}: HTTP {e.response.status_code}")
            return "error"
        except Exception as e:   # noqa: BLE001 - counted and reported
            self.errors.append(f"{kind}: {type(e).__name__}: {e}")
            return "error"

    @staticmethod
    async def _kserve_stream(stub, req, cancel_after: Optional[int]) -> str:
        call = stub.ModelStreamInfer(iter([req]))
        got = 0
        async for r in call:
            if r.error_message:
                raise RuntimeError(r.error_message)
            got += 1
            if cancel_after and got >= cancel_after:
                call.cancel()
                return "cancelled"
            if r.infer_response.parameters["triton_final_response"].bool_param:
                return "finished"
        return "finished"

    @staticmethod
    async def _kserve_unary(stub, req, cancel_after: Optional[int]) -> str:
        if not cancel_after:
            await stub.ModelInfer(req)
            return "finished"
        try:       # a client that gives up: a deadline shorter than the work
            await stub.ModelInfer(req, timeout=0.05 * cancel_after)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return "cancelled"
            raise
        return "finished"

    @staticmethod
    async def _native(stub, draw: Draw) -> str:
        call = stub.Generate(pb.GenerateRequest(
            prompt=draw.prompt, sampling=pb.SamplingParams(max_tokens=draw.max_tokens,
                                                           temperature=draw.temperature)))
        got = 0
        async for chunk in call:
            got += 1
            if draw.cancel_after and got >= draw.cancel_after:
                call.cancel()
                return "cancelled"
            if chunk.finished:
                if chunk.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"native: {chunk.finish_reason} {chunk.error}")
                return "finished"
        return "finished"

    async def _openai(self, http: httpx.AsyncClient, draw: Draw, stream: bool) -> str:
        url = self.http_base + "/v1/completions"
        body = {"model": self.model, "prompt": draw.prompt, "max_tokens": draw.max_tokens,
                "temperature": draw.temperature, "stream": stream}
        if stream:
            async with http.stream("POST", url, json=body) as r:
                r.raise_for_status()
                got = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    got += 1
                    if draw.cancel_after and got >= draw.cancel_after:
                        return "cancelled"      # leaving the block closes the connection
                    if line == "data: [DONE]":
                        return "finished"
            return "finished"
        if draw.cancel_after:
            try:
                await http.post(url, json=body, timeout=0.05 * draw.cancel_after)
            except httpx.TimeoutException:
                return "cancelled"
            return "finished"
        r = await http.post(url, json=body)
        r.raise_for_status()
        return "finished"

    async def _chat(self, http: httpx.AsyncClient, draw: Draw, kind: str,
                    rng: random.Random) -> str:
        body = {"model": self.model, "max_tokens": draw.max_tokens,
                "temperature": draw.temperature,
                "messages": [{"role": "user", "content": draw.prompt}]}
        if kind == "chat_tools":
            body |= {"tools": [WEATHER_TOOL], "tool_choice": rng.choice(("auto", "required"))}
        elif kind == "chat_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": ANSWER_SCHEMA}}
        r = await http.post(self.http_base + "/v1/chat/completions", json=body)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        if choice["finish_reason"] not in ("stop", "length", "tool_calls"):
            raise RuntimeError(f"{kind}: finish_reason {choice['finish_reason']}")
        for call in choice["message"].get("tool_calls") or ():
            args = json.loads(call["function"]["arguments"])
            if set(args) != {"city", "unit"}:
                raise RuntimeError(f"{kind}: tool arguments {sorted(args)}")
        return "finished"

    async def _kserve_guided(self, stub, n: int, draw: Draw) -> str:
        req = kserve_request(self.model, str(n), draw.prompt, draw.max_tokens, False,
                             draw.temperature)
        req.inputs.add(name="guided_json", datatype="BYTES", shape=[1, 1])
        req.raw_input_contents.append(encode("BYTES", [json.dumps(ANSWER_SCHEMA).encode()]))
        await stub.ModelInfer(req)
        return "finished"

    async def _bad(self, rng: random.Random, ch, http: httpx.AsyncClient) -> str:
        """One pathological request: `rejected` when refused as the client's fault, `finished`
        when answered; anything else (a 5xx, INTERNAL, a dropped connection) is an error."""
        kind = rng.choice(BAD_KINDS)
        chat = {"model": self.model, "max_tokens": 16,
                "messages": [{"role": "user", "content": "hi"}]}
        if kind == "deep_json_text":       # the schema as text: no client-side recursion
            req = kserve_request(self.model, "bad", "hi", 8, False, 0.0)
            req.inputs.add(name="guided_json", datatype="BYTES", shape=[1, 1])
            req.raw_input_contents.append(encode("BYTES", [b"[" * 100_000]))
            try:
                await kpb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req)
                return "finished"
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    return "rejected"
                self.errors.append(f"{kind}: {e.code()} {e.details()}")
                return "error"
        if kind == "deep_tool_parameters":
            tool = {"type": "function", "function": {"name": "f", "parameters": nested(200)}}
            chat |= {"tools": [tool], "tool_choice": "required"}
        elif kind == "wide_regex":
            chat["guided_regex"] = "|".join(f"a{i}b{i}c" for i in range(20_000))
        elif kind == "spaces_tool_call":
            chat |= {"tools": [WEATHER_TOOL], "tool_choice": "auto", "max_tokens": 64,
                     "guided_regex": "<tool_call> {3000}"}
        else:                               # huge_schema: many properties
            props = {f"p{i}": {"type": "string"} for i in range(50_000)}
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "huge", "schema": {"type": "object", "properties": props}}}
        r = await http.post(self.http_base + "/v1/chat/completions", json=chat)
        if r.status_code < 300:
            return "finished"
        if 400 <= r.status_code < 500:
            return "rejected"
        self.errors.append(f"{kind}: HTTP {r.status_code} {r.text[:200]}")
        return "error"

    async def worker(self, i: int, until: float, counter) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        async with grpc.aio.insecure_channel(self.grpc_url) as ch, \
                httpx.AsyncClient(timeout=300) as http:
            while time.monotonic() < until:
                outcome = await self.one(rng, ch, http, next(counter))
                self.outcomes[outcome] += 1


async def probe_health(grpc_url: str, done: asyncio.Event) -> list[float]:
    """grpc.health.v1 Check every 0.2 s until `done`; -> each answer's latency in ms (a probe
    that fails or takes past 10 s counts as 10 s)."""
    latencies = []
    async with grpc.aio.insecure_channel(grpc_url) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while not done.is_set():
            t = time.monotonic()
            try:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                latencies.append((time.monotonic() - t) * 1000)
            except grpc.aio.AioRpcError:
                latencies.append(10_000.0)
            await asyncio.sleep(0.2)
    return latencies


async def run(args, grpc_url, http_base, model, pid, metrics_port) -> dict:
    soak = Soak(args, grpc_url, http_base, model)
    done = asyncio.Event()
    prober = asyncio.ensure_future(probe_health(grpc_url, done))
    t0 = time.monotonic()
    until = t0 + args.minutes * 60
    import itertools
    counter = itertools.count()
    workers = [asyncio.ensure_future(soak.worker(i, until, counter))
               for i in range(args.concurrency)]
    samples = []
    while not all(w.done() for w in workers):
        m = await asyncio.to_thread(metrics, metrics_port)
        samples.append({"t": round(time.monotonic() - t0, 1), "rss_mib": round(rss_mib(pid), 1),
                        "kv_blocks_used": m["kiln_kv_blocks_used"],
                        "in_flight": m["kiln_requests_in_flight"],
                        "requests": sum(soak.outcomes.values())})
        print(json.dumps(samples[-1]), flush=True)
        await asyncio.wait(workers, timeout=args.every)
    for w in workers:
        w.result()
    done.set()
    probes = await prober
    deadline = time.monotonic() + 60      # idle: nothing running, nothing in flight
    while True:
        m = await asyncio.to_thread(metrics, metrics_port)
        if (m["kiln_running_requests"] == 0 and m["kiln_requests_in_flight"] == 0
                and m["kiln_queue_length"] == 0) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    rss = [s["rss_mib"] for s in samples]
    later = rss[len(rss) // 4:] or rss      # after warm-up
    return {"minutes": args.minutes, "concurrency": args.concurrency, "cancel": args.cancel,
            "outcomes": dict(soak.outcomes), "errors": soak.errors[:20],
            "num_errors": len(soak.errors),
            "leaked_kv_blocks": m["kiln_kv_blocks_used"],
            "health_probe_ms": {"count": len(probes),
                                "worst": round(max(probes, default=0.0), 1),
                                "median": round(statistics.median(probes or [0.0]), 1)},
            "rss_mib": {"first": rss[0], "after_warmup": later[0], "max": max(rss),
                        "last": rss[-1]},
            "samples": samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan")
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--cancel", type=float, default=0.2, help="fraction cancelled mid-way")
    ap.add_argument("--bad", type=float, default=0.05, help="fraction of pathological requests")
    ap.add_argument("--max-probe-ms", type=float, default=1000,
                    help="fail when a health probe takes longer")
    ap.add_argument("--every", type=float, default=10, help="seconds between samples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-words", type=int, nargs=2, default=(4, 200), metavar=("LO", "HI"),
                    help="prompt length range in words (the tiny test plan: 4 30)")
    ap.add_argument("--max-tokens", type=int, default=96, help="max_tokens drawn in [8, N]")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()
    model = json.loads((Path(args.plan) / "plan.json").read_text())["name"]
    port, metrics_port, http_port = free_port(), free_port(), free_port()
    log = open(Path(args.json).with_suffix(".serve.log") if args.json else "/dev/null", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", args.plan, "--port",
                             str(port), "--metrics-port", str(metrics_port), "--http-port",
                             str(http_port), "--drain-seconds", "10"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                sys.exit(f"kiln serve exited with {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                    break
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, "kiln serve did not become ready"
            time.sleep(0.5)
        report = asyncio.run(run(args, f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}",
                                 model, proc.pid, metrics_port))
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    report["server_exit_code"] = code
    summary = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    ok = (report["leaked_kv_blocks"] == 0 and report["num_errors"] == 0 and code == 0
          and report["health_probe_ms"]["worst"] <= args.max_probe_ms)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
