"""`kiln serve` settings and lifecycle: refused limits, TLS + bearer auth, a full queue,
and SIGTERM during load (drain, then cancel, exit 3: requests were cancelled)."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kiln.runtime.server.proto import kiln_pb2 as pb
from kiln.runtime.server.proto import kiln_pb2_grpc as pb_grpc
from tests.server_helpers import ROOT, ServerProcess

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
                           "--auth-token-file", str(tmp_path / "token"),
                           "--max-batch-size", "1", "--max-queue", "1",
                           log_path=tmp_path / "serve.log", channel_credentials=creds)
    try:
        server.wait_serving()          # health answers without the token
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
