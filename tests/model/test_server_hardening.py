"""`kiln serve` hardening, end to end on the tiny plan (a real server subprocess, real
clients): one bad request among many, non-finite numbers and out-of-range seeds, caps on
bodies and lists (413 / INVALID_ARGUMENT) with health answering meanwhile, a KServe stream
client that never reads, a token on every method, Triton's ModelStatistics, and the exit
codes of SIGTERM."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import httpx
import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tritonclient.grpc import service_pb2 as kpb
from tritonclient.grpc import service_pb2_grpc as kpb_grpc

from kiln.runtime.server.proto import kiln_pb2 as pb
from kiln.runtime.server.proto import kiln_pb2_grpc as pb_grpc
from kiln.runtime.server.tensors import encode_bytes
from tests.server_helpers import ROOT, HttpServerProcess, ServerProcess, copy_with_chat_template

pytestmark = pytest.mark.model

MODEL = "tiny-random"
TOKEN = "s3cret"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
STREAM_CAP = 8          # --max-stream-requests
MAX_REQUEST = 4 * 2**20  # --max-request-bytes


class Server(HttpServerProcess):
    def __init__(self, plan, *args, log_path=None):
        super().__init__(plan, "--auth-token", TOKEN, "--metrics-auth", *args,
                         log_path=log_path, metadata=AUTH, metrics_token=TOKEN)


@pytest.fixture(scope="module")
def chat_plan(tiny_plan, tmp_path_factory):
    """A copy of the tiny plan with a chat template (so the chat route gets to validation)."""
    return copy_with_chat_template(tiny_plan, tmp_path_factory.mktemp("plan") / "tiny-chat",
                                   "{% for m in messages %}{{ m['content'] }}{% endfor %}")


@pytest.fixture(scope="module")
def server(chat_plan, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    s = Server(chat_plan, "--drain-seconds", "5", "--max-stream-requests", str(STREAM_CAP),
               "--max-request-bytes", str(MAX_REQUEST), log_path=log)
    try:
        yield s.wait_serving()
    finally:
        assert s.terminate() == 0, s.log()


@pytest.fixture(scope="module")
def vocab_size(tiny_plan) -> int:
    return json.loads((tiny_plan / "plan.json").read_text())["model"]["config"]["vocab_size"]


def kreq(rid: str, text: str, max_tokens: int, **inputs) -> kpb.ModelInferRequest:
    """A KServe request; inputs: name=value (bool -> BOOL, int -> INT32, float -> FP32,
    list of str -> BYTES words)."""
    r = kpb.ModelInferRequest(model_name=MODEL, id=rid)
    tensors = dict(text_input=[text], max_tokens=max_tokens, **inputs)
    for name, v in tensors.items():
        if isinstance(v, list):
            r.inputs.add(name=name, datatype="BYTES", shape=[1, len(v)])
            r.raw_input_contents.append(encode_bytes([w.encode() for w in v]))
            continue
        dt, np_dt = ({bool: ("BOOL", "?"), int: ("INT32", "<i4"), float: ("FP32", "<f4")}
                     [type(v)])
        r.inputs.add(name=name, datatype=dt, shape=[1, 1])
        r.raw_input_contents.append(np.asarray([v], np_dt).tobytes())
    return r


def stream_outcomes(k, reqs) -> tuple[dict, dict]:
    """Send reqs on one ModelStreamInfer stream -> ({id: True} of the requests that ended
    with a final response, {id: error_message} of those refused)."""
    finals, errors = {}, {}
    for r in k.ModelStreamInfer(iter(reqs), metadata=AUTH, timeout=120):
        if r.error_message:
            errors[r.infer_response.id] = r.error_message
        elif r.infer_response.parameters["triton_final_response"].bool_param:
            finals[r.infer_response.id] = True
    return finals, errors


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class HealthProbe:
    """Checks gRPC and HTTP health in a loop on its own thread; the longest answer time."""

    def __init__(self, server):
        self.server, self.times, self._stop = server, [], threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with self.server.channel() as ch, httpx.Client() as http:
            stub = health_pb2_grpc.HealthStub(ch)
            while not self._stop.is_set():
                t0 = time.monotonic()
                ok = stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                    health_pb2.HealthCheckResponse.SERVING
                ok = ok and http.get(self.server.base + "/health", timeout=10).status_code == 200
                self.times.append((time.monotonic() - t0, ok))
                time.sleep(0.01)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(15)


# ---- one bad request among many --------------------------------------------------------------
def test_31_streams_and_one_out_of_vocab_stop_id(server, vocab_size):
    def gen(prompt, **sp):
        return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(
            max_tokens=16, temperature=0, ignore_eos=True, **sp))

    async def one(stub, i):
        last = None
        async for chunk in stub.Generate(gen(f"stream {i}"), metadata=AUTH):
            last = chunk
        return last.finish_reason, last.usage.completion_tokens

    async def bad(stub):
        try:
            async for _ in stub.Generate(gen("bad", stop_token_ids=[vocab_size + 1],
                                             min_tokens=1), metadata=AUTH):
                pass
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()

    async def main():
        async with grpc.aio.insecure_channel(server.url) as ch:
            stub = pb_grpc.KilnStub(ch)
            tasks = [asyncio.create_task(one(stub, i)) for i in range(31)]
            await asyncio.sleep(0.05)            # the 31 are in flight
            return await bad(stub), await asyncio.gather(*tasks)

    (code, details), results = asyncio.run(main())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in details
    assert results == [("length", 16)] * 31

    with server.channel() as ch:      # KServe: unary, and inside a stream beside good ones
        k = kpb_grpc.GRPCInferenceServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            k.ModelInfer(kreq("b", "bad", 8, end_id=vocab_size + 1, min_tokens=1),
                         metadata=AUTH)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        reqs = [kreq(f"g{i}", f"good {i}", 8, ignore_eos=True, stream=True) for i in range(6)]
        reqs.insert(3, kreq("bad", "bad", 8, end_id=vocab_size + 1, min_tokens=1, stream=True))
        finals, errors = stream_outcomes(k, reqs)
        assert list(errors) == ["bad"] and "vocabulary" in errors["bad"]
        assert sorted(finals) == [f"g{i}" for i in range(6)]

    r = httpx.post(server.base + "/v1/completions", headers=HEADERS, timeout=30, json={
        "model": MODEL, "prompt": "bad", "max_tokens": 4, "min_tokens": 1,
        "stop_token_ids": [vocab_size + 1]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    server.wait_idle()


# ---- output constraints: caps, and a bad one among many ---------------------------------------
def test_a_deeply_nested_schema_fails_alone_and_constraints_are_capped(server):
    deep = "[" * 100_000
    with server.channel() as ch:
        k = kpb_grpc.GRPCInferenceServiceStub(ch)
        reqs = [kreq(f"g{i}", f"good {i}", 8, ignore_eos=True, stream=True) for i in range(4)]
        reqs.insert(2, kreq("deep", "x", 8, guided_json=[deep], stream=True))
        reqs.insert(4, kreq("big", "x", 8, guided_regex=["a" * (256 * 2**10 + 1)],
                            stream=True))
        finals, errors = stream_outcomes(k, reqs)
        assert sorted(errors) == ["big", "deep"], errors
        assert "nested too deeply" in errors["deep"] and "at most" in errors["big"]
        assert sorted(finals) == [f"g{i}" for i in range(4)]
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.KilnStub(ch).Generate(pb.GenerateRequest(
                prompt="x", sampling=pb.SamplingParams(
                    max_tokens=2, guided=pb.GuidedDecoding(json_schema=deep))),
                metadata=AUTH, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = httpx.post(f"{server.base}/v1/completions", headers={**HEADERS, "Content-Type":
                   "application/json"}, timeout=60, content='{"model": "%s", "prompt": "x", '
                   '"guided_json": %s}' % (MODEL, deep))          # nested in the body itself
    assert r.status_code == 400 and "nests too deeply" in r.text, r.text
    for route, body in (("completions", {"prompt": "x", "guided_json": deep}),
                        ("completions", {"prompt": "x", "guided_choice": ["c"] * 257}),
                        ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                              "tools": [tool] * 129})):
        r = httpx.post(f"{server.base}/v1/{route}", headers=HEADERS, timeout=60,
                       json={"model": MODEL, "max_tokens": 2, **body})
        assert r.status_code == 400, r.text
    server.wait_idle()


# ---- NaN, infinities, seeds ------------------------------------------------------------------
FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty")


def test_non_finite_numbers_and_bad_seeds_are_400_never_500(server):
    with httpx.Client(headers={**HEADERS, "Content-Type": "application/json"},
                      timeout=30) as http:
        for route, body in (("completions", '"prompt": "hi"'),
                            ("chat/completions", '"messages": [{"role": "user", '
                                                 '"content": "hi"}]')):
            for field in FLOATS:
                for literal in ("NaN", "Infinity", "-Infinity"):
                    r = http.post(f"{server.base}/v1/{route}", content=(
                        f'{{"model": "{MODEL}", {body}, "max_tokens": 2, '
                        f'"{field}": {literal}}}'))
                    assert r.status_code == 400, (route, field, literal, r.text)
            for seed in (2**64, -2**63 - 1):
                r = http.post(f"{server.base}/v1/{route}", content=(
                    f'{{"model": "{MODEL}", {body}, "max_tokens": 2, "seed": {seed}}}'))
                assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    with server.channel() as ch:
        native = pb_grpc.KilnStub(ch)
        k = kpb_grpc.GRPCInferenceServiceStub(ch)
        for field in FLOATS:
            for value in (float("nan"), float("inf"), float("-inf")):
                with pytest.raises(grpc.RpcError) as e:
                    list(native.Generate(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(
                        max_tokens=2, **{field: value})), metadata=AUTH))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, value)
        for field in ("temperature", "top_p", "repetition_penalty", "presence_penalty",
                      "frequency_penalty", "length_penalty"):
            for value in (float("nan"), float("inf"), float("-inf")):
                with pytest.raises(grpc.RpcError) as e:
                    k.ModelInfer(kreq("x", "hi", 2, **{field: value}), metadata=AUTH)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, value)


# ---- caps --------------------------------------------------------------------------------------
def _raw_post(port: int, headers: str, body_chunks) -> tuple[bytes, int]:
    """Send a POST's headers, then body chunks until the server answers -> (its answer's
    head, the body bytes sent before it)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    answer = bytearray()

    def read():
        try:
            while b"\r\n\r\n" not in answer:
                more = s.recv(65536)
                if not more:
                    return
                answer.extend(more)
        except OSError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sent = 0
    try:
        s.sendall(headers.encode())
        for chunk in body_chunks:
            if answer:
                break
            s.sendall(chunk)
            sent += len(chunk)
    except OSError:          # the server answered and closed the connection
        pass
    reader.join(30)
    s.close()
    return bytes(answer), sent


