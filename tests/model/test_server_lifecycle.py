"""`kiln serve` settings and lifecycle: refused limits, TLS + bearer auth (the metrics port
over TLS too), a full queue, SIGTERM during load (drain, then cancel, exit 3: requests were
cancelled), and what refuses to start at all (busy ports, bad TLS files, an empty token)."""
from __future__ import annotations

import asyncio
import http.client
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kiln.runtime.server.proto import kiln_pb2 as pb
from kiln.runtime.server.proto import kiln_pb2_grpc as pb_grpc
from tests.server_helpers import ROOT, ServerProcess, free_port

pytestmark = pytest.mark.model


def gen(prompt: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens,
                                                                        temperature=0))


def test_limits_are_never_raised(tiny_plan):
    for flag in (["--max-batch-size", "9"], ["--max-num-tokens", "100000"],
                 ["--max-queue", "999999"]):
        r = subprocess.run([sys.executable, "-m", "kiln.cli", "serve", str(tiny_plan), *flag],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        assert "never raised" in r.stderr and flag[0][2:].replace("-", "_") in r.stderr


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"),
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


def test_tls_auth_and_full_queue(tiny_plan, tls_files, tmp_path):
    cert, key = tls_files
    (tmp_path / "token").write_text("s3cret\n")
    creds = grpc.ssl_channel_credentials(cert.read_bytes())
    server = ServerProcess(tiny_plan, "--tls-cert", str(cert), "--tls-key", str(key),
                           "--auth-token-file", str(tmp_path / "token"), "--metrics-auth",
                           "--max-batch-size", "1", "--max-queue", "1",
                           log_path=tmp_path / "serve.log", channel_credentials=creds,
                           metrics_token="s3cret", metrics_ca=cert)
    try:
        server.wait_serving()          # health answers without the token
        # the metrics port speaks TLS too: the token never crosses in clear text
        assert server.metrics()["kiln_kv_blocks_total"] > 0
        plain = f"http://127.0.0.1:{server.metrics_port}/metrics"
        with pytest.raises((urllib.error.URLError, http.client.HTTPException, OSError)):
            urllib.request.urlopen(urllib.request.Request(
                plain, headers={"Authorization": "Bearer s3cret"}), timeout=10)
        assert (f"auth: bearer token required on gRPC {server.url}, metrics "
                f"127.0.0.1:{server.metrics_port}; open: gRPC health") in server.log()
        auth = (("authorization", "Bearer s3cret"),)
        with server.channel() as ch:
            stub = pb_grpc.KilnStub(ch)
            for md in ((), (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Generate(gen("hi", 2), metadata=md))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as e:
                    stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert list(stub.Generate(gen("hi", 2), metadata=auth))[-1].finished
            health = health_pb2_grpc.HealthStub(ch)
            assert health.Check(health_pb2.HealthCheckRequest()).status == \
                health_pb2.HealthCheckResponse.SERVING

        async def one(stub):
            t0 = time.monotonic()
            try:
                async for _ in stub.Generate(gen("a long one", 200), metadata=auth):
                    pass
                return "ok", time.monotonic() - t0
            except grpc.aio.AioRpcError as e:
                return e.code(), time.monotonic() - t0

        async def burst():
            async with grpc.aio.secure_channel(server.url, creds, options=[
                    ("grpc.ssl_target_name_override", "localhost")]) as ch:
                stub = pb_grpc.KilnStub(ch)
                return await asyncio.gather(*(one(stub) for _ in range(5)))

        results = asyncio.run(burst())
        full = [t for code, t in results if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
        done = [t for code, t in results if code == "ok"]
        assert full and done and len(full) + len(done) == 5, results
        assert max(full) < min(done)     # refused at once, not after waiting
    finally:
        assert server.terminate() == 0, server.log()


def test_sigterm_drains_then_cancels_and_exits_3(tiny_plan, tmp_path):
    # one sequence at a time, so most of the 24 requests (5,760 steps) are still queued or
    # running when the 0.5 s drain is up and get cancelled; those that finish in time finish
    # whole (12 requests two at a time could all finish within the drain on a fast host)
    server = ServerProcess(tiny_plan, "--drain-seconds", "0.5", "--max-batch-size", "1",
                           log_path=tmp_path / "serve.log")
    server.wait_serving()
    n = 24

    async def one(stub, i):
        text, last = "", None
        async for chunk in stub.Generate(gen(f"request {i}", 240)):
            text, last = text + chunk.text, chunk
        return last, text

    async def main():
        async with grpc.aio.insecure_channel(server.url) as ch:
            stub = pb_grpc.KilnStub(ch)
            tasks = [asyncio.create_task(one(stub, i)) for i in range(n)]
            t0 = time.monotonic()       # wait until the server has accepted all of them
            while server.metrics().get("kiln_requests_in_flight") != n:
                assert time.monotonic() - t0 < 30
                await asyncio.sleep(0.01)
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            try:
                async for _ in stub.Generate(gen("too late", 4)):
                    pass
                late = "served"
            except grpc.aio.AioRpcError as e:
                late = e.code()
            return late, await asyncio.gather(*tasks)

    late, results = asyncio.run(main())
    assert late == grpc.StatusCode.UNAVAILABLE
    reasons = [last.finish_reason for last, _ in results]
    assert set(reasons) <= {"length", "cancelled"} and "cancelled" in reasons, reasons
    for last, text in results:
        assert last.finished
        if last.finish_reason == "length":
            assert last.usage.completion_tokens == 240 and text
    assert server.proc.wait(30) == 3, server.log()     # 3: the drain cancelled requests
    assert f"draining: {n} requests in flight" in server.log()
    assert "auth: off, no bearer token on any port (gRPC " in server.log()


def test_a_request_still_being_admitted_holds_the_drain(tiny_plan):
    """A request that passed the readiness check but is still being submitted (its prompt
    tokenized, its constraint compiled: off the event loop) counts for the drain: the drain
    waits for it instead of stopping the server under it."""
    from kiln.runtime.engine import Engine
    from kiln.runtime.plan import load_plan
    from kiln.runtime.sampling import SamplingParams
    from kiln.runtime.server.frontend import Frontend

    async def main(engine, plan):
        fe = Frontend(plan.manifest.name)
        fe.set_ready(engine, plan)

        async def one():
            async with fe.request("admitted", SamplingParams(max_tokens=8, temperature=0)
                                  ) as (_, outputs):
                return [out async for out in outputs][-1]

        task = asyncio.create_task(one())
        await asyncio.sleep(0)          # the task is now waiting on its submission
        fe.start_draining()
        idle_at_once = await fe.wait_idle(0)
        drained = await fe.wait_idle(30)
        return idle_at_once, drained, await task

    plan = load_plan(tiny_plan)
    with Engine.from_plan(plan) as engine:
        idle_at_once, drained, last = asyncio.run(main(engine, plan))
    assert not idle_at_once and drained
    assert last.finish_reason == "length" and last.usage.completion_tokens == 8


def _refused_at_start(plan, *flags: str) -> str:
    """stderr of a `kiln serve` that must refuse to start: exit 2, one line, no traceback,
    and nothing loaded (the plan is loaded only after every port is bound)."""
    cmd = [sys.executable, "-m", "kiln.cli", "serve", str(plan), "--host", "127.0.0.1",
           "--port", str(free_port()), "--metrics-port", str(free_port()), *flags]
    try:   # (a flag given twice: the last one counts)
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"kiln serve {flags} did not refuse to start: {e.stderr}")
    assert r.returncode == 2, (flags, r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and "loading plan" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), r.stderr
    return last


def test_busy_ports_bad_tls_files_and_an_empty_token_refuse_to_start(tiny_plan, tmp_path):
    # a port held by another listener, which (like a second kiln serve) allows port sharing
    busy = socket.socket()
    busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = str(busy.getsockname()[1])
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    try:
        for flag, what in (("--metrics-port", "metrics"), ("--http-port", "HTTP"),
                           ("--port", "gRPC")):
            line = _refused_at_start(tiny_plan, flag, port)
            assert line == f"error: cannot listen on 127.0.0.1:{port} for {what}: " \
                           "Address already in use", line
    finally:
        busy.close()
    missing = tmp_path / "missing.pem"
    line = _refused_at_start(tiny_plan, "--tls-cert", str(missing), "--tls-key", str(missing))
    assert line == f"error: cannot read --tls-cert {missing}: No such file or directory"
    junk = str(tmp_path / "junk.pem")
    line = _refused_at_start(tiny_plan, "--tls-cert", junk, "--tls-key", junk)
    assert "are not a PEM certificate and its private key" in line
    for empty in ("", "  "):       # an unset variable must not turn auth off on every port
        line = _refused_at_start(tiny_plan, "--auth-token", empty)
        assert line.startswith("error: --auth-token is empty"), line
