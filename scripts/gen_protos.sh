#!/usr/bin/env bash
# Regenerate the Python code of runtime/server/proto/*.proto (checked in).
# Usage: scripts/gen_protos.sh [OUT_ROOT]   (default: the repository root)
# tests/unit/test_protos.py runs this into a temporary directory and compares.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-$ROOT}"
PY="${PYTHON:-python}"
cd "$ROOT"
mkdir -p "$OUT/runtime/server/proto"
"$PY" -m grpc_tools.protoc -I . --python_out="$OUT" --pyi_out="$OUT" \
    --grpc_python_out="$OUT" runtime/server/proto/kiln.proto