def test_huge_bodies_are_413_unread_and_long_lists_refused(server):
    mib = b"x" * 2**20
    with HealthProbe(server) as probe:
        # 1 GiB announced: answered from the headers, with at most a few MiB on the wire
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}"
                f"\r\nContent-Type: application/json\r\nContent-Length: {2**30}\r\n\r\n")
        answer, sent = _raw_post(server.http_port, head, (mib for _ in range(1024)))
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert sent < 64 * 2**20, sent
        # chunked, no length: refused once past the cap
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}"
                "\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (len(mib), mib)
        answer, sent = _raw_post(server.http_port, head, (chunk for _ in range(1024)))
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert sent < 64 * 2**20, sent
        # 100k stop strings / bad words through every API: refused at the cap
        many = [f"w{i}" for i in range(100_000)]
        r = httpx.post(server.base + "/v1/completions", headers=HEADERS, timeout=60,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stop": many})
        assert r.status_code == 400 and "at most 64" in r.json()["error"]["message"], r.text
        for body in ({"prompt": ["p"] * 65},                 # prompts
                     {"prompt": ["p", "q"], "n": 33},           # prompts x n choices
                     {"messages": [{"role": "user", "content": "m"}] * 1025}):
            route = "chat/completions" if "messages" in body else "completions"
            r = httpx.post(f"{server.base}/v1/{route}", headers=HEADERS, timeout=60,
                           json={"model": MODEL, "max_tokens": 2, **body})
            assert r.status_code == 400 and r.json()["error"]["code"] == "limit_exceeded", \
                r.text
        with server.channel() as ch:
            with pytest.raises(grpc.RpcError) as e:     # Tokenize: capped before tokenizing
                pb_grpc.KilnStub(ch).Tokenize(pb.TokenizeRequest(prompt="z" * (2**20 + 1)),
                                              metadata=AUTH, timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            native = pb_grpc.KilnStub(ch)
            for field in ("stop", "bad_words"):
                with pytest.raises(grpc.RpcError) as e:
                    list(native.Generate(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(
                        max_tokens=2, **{field: many})), metadata=AUTH, timeout=60))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "at most 64" in e.value.details()
            k = kpb_grpc.GRPCInferenceServiceStub(ch)
            for field in ("stop_words", "bad_words"):
                with pytest.raises(grpc.RpcError) as e:
                    k.ModelInfer(kreq("x", "hi", 2, **{field: many}), metadata=AUTH, timeout=60)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # a gRPC message over --max-request-bytes is not read
            with pytest.raises(grpc.RpcError) as e:
                list(native.Generate(pb.GenerateRequest(prompt="x" * (MAX_REQUEST + 1)),
                                     metadata=AUTH, timeout=60))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # prompt text over the prompt cap (1 MiB for this plan): refused untokenized
            with pytest.raises(grpc.RpcError) as e:
                list(native.Generate(pb.GenerateRequest(prompt="y" * (2**20 + 1)),
                                     metadata=AUTH, timeout=60))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "bytes" in e.value.details()
    times = [t for t, _ in probe.times]
    print(f"health during the big requests: {len(times)} checks, max {max(times) * 1e3:.1f} "
          f"ms, median {sorted(times)[len(times) // 2] * 1e3:.1f} ms")
    assert len(times) >= 3 and all(ok for _, ok in probe.times)
    assert max(times) < 2.0      # the 100 ms, with room for a loaded 2-core machine
    server.wait_idle()


def test_kserve_stream_client_that_never_reads_is_throttled(server):
    """10,000 streaming requests written on one stream, no response read: at most
    STREAM_CAP run at once, the server stops taking requests once the client's receive
    window is full (the client keeps HTTP/2's initial 64 KiB window: no BDP probing), and
    the server's memory stays bounded."""
    def requests():
        for i in range(10_000):
            yield kreq(f"r{i}", f"flood {i} " * 8, 32, ignore_eos=True, stream=True)

    def ended() -> float:     # requests the server has ended, by any outcome
        return sum(v for k, v in server.metrics().items()
                   if k.startswith("kiln_requests_total{"))

    ended0 = ended()
    before = rss_bytes(server.proc.pid)
    peak_rss, peak_in_flight, taken = before, 0, []
    with grpc.insecure_channel(server.url, options=[("grpc.http2.bdp_probe", 0)]) as ch:
        call = kpb_grpc.GRPCInferenceServiceStub(ch).ModelStreamInfer(requests(),
                                                                      metadata=AUTH)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:     # until nothing new was taken for 5 s
            m = server.metrics()
            peak_in_flight = max(peak_in_flight, m["kiln_requests_in_flight"])
            peak_rss = max(peak_rss, rss_bytes(server.proc.pid))
            taken.append(ended() - ended0 + m["kiln_requests_in_flight"])
            if len(taken) > 50 and taken[-1] == taken[-51]:
                break
            time.sleep(0.1)
        call.cancel()
    grown = peak_rss - before
    print(f"stream flood: the server took {taken[-1]:.0f} of 10000 requests, then no more; "
          f"peak in flight {peak_in_flight:.0f}; server RSS +{grown / 2**20:.1f} MiB")
    assert len(taken) > 50 and taken[-1] == taken[-51], taken[-60:]   # throttled
    assert taken[-1] < 10_000
    assert 0 < peak_in_flight <= STREAM_CAP
    assert grown < 200 * 2**20
    server.wait_idle(timeout=30)


# ---- auth ------------------------------------------------------------------------------------
def _methods(ch) -> list[tuple[str, bool, bool]]:
    """(path, client streaming, server streaming) of every reflected method."""
    stub = reflection_pb2_grpc.ServerReflectionStub(ch)

    def ask(**kw):
        return next(iter(stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(**kw)]), metadata=AUTH)))

    services = [s.name for s in ask(list_services="").list_services_response.service]
    out = []
    for name in services:
        files = ask(file_containing_symbol=name).file_descriptor_response.file_descriptor_proto
        for raw in files:
            fd = descriptor_pb2.FileDescriptorProto.FromString(raw)
            for svc in fd.service:
                if f"{fd.package}.{svc.name}".lstrip(".") != name:
                    continue
                for m in svc.method:
                    out.append((f"/{name}/{m.name}", m.client_streaming, m.server_streaming))
    return sorted(set(out))


