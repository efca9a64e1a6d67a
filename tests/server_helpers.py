"""Run `kiln serve` as a subprocess on free loopback ports, for the server tests."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_with_chat_template(plan: Path, dest: Path, template: str) -> Path:
    """A copy of `plan` at dest whose generation.json has `template` as its chat template
    (the manifest's size and sha256 of generation.json updated, so the copy still loads)."""
    shutil.copytree(plan, dest)
    gen = json.loads((dest / "generation.json").read_text())
    gen["chat_template"] = template
    data = json.dumps(gen, indent=2).encode()
    (dest / "generation.json").write_bytes(data)
    manifest = json.loads((dest / "plan.json").read_text())
    manifest["files"]["generation.json"] = {"sha256": hashlib.sha256(data).hexdigest(),
                                            "size": len(data)}
    (dest / "plan.json").write_text(json.dumps(manifest, indent=2))
    return dest


class ServerProcess:
    """A `kiln serve PLAN` subprocess; `url` is HOST:PORT of its gRPC server."""

    def __init__(self, plan: Path, *args: str, log_path: Path | None = None,
                 channel_credentials: grpc.ChannelCredentials | None = None,
                 metadata: tuple = (), metrics_token: str | None = None,
                 metrics_ca: Path | None = None, entry: tuple = ("-m", "kiln.cli")):
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"127.0.0.1:{self.port}"
        self.creds, self.metadata = channel_credentials, metadata
        self.metrics_token = metrics_token     # with --metrics-auth
        self.metrics_ca = metrics_ca           # with TLS: the certificate /metrics is checked by
        cmd = [sys.executable, *entry, "serve", str(plan), "--host", "127.0.0.1",
               "--port", str(self.port), "--metrics-port", str(self.metrics_port), *args]
        self.log_path = log_path
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def channel(self) -> grpc.Channel:
        if self.creds is not None:
            return grpc.secure_channel(self.url, self.creds,
                                       options=[("grpc.ssl_target_name_override", "localhost")])
        return grpc.insecure_channel(self.url)

    def wait_serving(self, timeout: float = 180.0) -> "ServerProcess":
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        deadline = time.monotonic() + timeout
        with self.channel() as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kiln serve exited with {self.proc.returncode}: "
                                       f"{self.log()}")
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"kiln serve did not report SERVING in {timeout}s: {self.log()}")

    def metrics(self) -> dict[str, float]:
        """The kiln_* samples of /metrics, keyed by name{labels}."""
        scheme, context = "http", None
        if self.metrics_ca is not None:     # the test certificate names localhost, not the IP
            scheme, context = "https", ssl.create_default_context(cafile=str(self.metrics_ca))
            context.check_hostname = False
        req = urllib.request.Request(f"{scheme}://127.0.0.1:{self.metrics_port}/metrics")
        if self.metrics_token:
            req.add_header("Authorization", f"Bearer {self.metrics_token}")
        text = urllib.request.urlopen(req, timeout=5, context=context).read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("kiln_"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Poll /metrics until no KV block is used and no request runs or is in flight; those
        metrics. AssertionError (with them) when that takes longer than timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["kiln_kv_blocks_used"], m["kiln_running_requests"],
                    m["kiln_requests_in_flight"]) == (0, 0, 0):
                return m
            assert time.monotonic() < deadline, m
            time.sleep(0.02)

    def log(self) -> str:
        return self.log_path.read_text()[-4000:] if self.log_path else ""

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            if self._log is not subprocess.DEVNULL:
                self._log.close()


class HttpServerProcess(ServerProcess):
    """A `kiln serve PLAN` subprocess with its HTTP (OpenAI) API on `base` as well."""

    def __init__(self, plan: Path, *args: str, **kw):
        self.http_port = free_port()
        super().__init__(plan, "--http-port", str(self.http_port), *args, **kw)
        self.base = f"http://127.0.0.1:{self.http_port}"
