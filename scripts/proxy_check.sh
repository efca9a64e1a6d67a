#!/usr/bin/env bash
# Two `kiln serve` replicas of PLAN behind nginx (gRPC and OpenAI HTTP through the proxy);
# SIGTERM one under 32 concurrent streams; print requests, completed, retried, lost, errors.
# Exit 1 unless nothing was lost, nothing failed and the replica drained and exited 0.
#   scripts/proxy_check.sh [PLAN] [--streams N] [--max-tokens N] [--drain-seconds N]
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
PLAN=${1:-plans/smollm2-135m-throughput-cpu}
shift || true
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  echo "error: nginx is not installed (scripts/setup.sh installs it as root:" \
       "apt-get install nginx)" >&2
  exit 2
fi
if [ ! -f "$PLAN/plan.json" ]; then
  echo "error: $PLAN is not a plan (no plan.json); build one with kiln build" >&2
  exit 2
fi
exec python -m tests.proxy_check "$PLAN" "$@"
