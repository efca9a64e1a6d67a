"""A plan from its OCI image to SERVING (not a test).

    python -m bench.startup plans/smollm2-135m-throughput-cpu [--rounds 3]
        [--threads 2] [--out bench/results/startup.json]

Packages the plan (`kiln package`), then each round: unpacks it from the image into a new
directory (`kiln unpack`'s code: every blob checked, then extracted; its time is reported
alone: on Kubernetes the runtime pulls an image volume), starts `kiln serve` on the unpacked
plan the way the chart does (the `kiln` script, --threads and OMP_NUM_THREADS set together)
and polls grpc.health.v1 every 20 ms from the process start until SERVING. Reported per
round: unpack seconds, start -> SERVING seconds, and the server's own load time (plan read,
checksums, engine start: its log's "loaded in"), the rest being Python and library imports
and binding the ports.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kiln.runtime.tools.package import package_plan, unpack_layout


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def to_serving(plan: Path, threads: int, log: Path, timeout: float = 120.0) -> dict:
    """Start kiln serve on `plan`, poll health until SERVING; SIGTERM it -> the timings."""
    port, metrics = _free_port(), _free_port()
    exe = shutil.which("kiln", path=str(Path(sys.executable).parent)) or "kiln"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen([exe, "serve", str(plan), "--host", "127.0.0.1",
                                 f"--port={port}", f"--metrics-port={metrics}",
                                 f"--threads={threads}"], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
        try:
            serving = _poll(f"127.0.0.1:{port}", proc, t0, timeout)
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
    text = log.read_text()
    loaded = re.search(r"loaded in ([0-9.]+)s", text)
    if serving is None or loaded is None or code != 0:
        raise RuntimeError(f"kiln serve did not reach SERVING / exit 0 ({code}): {text[-2000:]}")
    return {"start_to_serving_s": round(serving, 3), "load_s": float(loaded.group(1))}


def _poll(address: str, proc, t0: float, timeout: float):
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() - t0 < timeout and proc.poll() is None:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic() - t0
            except grpc.RpcError:
                pass
            time.sleep(0.02)
    return None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("plan", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench/results/startup.json"))
    args = p.parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="kiln-startup-") as d:
        work = Path(d)
        packaged = package_plan(args.plan, work / "oci")
        for i in range(args.rounds):
            t0 = time.monotonic()
            plan = unpack_layout(work / "oci", work / f"unpacked{i}" / packaged.name)
            unpack = time.monotonic() - t0
            r = {"unpack_s": round(unpack, 3), **to_serving(plan, args.threads,
                                                            work / f"serve{i}.log")}
            print(json.dumps(r), flush=True)
            rounds.append(r)
    report = {
        "plan": str(args.plan), "plan_name": packaged.name,
        "manifest_digest": packaged.manifest.digest, "layer_bytes": packaged.layer.size,
        "threads": args.threads, "host": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "rounds": rounds,
        "median": {k: statistics.median(r[k] for r in rounds) for k in rounds[0]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["median"]))


if __name__ == "__main__":
    main()
