"""Two `kiln serve` replicas behind Debian's nginx, driven through the proxy: gRPC (KServe v2
streams, tritonclient) through `grpc_pass` and the OpenAI HTTP API (the `openai` SDK)
through `proxy_pass`, each to an upstream of both replicas. Requests must reach both; then
one replica gets SIGTERM under load: it must report NOT_SERVING, drain and exit 0, and every
request must end exactly once: completed, or refused cleanly before it was accepted and
retried by the client. A request that fails after it was accepted is lost.

    python -m tests.proxy_check PLAN [--streams 32]      (scripts/proxy_check.sh)
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.server_helpers import HttpServerProcess, free_port

# What a draining kiln answers to a request it did not accept (Frontend.check_ready; HTTP:
# 503 with code "unavailable"): the only failure a client may retry.
REFUSED = "accepts no new requests"
MAX_ATTEMPTS = 20
STREAM_DIED = "The stream is no longer in valid state"   # tritonclient's, on a dead stream
TALLY_FIELD = {"error": "errors"}      # an Attempt's outcome -> the Tally field it counts in

NGINX_CONF = """\
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
{user}
events {{ worker_connections 1024; }}
http {{
  access_log {d}/access.log;
  client_body_temp_path {d}/client_body;
  proxy_temp_path {d}/proxy;
  fastcgi_temp_path {d}/fastcgi;
  uwsgi_temp_path {d}/uwsgi;
  scgi_temp_path {d}/scgi;
  upstream kiln_grpc {{ {grpc_servers} }}
  upstream kiln_http {{ {http_servers} }}
  server {{
    listen 127.0.0.1:{grpc_port} http2;
    location / {{
      grpc_pass grpc://kiln_grpc;
      grpc_next_upstream error timeout non_idempotent;
      grpc_read_timeout 300s;
      grpc_send_timeout 300s;
    }}
  }}
  server {{
    listen 127.0.0.1:{http_port};
    location / {{
      proxy_pass http://kiln_http;
      proxy_next_upstream error timeout non_idempotent;
      proxy_http_version 1.1;
      proxy_buffering off;
      proxy_read_timeout 300s;
    }}
  }}
}}
"""


class Nginx:
    """Debian's nginx as the current user, everything (config, pid, logs, temp) under
    `workdir`: a gRPC port and an HTTP port, each load-balancing over `replicas`."""

    def __init__(self, workdir: Path, replicas: list[HttpServerProcess]):
        exe = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")
        if exe is None:
            raise FileNotFoundError("nginx is not installed (scripts/setup.sh installs it)")
        self.workdir = workdir
        self.grpc_port, self.http_port = free_port(), free_port()
        user = "user root;" if os.geteuid() == 0 else ""   # workers stay the owner of workdir
        conf = NGINX_CONF.format(
            d=workdir, user=user, grpc_port=self.grpc_port, http_port=self.http_port,
            grpc_servers=" ".join(f"server 127.0.0.1:{r.port};" for r in replicas),
            http_servers=" ".join(f"server 127.0.0.1:{r.http_port};" for r in replicas))
        (workdir / "nginx.conf").write_text(conf)
        self.proc = subprocess.Popen([exe, "-p", str(workdir), "-e", str(workdir / "error.log"),
                                      "-c", str(workdir / "nginx.conf"), "-g", "daemon off;"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not all(_accepts(p) for p in (self.grpc_port, self.http_port)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not start: {self.errors()}")
            time.sleep(0.05)

    def errors(self) -> str:
        log = self.workdir / "error.log"
        return log.read_text()[-3000:] if log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)   # graceful: workers finish and exit
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Tally:
    """Every request the clients made, and how it ended (updated under `lock`)."""
    requests: int = 0
    completed: int = 0
    retried: int = 0          # clean refusals (before acceptance) that the client sent again
    lost: int = 0             # accepted (a token came back, or cancelled) and not completed
    errors: int = 0           # any other failure
    samples: list[str] = field(default_factory=list)   # the first few failures, verbatim
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def note(self, what: str) -> None:
        with self.lock:
            if len(self.samples) < 10:
                self.samples.append(what)


@dataclass(frozen=True)
class Attempt:
    """One try of one request: completed, refused (clean, retry), lost or error."""
    outcome: str
    detail: str = ""


def _triton_inputs(prompt: str, max_tokens: int, ignore_eos: bool = False):
    import tritonclient.grpc as tc

    def tensor(name, dtype, value):
        t = tc.InferInput(name, [1, 1], dtype)
        t.set_data_from_numpy(np.array([[value]], dtype=object if dtype == "BYTES" else {
            "INT32": np.int32, "BOOL": bool, "FP32": np.float32}[dtype]))
        return t
    return [tensor("text_input", "BYTES", prompt.encode()),
            tensor("max_tokens", "INT32", max_tokens), tensor("stream", "BOOL", True),
            tensor("temperature", "FP32", 0.0)] + (
            [tensor("ignore_eos", "BOOL", True)] if ignore_eos else [])


def grpc_attempt(url: str, model: str, prompt: str, max_tokens: int,
                 first_token: threading.Event | None = None) -> Attempt:
    """One streamed KServe request on a new gRPC call (so the proxy picks a replica);
    `first_token` is set once a token came back (the request was accepted)."""
    import tritonclient.grpc as tc
    events: queue.Queue = queue.Queue()
    client = tc.InferenceServerClient(url)
    tokens = 0
    try:
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        client.async_stream_infer(model, _triton_inputs(prompt, max_tokens,
                                                        ignore_eos=first_token is not None),
                                  request_id="r")
        while True:
            result, error = events.get(timeout=120)
            if error is not None:
                return _failed(str(error), tokens)
            tokens += 1
            if first_token is not None:
                first_token.set()
            final = result.get_response().parameters["triton_final_response"].bool_param
            if final:
                return Attempt("completed")
    except Exception as e:     # the call itself failed (tritonclient raises its own type)
        if STREAM_DIED in str(e):
            # the stream ended before the request went out (a draining replica refusing the
            # call): tritonclient raises this and hands the server's error to the callback,
            # just after marking the stream dead
            try:
                _, error = events.get(timeout=10)
                if error is not None:
                    return _failed(str(error), tokens)
            except queue.Empty:
                pass
        return _failed(f"{type(e).__name__}: {e}", tokens)
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def http_attempt(base: str, model: str, prompt: str, max_tokens: int) -> Attempt:
    """One streamed OpenAI completion through the proxy's HTTP port."""
    import openai
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    tokens, finish = 0, None
    try:
        for chunk in client.completions.create(model=model, prompt=prompt, stream=True,
                                               max_tokens=max_tokens, temperature=0):
            tokens += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
    except openai.APIStatusError as e:
        if e.status_code == 503 and getattr(e, "code", None) == "unavailable" and not tokens:
            return Attempt("refused")
        return _failed(f"HTTP {e.status_code} {getattr(e, 'code', None)}: {e.message}", tokens)
    except Exception as e:
        return _failed(f"{type(e).__name__}: {e}", tokens)
    finally:
        client.close()
    if finish in ("stop", "length"):
        return Attempt("completed")
    return _failed(f"stream ended with finish_reason {finish!r}", tokens)


