#!/usr/bin/env bash
# Regenerate the Python code of runtime/server/proto/*.proto (checked in).
# Usage: scripts/gen_protos.sh [OUT_ROOT]   (default: the repository root)
# tests/unit/test_protos.py runs this into a temporary directory and compares.
# protoc names the generated modules after the .proto's path under its include root, so the
# .proto is staged as kiln/runtime/server/proto/kiln.proto: the module kiln.runtime.server.proto.kiln_pb2.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-$ROOT}"
PY="${PYTHON:-python}"
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/src/kiln/runtime/server/proto" "$OUT/runtime/server/proto"
cp "$ROOT/runtime/server/proto/kiln.proto" "$STAGE/src/kiln/runtime/server/proto/"
mkdir -p "$STAGE/out"
"$PY" -m grpc_tools.protoc -I "$STAGE/src" --python_out="$STAGE/out" --pyi_out="$STAGE/out" \
    --grpc_python_out="$STAGE/out" kiln/runtime/server/proto/kiln.proto
cp "$STAGE"/out/kiln/runtime/server/proto/kiln_pb2*.py* "$OUT/runtime/server/proto/"
