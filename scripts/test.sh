#!/usr/bin/env bash
# Install, then run every test tier that runs here (unit, model, e2e; gpu skips without CUDA).
# Extra arguments go to pytest as one run (e.g. -m unit).
#
# Without arguments, two runs: the e2e tier alone (it builds its SmolLM2 plans two at a time in
# the background while its tests run), then every other tier on one pytest worker per core (at
# most 4; KILN_TEST_WORKERS sets it). Most of those tests are single-threaded Python and
# compiles, so two workers on two cores take about half the time of one; builds of one plan
# by two workers run once (the second waits on the plan's lock and finds it up to date).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate

run() {
  set +e
  python -m pytest -ra -p no:cacheprovider "$@"
  local rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests ($*)" >&2
    return 1
  fi
  return "$rc"
}

if [ "$#" -gt 0 ]; then
  run "$@"
  exit $?
fi
workers=${KILN_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
rc=0
run -m e2e || rc=$?
run -m "not e2e" -n "$workers" --dist loadfile || rc=$?
exit "$rc"