def _failed(message: str, tokens: int) -> Attempt:
    if REFUSED in message and not tokens:
        return Attempt("refused")
    if tokens or "cancel" in message:
        return Attempt("lost", message)
    return Attempt("error", message)


def one_request(tally: Tally, attempt, *args) -> None:
    """A request from a client that retries clean refusals (with a short pause)."""
    tally.add(requests=1)
    for _ in range(MAX_ATTEMPTS):
        a = attempt(*args)
        if a.outcome == "refused":
            tally.add(retried=1)
            time.sleep(0.02)
            continue
        tally.add(**{TALLY_FIELD.get(a.outcome, a.outcome): 1})
        if a.detail:
            tally.note(f"{a.outcome}: {a.detail}")
        return
    tally.add(errors=1)
    tally.note(f"error: still refused after {MAX_ATTEMPTS} attempts")


@dataclass
class Report:
    requests: int
    completed: int
    retried: int
    lost: int
    errors: int
    replica_requests: list[int]     # per replica, from its /metrics, before the SIGTERM
    in_flight_at_sigterm: int       # what the stopped replica said it was draining
    not_serving_seen: bool          # its health went NOT_SERVING before it exited
    exit_code: int                  # the stopped replica's
    completed_after_exit: int       # requests completed by the other one after that
    samples: list[str]

    @property
    def ok(self) -> bool:
        return (self.lost == self.errors == 0 and self.exit_code == 0 and self.not_serving_seen
                and all(self.replica_requests) and self.completed_after_exit > 0
                and self.requests == self.completed)


def _requests_served(replica: HttpServerProcess) -> int:
    return int(sum(v for k, v in replica.metrics().items()
                   if k.startswith("kiln_requests_total{")))