def test_every_method_and_route_needs_the_token(server):
    with server.channel() as ch:
        methods = _methods(ch)
        assert len(methods) >= 20, methods
        open_ = []
        for path, cs, ss in methods:
            kind = {(False, False): ch.unary_unary, (False, True): ch.unary_stream,
                    (True, False): ch.stream_unary, (True, True): ch.stream_stream}[(cs, ss)]
            call = kind(path, request_serializer=None, response_deserializer=None)
            arg = iter([b""]) if cs else b""
            try:
                res = call(arg, timeout=10)
                if ss:
                    list(res)
                open_.append(path)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAUTHENTICATED:
                    open_.append(path)
        assert open_ and all(p.startswith("/grpc.health.v1.Health/") for p in open_), open_
    with httpx.Client(timeout=10) as http:
        for method, route in (("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"),
                              ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                              ("GET", "/metrics")):
            assert http.request(method, server.base + route).status_code == 401, route
        assert http.get(server.base + "/health").status_code == 200
        assert http.get(server.base + "/metrics", headers=HEADERS).status_code == 200
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url, timeout=10)
    assert e.value.code == 401
    assert server.metrics()["kiln_kv_blocks_total"] > 0      # with the token: served


# ---- ModelStatistics -------------------------------------------------------------------------
def test_model_statistics_fill_queue_and_compute(server):
    with server.channel() as ch:
        k = kpb_grpc.GRPCInferenceServiceStub(ch)

        def stats():
            return k.ModelStatistics(kpb.ModelStatisticsRequest(name=MODEL),
                                     metadata=AUTH).model_stats[0].inference_stats

        s0 = stats()
        k.ModelInfer(kreq("u", "unary", 6, ignore_eos=True), metadata=AUTH)
        for _ in k.ModelStreamInfer(iter([kreq("s", "streamed", 6, ignore_eos=True,
                                               stream=True)]), metadata=AUTH):
            pass
        s1 = stats()
    assert s1.success.count - s0.success.count == 2
    for phase in ("queue", "compute_input", "compute_infer", "compute_output"):
        d0, d1 = getattr(s0, phase), getattr(s1, phase)
        assert d1.count - d0.count == 2, phase       # perf_analyzer watches queue.count
        assert d1.ns >= d0.ns, phase
    assert s1.compute_infer.ns > s0.compute_infer.ns   # 5 decode steps took some time
    assert s1.compute_input.ns > s0.compute_input.ns   # and a prefill


