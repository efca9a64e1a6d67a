#!/usr/bin/env bash
# Install, then run every test tier that runs here (unit, model, e2e; gpu skips without CUDA).
# Extra arguments go to pytest (e.g. -m unit).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
set +e
python -m pytest -ra -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