def _pin_long_request(tally: Tally, replica: HttpServerProcess, model: str,
                      max_tokens: int) -> threading.Thread:
    """One long request (EOS ignored) straight to `replica`, past the proxy; returns once
    its first token came back, so the replica is surely draining something at SIGTERM
    (the proxied requests of a tiny model are too short to be caught reliably)."""
    accepted = threading.Event()
    t = threading.Thread(target=one_request, daemon=True, args=(
        tally, grpc_attempt, replica.url, model, "a long request to drain", max_tokens,
        accepted))
    t.start()
    if not accepted.wait(120):
        raise TimeoutError(f"the pinned request got no token in 120s: {tally.samples}")
    return t


def _load(tally: Tally, stop: threading.Event, nginx: Nginx, model: str, streams: int,
          max_tokens: int) -> list[threading.Thread]:
    """`streams` client threads, one request at a time each until `stop`: three in four
    gRPC (tritonclient), one in four HTTP (openai)."""
    grpc_url = f"127.0.0.1:{nginx.grpc_port}"
    http_base = f"http://127.0.0.1:{nginx.http_port}"

    def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            prompt = f"client {i} request {n}: the quick brown fox"
            if i % 4 == 3:
                one_request(tally, http_attempt, http_base, model, prompt, max_tokens)
            else:
                one_request(tally, grpc_attempt, grpc_url, model, prompt, max_tokens)
            n += 1
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    return threads


def _wait_for(tally: Tally, completed: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while tally.completed < completed:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {tally.completed} of {completed} requests completed "
                               f"in {timeout}s: {tally.samples}")
        time.sleep(0.05)


def _watch_not_serving(replica: HttpServerProcess) -> bool:
    """Poll the replica's own health until it exits -> whether it said NOT_SERVING."""
    seen = False
    with grpc.insecure_channel(replica.url) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while replica.proc.poll() is None:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                seen |= r.status == health_pb2.HealthCheckResponse.NOT_SERVING
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    return seen


def run_check(plan: Path, workdir: Path, streams: int = 32, max_tokens: int = 48,
              drain_seconds: int = 60) -> Report:
    """Start two replicas and nginx, spread requests, SIGTERM replica 0 under `streams`
    concurrent streams, stop everything -> the Report."""
    model = json.loads((plan / "plan.json").read_text())["name"]
    long_tokens = max_tokens * 4     # fits the tiny plan's 256 positions at the default 48
    replicas = [HttpServerProcess(plan, "--drain-seconds", str(drain_seconds),
                                  log_path=workdir / f"replica{i}.log") for i in range(2)]
    nginx = None
    tally, stop = Tally(), threading.Event()
    threads: list[threading.Thread] = []
    try:
        for r in replicas:
            r.wait_serving()
        nginx = Nginx(workdir, replicas)
        for i in range(8):      # both protocols, one at a time: round robin over both
            one_request(tally, grpc_attempt if i % 2 else http_attempt,
                        f"127.0.0.1:{nginx.grpc_port}" if i % 2
                        else f"http://127.0.0.1:{nginx.http_port}", model, f"warm {i}", 8)
        spread = [_requests_served(r) for r in replicas]
        threads = _load(tally, stop, nginx, model, streams, max_tokens)
        _wait_for(tally, tally.completed + 2 * streams, 300)
        threads.append(_pin_long_request(tally, replicas[0], model, long_tokens))
        replicas[0].proc.send_signal(signal.SIGTERM)
        not_serving = _watch_not_serving(replicas[0])
        code = replicas[0].proc.wait()
        before = tally.completed
        _wait_for(tally, before + streams, 300)      # the other replica takes every request
        after = tally.completed - before
    finally:
        stop.set()
        for t in threads:
            t.join(300)
        if nginx is not None:
            nginx.stop()
        for r in replicas:
            r.terminate()
    drained = re.search(r"draining: (\d+) requests in flight", replicas[0].log())
    samples = list(tally.samples)
    if (tally.lost or tally.errors) and nginx is not None:   # what the proxy saw of them
        samples.append(f"nginx error.log: {nginx.errors()}")
    return Report(tally.requests, tally.completed, tally.retried, tally.lost, tally.errors,
                  spread, int(drained.group(1)) if drained else -1, not_serving, code, after,
                  samples)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("plan", type=Path)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--drain-seconds", type=int, default=60)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kiln-proxy-") as d:
        report = run_check(args.plan, Path(d), args.streams, args.max_tokens,
                           args.drain_seconds)
    print(json.dumps(asdict(report), indent=2))
    print(f"requests {report.requests}, completed {report.completed}, retried "
          f"{report.retried}, lost {report.lost}, errors {report.errors}; replica 0 drained "
          f"{report.in_flight_at_sigterm} in flight and exited {report.exit_code}: "
          f"{'OK' if report.ok else 'FAILED'}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