# ---- a dead engine ---------------------------------------------------------------------------
# `kiln serve`, with a fault injected into the engine loop's bookkeeping (outside the step)
# when a request with max_tokens == 13 arrives
FAULTY_SERVE = """
import sys
from kiln.runtime.engine import AddRequest, Engine
real = Engine.run_pending
def run_pending(self):
    if any(isinstance(m, AddRequest) and m.request.seq.max_tokens == 13 for m in self._inbox):
        raise RuntimeError("injected fault in the engine loop")
    return real(self)
Engine.run_pending = run_pending
from kiln.cli import main
sys.argv = ["kiln", *sys.argv[1:]]
main()
"""


def test_a_dead_engine_turns_health_not_serving(tiny_plan, tmp_path):
    server = ServerProcess(tiny_plan, "--drain-seconds", "5", log_path=tmp_path / "serve.log",
                           entry=("-c", FAULTY_SERVE))
    server.wait_serving()

    def generate(max_tokens):
        with server.channel() as ch:
            return list(pb_grpc.KilnStub(ch).Generate(pb.GenerateRequest(
                prompt="hi", sampling=pb.SamplingParams(max_tokens=max_tokens,
                                                        temperature=0)), timeout=30))

    try:
        assert generate(4)[-1].finish_reason in ("length", "stop")
        t0 = time.monotonic()
        last = generate(13)[-1]                        # kills the engine loop
        assert last.finish_reason == "error" and "the engine failed" in last.error
        assert time.monotonic() - t0 < 5
        with server.channel() as ch:
            health = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + 5
            while health.Check(health_pb2.HealthCheckRequest()).status == \
                    health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as e:
            generate(4)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine failed" in e.value.details()
    finally:
        code = server.terminate()
    assert code == 5, server.log()


