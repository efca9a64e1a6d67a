#!/usr/bin/env bash
# The main job on the default spec: install, build the SmolLM2 CPU plan, serve it over gRPC,
# and answer a request through the server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
SPEC=${SPEC:-model_specs/smollm2-135m-cpu.yaml}
PORT=${PORT:-8001}
PLAN=plans/$(python -c "import sys,yaml;print(yaml.safe_load(open(sys.argv[1]))['name'])" "$SPEC")
kiln build "$SPEC"
kiln inspect "$PLAN"

kiln serve "$PLAN" --port "$PORT" --metrics-port $((PORT + 1)) > serve.log 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null || true' EXIT
# Wait until grpc.health.v1 says SERVING (the plan is verified and loaded).
python - "$PORT" "$SERVER" <<'PY'
import os, sys, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
port, pid = sys.argv[1], int(sys.argv[2])
stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
deadline = time.time() + 300
while time.time() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("kiln serve exited; see serve.log")
    try:
        if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
            sys.exit(0)
    except grpc.RpcError:
        pass
    time.sleep(1)
sys.exit("kiln serve did not become ready in 300 s; see serve.log")
PY
echo "--- kiln serve is up on 127.0.0.1:$PORT; asking it over gRPC:"
kiln generate --url "127.0.0.1:$PORT" "What is the capital of France?" --chat --max-tokens 48
kill -TERM "$SERVER"
wait "$SERVER"
trap - EXIT
echo "--- server drained and exited cleanly"