# ---- exit codes ------------------------------------------------------------------------------
def test_second_sigterm_forces_exit_4(tiny_plan, tmp_path):
    server = ServerProcess(tiny_plan, "--drain-seconds", "600", "--max-batch-size", "1",
                           log_path=tmp_path / "serve.log")
    server.wait_serving()
    results = []

    def one(i):
        try:
            last = None
            with server.channel() as ch:
                for chunk in pb_grpc.KilnStub(ch).Generate(pb.GenerateRequest(
                        prompt=f"long {i}", sampling=pb.SamplingParams(
                            max_tokens=240, temperature=0, ignore_eos=True)), timeout=120):
                    last = chunk
            results.append(last.finish_reason)
        except grpc.RpcError as e:
            results.append(e.code())

    n = 24    # one at a time: ~6k steps (over a second at 0.15 ms a step), most of it queued
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while server.metrics().get("kiln_requests_in_flight") != n:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)
        while "draining:" not in server.log():
            assert time.monotonic() < deadline and server.proc.poll() is None
            time.sleep(0.01)
        assert server.proc.poll() is None        # draining: up to 600 s
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 4, server.log()
    finally:
        server.terminate(timeout=1)              # (SIGKILL if it is still there)
    for t in threads:
        t.join(30)
    assert len(results) == n and results.count("length") < n, results
    assert "second signal: cancelling" in server.log()


def test_bad_cap_flags_are_refused_at_start(tiny_plan):
    for flags, message in ((["--max-stop", "0"], "--max-stop must be >= 1"),
                           (["--max-stream-requests", "-1"], "--max-stream-requests must be"),
                           (["--metrics-auth"], "--metrics-auth needs --auth-token")):
        r = subprocess.run([sys.executable, "-m", "kiln.cli", "serve", str(tiny_plan), *flags],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and message in r.stderr, (flags, r.stderr)
